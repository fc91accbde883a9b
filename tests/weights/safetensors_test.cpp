#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "pipemat/weights/safetensors.h"

namespace pipemat::weights {
namespace {

namespace fs = std::filesystem;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pipemat_weights_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write_raw(const std::string& name, const std::string& bytes) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path.string();
  }
  // A file of header `json` (its true length) and `data`.
  std::string write_file(const std::string& name, const std::string& json,
                         const std::string& data) {
    return write_raw(name, le64(json.size()) + json + data);
  }
  // The WeightsError text of opening `path`; "" when it opened.
  static std::string error_of(const std::string& path) {
    try {
      SafetensorsFile file(path);
    } catch (const WeightsError& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, WritesTheReferenceLayoutAndReadsItBack) {
  const float a[3] = {1.0f, -2.5f, 3.25f};
  const int64_t b = 7;
  const std::string a_bytes(reinterpret_cast<const char*>(a), sizeof a);
  const std::string b_bytes(reinterpret_cast<const char*>(&b), sizeof b);
  std::ostringstream out;
  write_safetensors(out,
                    {{"z.weight", Dtype::kF32, {3}, a_bytes},
                     {"a.count", Dtype::kI64, {}, b_bytes},
                     {"empty", Dtype::kF32, {0, 4}, {}}},
                    {{"format", "pt"}});
  const std::string bytes = out.str();
  // I64 before F32, then names in order; the header padded to 8 bytes with spaces.
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a.count":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
      R"("empty":{"dtype":"F32","shape":[0,4],"data_offsets":[8,8]},)"
      R"("z.weight":{"dtype":"F32","shape":[3],"data_offsets":[8,20]}})";
  const std::string padded = json + std::string((8 - json.size() % 8) % 8, ' ');
  EXPECT_EQ(bytes, le64(padded.size()) + padded + b_bytes + a_bytes);

  const std::string path = write_raw("good.safetensors", bytes);
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 3u);
  EXPECT_EQ(file.tensors()[0].name, "a.count");
  EXPECT_EQ(file.data_start(), 8 + static_cast<int64_t>(padded.size()));
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  const TensorInfo* z = file.find("z.weight");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->dtype, Dtype::kF32);
  EXPECT_EQ(z->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(file.read("z.weight"), a_bytes);
  EXPECT_EQ(file.read("a.count"), b_bytes);
  EXPECT_EQ(file.find("a.count")->numel(), 1);
  EXPECT_EQ(file.read("empty"), "");
  EXPECT_EQ(file.find("nope"), nullptr);
  EXPECT_EQ(error_of(path), "");
  try {
    file.read("nope");
    ADD_FAILURE() << "read a tensor that is not there";
  } catch (const WeightsError& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'nope'"), std::string::npos) << e.what();
  }
  // The same tensors in another order give the same bytes.
  std::ostringstream again;
  write_safetensors(again,
                    {{"empty", Dtype::kF32, {0, 4}, {}},
                     {"z.weight", Dtype::kF32, {3}, a_bytes},
                     {"a.count", Dtype::kI64, {}, b_bytes}},
                    {{"format", "pt"}});
  EXPECT_EQ(again.str(), bytes);
}

TEST_F(SafetensorsTest, WriterRefusesBadTensors) {
  const std::string four(4, 'x');
  const auto error = [](std::vector<TensorBytes> tensors) -> std::string {
    std::ostringstream out;
    try {
      write_safetensors(out, std::move(tensors));
    } catch (const WeightsError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error({{"a", Dtype::kF32, {1}, four}, {"a", Dtype::kF32, {1}, four}})
                .find("tensor 'a' is given twice"),
            std::string::npos);
  EXPECT_NE(
      error({{"a", Dtype::kF32, {2}, four}}).find("has 4 bytes of data but its shape needs 8"),
      std::string::npos);
  EXPECT_NE(error({{"__metadata__", Dtype::kF32, {1}, four}}).find("cannot write"),
            std::string::npos);
}

TEST_F(SafetensorsTest, FileWriteIsAtomicAndDeterministic) {
  const std::string data(8, '\x01');
  const std::string path = (dir_ / "w.safetensors").string();
  write_safetensors_file(path, {{"w", Dtype::kF64, {1}, data}}, {{"k", "v"}, {"a", "b"}});
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  SafetensorsFile file(path);
  EXPECT_EQ(file.read("w"), data);
  EXPECT_EQ(file.metadata().at("a"), "b");
  std::ostringstream out;
  write_safetensors(out, {{"w", Dtype::kF64, {1}, data}}, {{"a", "b"}, {"k", "v"}});
  std::ifstream in(path, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), out.str());
}

// Each damaged file: a clear error that names the file and what is wrong, never a crash.
TEST_F(SafetensorsTest, BadFilesAreClearErrors) {
  const std::string t = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');
  struct Case {
    std::string name;
    std::string bytes;
    std::string expected;
  };
  const std::string good = "{" + t + "}";
  const auto with_header = [](const std::string& json) { return le64(json.size()) + json; };
  const std::vector<Case> cases = {
      {"empty", "", "too short for the 8-byte header length"},
      {"short_length", "\x05\x00\x00", "too short for the 8-byte header length"},
      {"truncated_header", le64(good.size()) + good.substr(0, 10),
       "the header length is " + std::to_string(good.size()) + " bytes but the file holds only 10"},
      {"truncated_data", le64(good.size()) + good + eight.substr(0, 5),
       "tensor 't': data_offsets [0, 8] reach past the data buffer of 5 bytes"},
      {"gigabytes", le64(uint64_t{3} << 30) + "{}", "above the cap of"},
      {"huge_length", le64(~uint64_t{0}) + "{}", "above the cap of"},
      {"not_json", le64(5) + "{nope", "the header is not valid JSON"},
      {"array_header", le64(2) + "[]", "the header is a JSON array, expected an object"},
      {"string_header", le64(4) + "\"x\" ", "the header is a JSON string"},
      {"unknown_dtype",
       with_header(R"({"t":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})") + eight.substr(0, 2),
       "tensor 't': unknown dtype 'F8'"},
      {"lying_size",
       with_header(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}} )") + eight,
       "tensor 't': data_offsets [0, 8] span 8 bytes but shape [3] of F32 needs 12"},
      {"lying_offsets",
       with_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}   )") + eight + eight,
       "tensor 't': data_offsets [8, 16] leave a hole of bytes [0, 8)"},
      {"past_end",
       with_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}   )") + eight,
       "reach past the data buffer of 8 bytes"},
      {"backwards",
       with_header(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}   )") + eight,
       "end before they begin"},
      {"duplicate", le64(good.size() * 2 - 1) + "{" + t + "," + t + "}" + eight,
       "tensor 't' appears twice in the header"},
      {"duplicate_field",
       with_header(R"({"t":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})") +
           eight,
       "tensor 't': field 'dtype' appears twice"},
      {"overlap",
       with_header(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})") +
           eight,
       "tensor 'b': data_offsets [4, 8] overlap tensor 'a' [0, 8]"},
      {"hole",
       with_header(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})") +
           eight + eight.substr(0, 4),
       "tensor 'b': data_offsets [8, 12] leave a hole of bytes [4, 8)"},
      {"trailing_bytes", le64(good.size()) + good + eight + "xy",
       "the data buffer holds 10 bytes but the tensors cover 8"},
      {"negative_shape",
       with_header(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})") + eight,
       "tensor 't': shape dimension -2 is negative"},
      {"float_shape",
       with_header(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})") + eight,
       "tensor 't': shape dimension 2.0 is not an integer"},
      {"overflowing_shape",
       with_header(
           R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}   )") +
           eight,
       "holds more bytes than fit 64 bits"},
      {"huge_offset",
       with_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})") +
           eight,
       "data_offsets end 18446744073709551615 is too large"},
      {"missing_field", with_header(R"({"t":{"dtype":"F32","shape":[2]}})") + eight,
       "tensor 't': no 'data_offsets'"},
      {"unknown_field",
       with_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})") + eight,
       "tensor 't': unknown field 'x'"},
      {"entry_not_object", with_header(R"({"t":12})"), "tensor 't': expected an object"},
      {"metadata_not_strings", with_header(R"({"__metadata__":{"k":1}}    )"),
       "__metadata__ 'k' is 1, expected a string"},
      // Note [Strict JSON]: what a lenient JSON reader would take.
      {"duplicate_metadata", with_header(R"({"__metadata__":{"k":"a","k":"b"}})"),
       "__metadata__ key 'k' appears twice"},
      {"nan_shape", with_header(R"({"t":{"dtype":"F32","shape":[NaN],"data_offsets":[0,8]}})"),
       "the header is not valid JSON (parse error at line 1, column 30: syntax error while "
       "parsing value - invalid literal"},
      {"overflowing_number",
       with_header(R"({"t":{"dtype":"F32","shape":[1e999],"data_offsets":[0,8]}})"),
       "the header is not valid JSON (parse error at line 1, column 34: number overflow parsing "
       "'1e999')"},
      {"invalid_utf8", with_header("{\"t\xff\":{}}"),
       "the header is not valid JSON (parse error at line 1, column 4: syntax error while parsing "
       "object key - invalid string: ill-formed UTF-8 byte; last read: '\"t\\xff'"},
      {"deep", with_header("{\"t\":" + std::string(200, '[') + std::string(200, ']') + "}"),
       "in the header, the value at 't[0][0]"},
  };
  for (const Case& c : cases) {
    const std::string path = write_raw(c.name + ".safetensors", c.bytes);
    const std::string error = error_of(path);
    EXPECT_NE(error.find(c.expected), std::string::npos)
        << c.name << ": expected '" << c.expected << "' in '" << error << "'";
    EXPECT_NE(error.find(path), std::string::npos) << c.name << ": " << error;
    // The bytes in memory are checked as the file is, with the same error.
    try {
      parse_safetensors(c.bytes, path);
      ADD_FAILURE() << c.name << ": parse_safetensors took it";
    } catch (const WeightsError& e) {
      EXPECT_EQ(e.what(), error) << c.name;
    }
  }
}

TEST_F(SafetensorsTest, BytesInMemoryReadAsTheFile) {
  const std::string four(4, '\x02');
  const std::string path = (dir_ / "m.safetensors").string();
  write_safetensors_file(path, {{"x", Dtype::kF32, {1}, four}, {"b", Dtype::kU8, {2}, "ab"}},
                         {{"format", "pt"}});
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const SafetensorsFile file(path);
  const SafetensorsHeader header = parse_safetensors(bytes, "memory");
  EXPECT_EQ(header.data_start, file.data_start());
  EXPECT_EQ(header.metadata, file.metadata());
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors[0].name, "b");  // name order
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(header.tensors[i].name, file.tensors()[i].name);
    EXPECT_EQ(header.tensors[i].begin, file.tensors()[i].begin);
    EXPECT_EQ(header.tensors[i].end, file.tensors()[i].end);
    EXPECT_EQ(header.tensors[i].shape, file.tensors()[i].shape);
  }
}

TEST_F(SafetensorsTest, NotAFileIsAClearError) {
  EXPECT_NE(error_of((dir_ / "missing.safetensors").string()).find("cannot open"),
            std::string::npos);
  EXPECT_EQ(error_of(dir_.string()),
            "weights: '" + dir_.string() +
                "' is a directory; expected a regular file (copy the data into a file and give "
                "its path)");
  // Note [Opening an input file]: a FIFO or a link to /dev/zero is refused at once, not read.
  const std::string fifo = (dir_ / "pipe.safetensors").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of(fifo), "weights: '" + fifo +
                                "' is a FIFO (named pipe); expected a regular file (copy the data "
                                "into a file and give its path)");
  const std::string zero = (dir_ / "zero.safetensors").string();
  fs::create_symlink("/dev/zero", zero);
  EXPECT_EQ(error_of(zero), "weights: '" + zero +
                                "' is a character device; expected a regular file (copy the data "
                                "into a file and give its path)");
}

TEST_F(SafetensorsTest, DirectoryWithAnIndexMapsEachNameToItsFile) {
  const std::string four(4, '\x02');
  const std::string eight(8, '\x03');
  fs::create_directories(dir_ / "sharded");
  write_safetensors_file((dir_ / "sharded/a.safetensors").string(), {{"x", Dtype::kF32, {1}, four}},
                         {{"format", "pt"}});
  write_safetensors_file((dir_ / "sharded/b.safetensors").string(),
                         {{"y", Dtype::kI64, {1}, eight}, {"z", Dtype::kI32, {1}, four}});
  const std::string index =
      R"({"metadata":{"total_size":16},"weight_map":{"x":"a.safetensors","y":"b.safetensors","z":"b.safetensors"}})";
  write_raw("sharded/model.safetensors.index.json", index);
  WeightSource source((dir_ / "sharded").string());
  EXPECT_EQ(source.names(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(source.read("y"), eight);
  EXPECT_EQ(source.read("x"), four);
  EXPECT_EQ(source.find("z")->dtype, Dtype::kI32);
  EXPECT_EQ(source.metadata().at("format"), "pt");
  EXPECT_EQ(source.file_of("y").path(), (dir_ / "sharded/b.safetensors").string());
  EXPECT_EQ(source.find("w"), nullptr);

  // An index that names a tensor a file lacks, or misses one a file holds.
  const auto error = [&](const std::string& text) -> std::string {
    write_raw("sharded/model.safetensors.index.json", text);
    try {
      WeightSource bad((dir_ / "sharded").string());
    } catch (const WeightsError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(
      error(
          R"({"weight_map":{"x":"a.safetensors","w":"a.safetensors","y":"b.safetensors","z":"b.safetensors"}})")
          .find("maps tensor 'w' to a.safetensors, which has no such tensor"),
      std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})")
                .find("holds tensor 'z', which"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"x":"../a.safetensors"}})").find("expected the name of a file"),
            std::string::npos);
  EXPECT_NE(error(R"([1])").find("weight_map"), std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"x":"a.safetensors","x":"b.safetensors"}})")
                .find("model.safetensors.index.json: tensor 'x' appears twice in weight_map"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"x":"a.safetensors"}} {})").find("not valid JSON (parse error"),
            std::string::npos);

  // A directory with one model.safetensors, and one with neither.
  fs::create_directories(dir_ / "single");
  write_safetensors_file((dir_ / "single/model.safetensors").string(),
                         {{"x", Dtype::kF32, {1}, four}});
  EXPECT_EQ(WeightSource((dir_ / "single").string()).read("x"), four);
  fs::create_directories(dir_ / "none");
  try {
    WeightSource none((dir_ / "none").string());
    ADD_FAILURE() << "opened an empty directory";
  } catch (const WeightsError& e) {
    EXPECT_NE(std::string(e.what()).find("holds neither"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsDtype, NamesAndSizes) {
  for (const auto& [name, size] : std::vector<std::pair<std::string, int64_t>>{{"F64", 8},
                                                                               {"F32", 4},
                                                                               {"F16", 2},
                                                                               {"BF16", 2},
                                                                               {"I64", 8},
                                                                               {"I32", 4},
                                                                               {"I16", 2},
                                                                               {"I8", 1},
                                                                               {"U8", 1},
                                                                               {"BOOL", 1}}) {
    const auto d = dtype_from_string(name);
    ASSERT_TRUE(d.has_value()) << name;
    EXPECT_EQ(to_string(*d), name);
    EXPECT_EQ(element_size(*d), size);
  }
  EXPECT_FALSE(dtype_from_string("f32").has_value());
  EXPECT_FALSE(dtype_from_string("F8_E4M3").has_value());
}

}  // namespace
}  // namespace pipemat::weights
