// The reference implementation as the oracle: Python's safetensors package (tests/weights/
// oracle.py) writes files pipemat reads, and reads the files pipemat writes.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "pipemat/weights/safetensors.h"

namespace pipemat::weights {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

// The exit status of `oracle.py args`, its output in `output`.
int oracle(const std::string& args, std::string& output, const fs::path& dir) {
  const fs::path log = dir / "oracle.log";
  const std::string command = std::string("'") + PIPEMAT_WEIGHTS_PYTHON + "' '" +
                              PIPEMAT_WEIGHTS_ORACLE + "' " + args + " > '" + log.string() +
                              "' 2>&1";
  const int status = std::system(command.c_str());
  output = slurp(log);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class OracleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pipemat_weights_oracle_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string output;
    const int rc = oracle("write '" + dir_.string() + "'", output, dir_);
    if (rc == 3) GTEST_SKIP() << "Python's safetensors is not installed: " << output;
    ASSERT_EQ(rc, 0) << output;
    expected_ = nlohmann::json::parse(slurp(dir_ / "expected.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  // expected.json's tensors, to write.
  std::vector<TensorBytes> expected_tensors(std::vector<std::string>& storage) const {
    std::vector<TensorBytes> out;
    storage.reserve(expected_["tensors"].size());
    for (const auto& item : expected_["tensors"].items()) {
      storage.push_back(from_hex(item.value()["hex"].get<std::string>()));
      out.push_back({item.key(), *dtype_from_string(item.value()["dtype"].get<std::string>()),
                     item.value()["shape"].get<std::vector<int64_t>>(), storage.back()});
    }
    return out;
  }

  template <typename Source>
  void expect_all_equal(const Source& source, size_t count) const {
    size_t seen = 0;
    for (const auto& item : expected_["tensors"].items()) {
      const TensorInfo* t = source.find(item.key());
      ASSERT_NE(t, nullptr) << item.key();
      EXPECT_EQ(to_string(t->dtype), item.value()["dtype"].get<std::string>()) << item.key();
      EXPECT_EQ(t->shape, item.value()["shape"].get<std::vector<int64_t>>()) << item.key();
      EXPECT_EQ(source.read(item.key()), from_hex(item.value()["hex"].get<std::string>()))
          << item.key();
      ++seen;
    }
    EXPECT_EQ(seen, count);
  }

  fs::path dir_;
  nlohmann::json expected_;
};

TEST_F(OracleTest, PythonsFileReadsBackEqual) {
  SafetensorsFile file((dir_ / "python.safetensors").string());
  ASSERT_EQ(file.tensors().size(), 13u);  // ten dtypes, a scalar, an empty tensor, one more
  expect_all_equal(file, file.tensors().size());
  EXPECT_EQ(file.find("scalar")->shape, std::vector<int64_t>{});
  EXPECT_EQ(file.find("empty")->bytes(), 0);
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
}

TEST_F(OracleTest, PythonsShardedDirectoryReadsBackEqual) {
  WeightSource source((dir_ / "sharded").string());
  EXPECT_EQ(source.names().size(), 13u);
  expect_all_equal(source, 13);
  EXPECT_EQ(source.metadata().at("format"), "pt");
}

TEST_F(OracleTest, PipematsFileIsByteIdenticalToPythons) {
  std::vector<std::string> storage;
  const std::string path = (dir_ / "pipemat.safetensors").string();
  write_safetensors_file(path, expected_tensors(storage), {{"format", "pt"}});
  EXPECT_EQ(slurp(path), slurp(dir_ / "python.safetensors"));
  std::string output;
  EXPECT_EQ(oracle("load '" + path + "' '" + (dir_ / "expected.json").string() + "'", output, dir_),
            0)
      << output;
}

// Python writes several metadata keys in its hash map's order, so only loading is compared.
TEST_F(OracleTest, PythonLoadsPipematsFileWithMetadata) {
  std::vector<std::string> storage;
  const std::string path = (dir_ / "pipemat-meta.safetensors").string();
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"pipemat.kind", "gpt"}, {"note", "quotes \" and \\ and \xc3\xa9"}};
  write_safetensors_file(path, expected_tensors(storage), metadata);
  nlohmann::json with_metadata = expected_;
  with_metadata["metadata"] = metadata;
  std::ofstream((dir_ / "expected-meta.json").string()) << with_metadata.dump();
  std::string output;
  EXPECT_EQ(
      oracle("load '" + path + "' '" + (dir_ / "expected-meta.json").string() + "'", output, dir_),
      0)
      << output;
  EXPECT_EQ(SafetensorsFile(path).metadata(), metadata);
}

}  // namespace
}  // namespace pipemat::weights
