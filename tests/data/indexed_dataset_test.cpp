// Megatron indexed datasets (pipemat/data/indexed_dataset.h): megatron-core as the oracle
// (indexed_oracle.py: its IndexedDatasetBuilder writes datasets pipemat reads, its IndexedDataset
// reads what pipemat writes, and the two writers' files are compared byte for byte), each damaged
// file refused naming the file and the reason (Note [Indexed dataset checks]), the writer's
// refusals and crash safety (Note [Indexed dataset writes]), and the cost of a micro-batch's reads.

#include "pipemat/data/indexed_dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

// In a namespace of their own: the unity build compiles this file with tokenizer_test.cpp.
namespace pipemat::data::indexed_test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Documents of sequences of token ids.
using Documents = std::vector<std::vector<std::vector<int64_t>>>;

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A scratch directory, removed with its content.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("pipemat_indexed_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string prefix(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

constexpr TokenDtype kAllDtypes[] = {TokenDtype::uint8, TokenDtype::int8,  TokenDtype::int16,
                                     TokenDtype::int32, TokenDtype::int64, TokenDtype::uint16};

// The smallest and largest id `dtype` holds (int32's when `int32_only`: what the writer takes).
std::pair<int64_t, int64_t> id_range(TokenDtype dtype, bool int32_only) {
  switch (dtype) {
    case TokenDtype::uint8:
      return {0, 255};
    case TokenDtype::int8:
      return {-128, 127};
    case TokenDtype::int16:
      return {-32768, 32767};
    case TokenDtype::uint16:
      return {0, 65535};
    case TokenDtype::int32:
      return {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
    case TokenDtype::int64:
      if (int32_only) return id_range(TokenDtype::int32, false);
      return {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
  }
  return {0, 0};
}

// Several documents of several sequences: an empty sequence, an empty document, a one-token
// sequence, the dtype's extremes, random ids.
Documents make_documents(TokenDtype dtype, bool int32_only, uint32_t seed) {
  const auto [lo, hi] = id_range(dtype, int32_only);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> id(lo, hi);
  const auto sequence = [&](int length) {
    std::vector<int64_t> s(static_cast<size_t>(length));
    for (int64_t& v : s) v = id(rng);
    return s;
  };
  Documents docs;
  docs.push_back({{lo, hi, 0, 1, hi - 1}, {}, sequence(17)});
  docs.push_back({sequence(1)});
  docs.push_back({});
  docs.push_back({sequence(3), sequence(40), {}, sequence(9)});
  docs.push_back({sequence(64), sequence(2)});
  return docs;
}

std::vector<int64_t> concatenation(const Documents& docs) {
  std::vector<int64_t> out;
  for (const auto& doc : docs) {
    for (const auto& s : doc) out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

std::vector<int64_t> document_indices_of(const Documents& docs) {
  std::vector<int64_t> out{0};
  for (const auto& doc : docs) out.push_back(out.back() + static_cast<int64_t>(doc.size()));
  return out;
}

std::vector<std::vector<int64_t>> sequences_of(const Documents& docs) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& doc : docs) out.insert(out.end(), doc.begin(), doc.end());
  return out;
}

void write_with_pipemat(const std::string& prefix, TokenDtype dtype, const Documents& docs,
                        bool overwrite = false) {
  IndexedDatasetWriter writer(prefix, dtype, overwrite);
  for (const auto& doc : docs) {
    for (const auto& s : doc) {
      const std::vector<int32_t> ids(s.begin(), s.end());
      writer.add_sequence(ids);
    }
    writer.end_document();
  }
  writer.finish();
}

// Every sequence, boundary and token of `ds` is that of `docs`.
void expect_dataset(const IndexedDataset& ds, TokenDtype dtype, const Documents& docs) {
  const auto sequences = sequences_of(docs);
  const auto all = concatenation(docs);
  EXPECT_EQ(ds.dtype(), dtype);
  EXPECT_EQ(ds.documents(), static_cast<int64_t>(docs.size()));
  ASSERT_EQ(ds.sequences(), static_cast<int64_t>(sequences.size()));
  EXPECT_EQ(ds.tokens(), static_cast<int64_t>(all.size()));
  EXPECT_EQ(ds.document_indices(), document_indices_of(docs));
  int64_t offset = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    EXPECT_EQ(ds.sequence_offsets()[i], offset) << "sequence " << i;
    EXPECT_EQ(ds.sequence_length(static_cast<int64_t>(i)),
              static_cast<int64_t>(sequences[i].size()));
    EXPECT_EQ(ds.sequence(static_cast<int64_t>(i)), sequences[i]) << "sequence " << i;
    offset += static_cast<int64_t>(sequences[i].size());
  }
  EXPECT_EQ(ds.sequence_offsets().back(), offset);
  std::vector<int64_t> read(all.size());
  ds.read_tokens(0, ds.tokens(), read.data());
  EXPECT_EQ(read, all);
  // A window across sequence and document boundaries.
  if (all.size() >= 40) {
    std::vector<int64_t> window(30);
    ds.read_tokens(10, 30, window.data());
    EXPECT_EQ(window, std::vector<int64_t>(all.begin() + 10, all.begin() + 40));
  }
  EXPECT_EQ(ds.max_token(), *std::max_element(all.begin(), all.end()));
}

// ---- megatron-core as the oracle ----

// Runs `indexed_oracle.py args` with stdout to `out`; the exit status, the output in `output`.
int oracle(const std::string& args, const fs::path& dir, std::string& output) {
  const fs::path out = dir / "oracle.out";
  const fs::path err = dir / "oracle.err";
  const std::string command = std::string("'") + PIPEMAT_DATA_PYTHON + "' '" + PIPEMAT_DATA_DIR +
                              "/indexed_oracle.py' " + args + " > '" + out.string() + "' 2> '" +
                              err.string() + "'";
  const int status = std::system(command.c_str());
  output = slurp(out);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc != 0) output += slurp(err);
  return rc;
}

nlohmann::json spec_entry(const std::string& prefix, TokenDtype dtype, const Documents& docs) {
  return {{"prefix", prefix}, {"dtype", to_string(dtype)}, {"documents", docs}};
}

TEST(IndexedDatasetOracle, ReadsWhatMegatronCoreWrites) {
  TempDir dir;
  nlohmann::json spec = {{"datasets", nlohmann::json::array()}};
  const TokenDtype dtypes[] = {TokenDtype::uint16, TokenDtype::int32, TokenDtype::uint8,
                               TokenDtype::int64,  TokenDtype::int8,  TokenDtype::int16};
  for (const TokenDtype dtype : dtypes) {
    spec["datasets"].push_back(spec_entry(dir.prefix(std::string("mc_") + to_string(dtype)), dtype,
                                          make_documents(dtype, false, 11)));
  }
  spec["datasets"].push_back(spec_entry(dir.prefix("mc_empty"), TokenDtype::uint16, {}));
  spit(dir.path() / "spec.json", spec.dump());
  std::string output;
  const int rc = oracle("write '" + (dir.path() / "spec.json").string() + "'", dir.path(), output);
  if (rc == 3) GTEST_SKIP() << "megatron-core is not installed: " << output;
  ASSERT_EQ(rc, 0) << output;
  for (const TokenDtype dtype : dtypes) {
    SCOPED_TRACE(to_string(dtype));
    const IndexedDataset ds =
        IndexedDataset::open(dir.prefix(std::string("mc_") + to_string(dtype)));
    expect_dataset(ds, dtype, make_documents(dtype, false, 11));
  }
  const IndexedDataset empty = IndexedDataset::open(dir.prefix("mc_empty"));
  EXPECT_EQ(empty.sequences(), 0);
  EXPECT_EQ(empty.documents(), 0);
  EXPECT_EQ(empty.tokens(), 0);
  EXPECT_EQ(empty.document_indices(), std::vector<int64_t>{0});
  EXPECT_EQ(empty.max_token(), -1);
}

TEST(IndexedDatasetOracle, MegatronCoreReadsWhatPipematWritesAndTheBytesAreTheBuilders) {
  TempDir dir;
  nlohmann::json spec = {{"datasets", nlohmann::json::array()}};
  std::string read_args;
  for (const TokenDtype dtype : kAllDtypes) {
    const std::string name = to_string(dtype);
    const Documents docs = make_documents(dtype, true, 23);
    write_with_pipemat(dir.prefix("pm_" + name), dtype, docs);
    spec["datasets"].push_back(spec_entry(dir.prefix("mc_" + name), dtype, docs));
    read_args += " '" + dir.prefix("pm_" + name) + "'";
  }
  // No tokens: megatron-core's IndexedDataset cannot open it (numpy cannot map an empty .bin),
  // so only the bytes are compared.
  write_with_pipemat(dir.prefix("pm_empty"), TokenDtype::int32, {{}, {{}}});
  spec["datasets"].push_back(spec_entry(dir.prefix("mc_empty"), TokenDtype::int32, {{}, {{}}}));
  spit(dir.path() / "spec.json", spec.dump());
  std::string output;
  const int rc = oracle("write '" + (dir.path() / "spec.json").string() + "' read" + read_args,
                        dir.path(), output);
  if (rc == 3) GTEST_SKIP() << "megatron-core is not installed: " << output;
  ASSERT_EQ(rc, 0) << output;

  std::map<std::string, nlohmann::json> read;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    read[j["prefix"].get<std::string>()] = j;
  }
  for (const TokenDtype dtype : kAllDtypes) {
    const std::string name = to_string(dtype);
    SCOPED_TRACE(name);
    const Documents docs = make_documents(dtype, true, 23);
    const nlohmann::json& j = read.at(dir.prefix("pm_" + name));
    EXPECT_EQ(j["dtype"].get<std::string>(), name);
    EXPECT_EQ(j["sequences"].get<std::vector<std::vector<int64_t>>>(), sequences_of(docs));
    EXPECT_EQ(j["document_indices"].get<std::vector<int64_t>>(), document_indices_of(docs));
    for (const char* ext : {".bin", ".idx"}) {
      EXPECT_EQ(slurp(dir.prefix("pm_" + name) + ext), slurp(dir.prefix("mc_" + name) + ext))
          << ext << " differs from IndexedDatasetBuilder's";
    }
  }
  EXPECT_EQ(slurp(dir.prefix("pm_empty.idx")), slurp(dir.prefix("mc_empty.idx")));
  EXPECT_EQ(slurp(dir.prefix("pm_empty.bin")), "");
}

// ---- pipemat alone ----

TEST(IndexedDataset, WritesAndReadsBackEveryDtype) {
  TempDir dir;
  for (const TokenDtype dtype : kAllDtypes) {
    SCOPED_TRACE(to_string(dtype));
    const Documents docs = make_documents(dtype, true, 5);
    write_with_pipemat(dir.prefix(to_string(dtype)), dtype, docs);
    const IndexedDataset ds = IndexedDataset::open(dir.prefix(to_string(dtype)));
    expect_dataset(ds, dtype, docs);
    EXPECT_EQ(ds.idx_path(), dir.prefix(to_string(dtype)) + ".idx");
    EXPECT_EQ(ds.bin_path(), dir.prefix(to_string(dtype)) + ".bin");
  }
}

TEST(IndexedDataset, MovesKeepTheOpenFile) {
  TempDir dir;
  const Documents docs = make_documents(TokenDtype::uint16, true, 3);
  write_with_pipemat(dir.prefix("d"), TokenDtype::uint16, docs);
  IndexedDataset a = IndexedDataset::open(dir.prefix("d"));
  IndexedDataset b = std::move(a);
  fs::remove(dir.prefix("d.bin"));  // the descriptor stays open
  expect_dataset(b, TokenDtype::uint16, docs);
  a = std::move(b);
  EXPECT_EQ(a.tokens(), static_cast<int64_t>(concatenation(docs).size()));
}

TEST(IndexedDataset, DtypeForVocabIsMegatronCoresRule) {
  EXPECT_EQ(dtype_for_vocab(1), TokenDtype::uint16);
  EXPECT_EQ(dtype_for_vocab(32000), TokenDtype::uint16);
  EXPECT_EQ(dtype_for_vocab(65499), TokenDtype::uint16);
  EXPECT_EQ(dtype_for_vocab(65500), TokenDtype::int32);
  EXPECT_EQ(dtype_for_vocab(128256), TokenDtype::int32);
  EXPECT_EQ(dtype_for_vocab(int64_t{1} << 31), TokenDtype::int32);
  EXPECT_THROW(dtype_for_vocab(0), DataError);
  EXPECT_THROW(dtype_for_vocab((int64_t{1} << 31) + 1), DataError);
  EXPECT_EQ(megatron_dtype_code(TokenDtype::uint16), 8);
  EXPECT_EQ(megatron_dtype_code(TokenDtype::int32), 4);
  EXPECT_EQ(token_size(TokenDtype::int64), 8);
}

TEST(IndexedDataset, EncodeParsesBack) {
  IndexedIndex index;
  index.dtype = TokenDtype::int16;
  index.sequence_offsets = {0, 3, 3, 10};
  index.document_indices = {0, 2, 2, 3};
  const std::string bytes = encode_indexed_index(index);
  EXPECT_EQ(bytes.size(), 34u + 12 * 3 + 8 * 4);
  const IndexedIndex back = parse_indexed_index(bytes, 20, "x.idx", "x.bin");
  EXPECT_EQ(back.dtype, index.dtype);
  EXPECT_EQ(back.sequence_offsets, index.sequence_offsets);
  EXPECT_EQ(back.document_indices, index.document_indices);
}

// ---- damaged files ----

// A valid uint16 dataset: 3 documents, 5 sequences (one empty), 9 tokens.
const Documents kSmall = {{{1, 2, 3}, {}}, {{4, 999, 5}}, {{6}, {7, 8}}};

struct Damaged {
  TempDir dir;
  std::string prefix = dir.prefix("d");
  std::string idx_path = prefix + ".idx";
  std::string bin_path = prefix + ".bin";
  std::string idx;  // the valid .idx's bytes
  std::string bin;

  Damaged() {
    write_with_pipemat(prefix, TokenDtype::uint16, kSmall);
    idx = slurp(idx_path);
    bin = slurp(bin_path);
  }
  // The DataError text of opening the prefix; "" when it opens.
  std::string open_error() const {
    try {
      IndexedDataset::open(prefix);
    } catch (const DataError& e) {
      return e.what();
    }
    return "";
  }
  template <class T>
  void patch_idx(size_t offset, T value) {
    std::string bytes = idx;
    std::memcpy(bytes.data() + offset, &value, sizeof(T));
    spit(idx_path, bytes);
  }
};

// Offsets in the .idx of kSmall: 5 sequences.
constexpr size_t kLengths = 34;
constexpr size_t kPointers = kLengths + 4 * 5;
constexpr size_t kDocuments = kPointers + 8 * 5;

TEST(IndexedDataset, RefusesATruncatedBin) {
  Damaged d;
  spit(d.bin_path, d.bin.substr(0, d.bin.size() - 2));
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.bin_path + ": holds 16 bytes but " + d.idx_path +
                        " gives its 5 sequences 9 tokens of uint16, 18 bytes; the .bin is "
                        "truncated"));
}

TEST(IndexedDataset, RefusesABinWithBytesNoSequenceOwns) {
  Damaged d;
  spit(d.bin_path, d.bin + "xx");
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.bin_path + ": holds 20 bytes but " + d.idx_path +
                        " gives its 5 sequences 9 tokens of uint16, 18 bytes; "
                        "bytes after the last sequence belong to none"));
}

TEST(IndexedDataset, RefusesCountsBeyondTheIdx) {
  Damaged d;
  d.patch_idx<uint64_t>(18, uint64_t{1} << 62);
  EXPECT_THAT(d.open_error(), HasSubstr("indexed dataset: " + d.idx_path + ": sequence count " +
                                        std::to_string(uint64_t{1} << 62) +
                                        " needs 12 bytes each of lengths and pointers but the "
                                        "file holds only 92 bytes after its header"));
  d.patch_idx<uint64_t>(26, 1000);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": document count 1000 needs 8 bytes each of document indices but the "
                        "file holds only 32 bytes after the 5 sequences' lengths and pointers"));
  d.patch_idx<uint64_t>(26, 0);
  EXPECT_THAT(d.open_error(), HasSubstr("indexed dataset: " + d.idx_path +
                                        ": document count 0; a .idx holds "
                                        "documents + 1 document indices"));
  spit(d.idx_path, d.idx.substr(0, d.idx.size() - 3));
  EXPECT_THAT(d.open_error(), HasSubstr("indexed dataset: " + d.idx_path + ": document count 4"));
  spit(d.idx_path, d.idx.substr(0, 20));
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": 20 bytes, too short for the 34-byte header of a Megatron .idx"));
}

TEST(IndexedDataset, RefusesTrailingBytesAndMultimodalModes) {
  Damaged d;
  spit(d.idx_path, d.idx + std::string(5, '\0'));
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": holds 5 bytes after the document indices, one per sequence: the "
                        "sequence modes of a multimodal dataset, which pipemat does not read"));
  spit(d.idx_path, d.idx + std::string(3, '\0'));
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": holds 3 bytes after the document indices, where the file should end"));
}

TEST(IndexedDataset, RefusesWrongMagic) {
  Damaged d;
  std::string bytes = d.idx;
  bytes[6] = 'Y';
  spit(d.idx_path, bytes);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": does not start with the magic MMIDIDX\\0\\0 of a Megatron .idx (found "
                        "4d 4d 49 44 49 44 59 00 00); not a Megatron indexed dataset index"));
  spit(d.idx_path, "");
  EXPECT_THAT(d.open_error(), HasSubstr(d.idx_path + ": does not start with the magic "
                                                     "MMIDIDX\\0\\0 of a Megatron .idx (found "
                                                     "an empty file)"));
}

TEST(IndexedDataset, RefusesWrongVersion) {
  Damaged d;
  d.patch_idx<uint64_t>(9, 2);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": version 2; pipemat reads version 1, the one megatron-core writes"));
}

TEST(IndexedDataset, RefusesUnknownAndFloatDtypeCodes) {
  Damaged d;
  d.patch_idx<uint8_t>(17, 9);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": unknown dtype code 9; megatron-core's codes are 1 uint8, 2 int8, 3 "
                        "int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16"));
  d.patch_idx<uint8_t>(17, 0);
  EXPECT_THAT(d.open_error(), HasSubstr(d.idx_path + ": unknown dtype code 0"));
  d.patch_idx<uint8_t>(17, 7);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": dtype code 7 (float32) holds floats; token ids are integers"));
  d.patch_idx<uint8_t>(17, 6);
  EXPECT_THAT(d.open_error(), HasSubstr(d.idx_path + ": dtype code 6 (float64) holds floats"));
}

TEST(IndexedDataset, RefusesInconsistentPointers) {
  Damaged d;
  // Sequence 2 (after 3 + 0 tokens) starts at byte 6; say 4.
  d.patch_idx<int64_t>(kPointers + 8 * 2, 4);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": sequence 2 points at byte 4 but the sequences before it end at byte 6 "
                        "(pointer 1 + length 1 x 2); the pointers do not match the lengths"));
  d.patch_idx<int64_t>(kPointers, 2);
  EXPECT_THAT(d.open_error(),
              HasSubstr(d.idx_path + ": sequence 0 points at byte 2 but the sequences before it "
                                     "end at byte 0 (the first sequence starts at 0)"));
  // A length that disagrees with the pointers after it.
  d.patch_idx<int32_t>(kLengths, 4);
  EXPECT_THAT(d.open_error(), HasSubstr(d.idx_path + ": sequence 1 points at byte 6 but the "
                                                     "sequences before it end at byte 8"));
  d.patch_idx<int32_t>(kLengths + 4, -1);
  EXPECT_THAT(d.open_error(),
              HasSubstr(d.idx_path + ": sequence 1 has length -1; lengths are token counts"));
}

TEST(IndexedDataset, RefusesDocumentIndicesOutOfOrder) {
  Damaged d;
  // Document indices 0 2 3 5: make the second 4 (above the third).
  d.patch_idx<int64_t>(kDocuments + 8, 4);
  EXPECT_THAT(d.open_error(),
              HasSubstr("indexed dataset: " + d.idx_path +
                        ": document index 2 is 3, below document index 1 (4); document indices "
                        "are non-decreasing"));
  d.patch_idx<int64_t>(kDocuments, 1);
  EXPECT_THAT(d.open_error(), HasSubstr(d.idx_path + ": the first document index is 1; documents "
                                                     "start at sequence 0"));
  d.patch_idx<int64_t>(kDocuments + 24, 4);
  EXPECT_THAT(d.open_error(),
              HasSubstr(d.idx_path + ": the last document index is 4 but there are 5 sequences; "
                                     "the sequences after it belong to no document"));
  d.patch_idx<int64_t>(kDocuments + 24, 6);
  EXPECT_THAT(d.open_error(),
              HasSubstr(d.idx_path + ": document index 3 is 6, past the sequence count 5"));
}

TEST(IndexedDataset, RefusesMissingFiles) {
  Damaged d;
  fs::remove(d.bin_path);
  EXPECT_THAT(d.open_error(), HasSubstr("indexed dataset: cannot open '" + d.bin_path +
                                        "' (No such file or directory)"));
  fs::remove(d.idx_path);
  EXPECT_THAT(d.open_error(), HasSubstr("indexed dataset: cannot open '" + d.idx_path + "'"));
}

// Runs fn in a child process and returns what it wrote to its pipe, or "TIMEOUT" after
// `seconds` (the child is then killed).
std::string in_child(const std::function<std::string()>& fn, int seconds) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string out;
    try {
      out = fn();
    } catch (const std::exception& e) {
      out = std::string("unexpected exception: ") + e.what();
    }
    [[maybe_unused]] const auto n = ::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    pollfd p{fds[0], POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) {
      ::kill(pid, SIGKILL);
      out = "TIMEOUT";
      break;
    }
    char buffer[4096];
    const ssize_t n = ::read(fds[0], buffer, sizeof(buffer));
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return out;
}

TEST(IndexedDataset, RefusesAFifoAtOnce) {
  Damaged d;
  for (const std::string& path : {d.bin_path, d.idx_path}) {
    SCOPED_TRACE(path);
    fs::remove(path);
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
    const auto start = std::chrono::steady_clock::now();
    const std::string error = in_child([&] { return d.open_error(); }, 10);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_THAT(error, HasSubstr("indexed dataset: '" + path +
                                 "' is a FIFO (named pipe); expected a regular file"));
    EXPECT_LT(seconds, 5.0);
  }
}

TEST(IndexedDataset, ValidateVocabNamesTheFirstIdOutside) {
  TempDir dir;
  write_with_pipemat(dir.prefix("d"), TokenDtype::uint16, kSmall);
  const IndexedDataset ds = IndexedDataset::open(dir.prefix("d"));
  EXPECT_EQ(ds.max_token(), 999);
  EXPECT_NO_THROW(ds.validate_vocab(1000));
  try {
    ds.validate_vocab(999);
    ADD_FAILURE() << "token 999 was taken for a vocabulary of 999";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr("indexed dataset: " + dir.prefix("d") +
                                    ".bin: token id 999 at sequence 2 (document 1), offset 1 "
                                    "(token 4 of the dataset) is not below the vocabulary size "
                                    "999"));
  }
  EXPECT_THROW(ds.validate_vocab(0), DataError);

  write_with_pipemat(dir.prefix("signed"), TokenDtype::int16, {{}, {{}, {5, 6}}, {{7, -3, 2}}});
  const IndexedDataset s = IndexedDataset::open(dir.prefix("signed"));
  EXPECT_EQ(s.max_token(), 7);
  try {
    s.validate_vocab(100);
    ADD_FAILURE() << "token -3 was taken";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(dir.prefix("signed") +
                                    ".bin: token id -3 at sequence 2 (document 2), offset 1 "
                                    "(token 3 of the dataset) is negative"));
  }
}

TEST(IndexedDataset, ReadTokensChecksItsRange) {
  TempDir dir;
  write_with_pipemat(dir.prefix("d"), TokenDtype::uint16, kSmall);
  const IndexedDataset ds = IndexedDataset::open(dir.prefix("d"));
  std::vector<int64_t> out(16);
  EXPECT_NO_THROW(ds.read_tokens(9, 0, out.data()));
  ds.read_tokens(8, 1, out.data());
  EXPECT_EQ(out[0], 8);
  try {
    ds.read_tokens(8, 2, out.data());
    ADD_FAILURE() << "read past the end";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(),
                HasSubstr(dir.prefix("d") + ".bin: cannot read 2 tokens from token 8; it holds "
                                            "tokens [0, 9)"));
  }
  EXPECT_THROW(ds.read_tokens(-1, 1, out.data()), DataError);
  EXPECT_THROW(ds.read_tokens(0, -1, out.data()), DataError);
  EXPECT_THROW(ds.read_tokens(std::numeric_limits<int64_t>::max(), 2, out.data()), DataError);
  EXPECT_THROW(ds.sequence_length(5), DataError);
}

TEST(IndexedDataset, ABinThatShrinksAfterTheOpenIsAnError) {
  TempDir dir;
  write_with_pipemat(dir.prefix("d"), TokenDtype::uint16, kSmall);
  const IndexedDataset ds = IndexedDataset::open(dir.prefix("d"));
  ASSERT_EQ(::truncate((dir.prefix("d") + ".bin").c_str(), 4), 0);
  std::vector<int64_t> out(9);
  try {
    ds.read_tokens(0, 9, out.data());
    ADD_FAILURE() << "read a truncated .bin";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(dir.prefix("d") + ".bin: read 4 of 18 bytes at byte 0; the "
                                                      "file shrank since it was opened"));
  }
}

// ---- the writer ----

TEST(IndexedDataset, WriterRefusesAnExistingPrefixUnlessAskedToOverwrite) {
  TempDir dir;
  write_with_pipemat(dir.prefix("d"), TokenDtype::uint16, kSmall);
  try {
    IndexedDatasetWriter writer(dir.prefix("d"), TokenDtype::uint16);
    ADD_FAILURE() << "an existing dataset was not refused";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr("indexed dataset: " + dir.prefix("d") +
                                    ".bin exists; pass overwrite to replace the dataset"));
  }
  fs::remove(dir.prefix("d") + ".bin");
  EXPECT_THROW(IndexedDatasetWriter(dir.prefix("d"), TokenDtype::uint16), DataError);
  // A dataset that appears while writing is refused at finish, and the writer leaves nothing.
  fs::remove(dir.prefix("d") + ".idx");
  {
    IndexedDatasetWriter writer(dir.prefix("d"), TokenDtype::uint16);
    writer.end_document();
    spit(dir.prefix("d") + ".idx", "someone else's");
    EXPECT_THROW(writer.finish(), DataError);
  }
  EXPECT_EQ(slurp(dir.prefix("d") + ".idx"), "someone else's");
  EXPECT_FALSE(fs::exists(dir.prefix("d") + ".bin"));
  EXPECT_FALSE(fs::exists(dir.prefix("d") + ".bin.tmp"));
  EXPECT_FALSE(fs::exists(dir.prefix("d") + ".idx.tmp"));

  const Documents other = {{{70, 71}}};
  write_with_pipemat(dir.prefix("d"), TokenDtype::int32, other, /*overwrite=*/true);
  const IndexedDataset ds = IndexedDataset::open(dir.prefix("d"));
  expect_dataset(ds, TokenDtype::int32, other);
}

TEST(IndexedDataset, WriterRefusesIdsOutsideTheDtypeAndUnendedDocuments) {
  TempDir dir;
  IndexedDatasetWriter writer(dir.prefix("d"), TokenDtype::uint16);
  const std::vector<int32_t> ok = {1, 65535};
  writer.add_sequence(ok);
  const std::vector<int32_t> wide = {3, 70000};
  try {
    writer.add_sequence(wide);
    ADD_FAILURE() << "70000 was taken for uint16";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr("indexed dataset: token 70000 (sequence 1, offset 1) does not "
                                    "fit uint16 [0, 65535]"));
  }
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(writer.add_sequence(negative), DataError);
  EXPECT_EQ(writer.sequences(), 1);
  EXPECT_EQ(writer.tokens(), 2);
  writer.add_sequence(ok);
  try {
    writer.finish();
    ADD_FAILURE() << "sequences without a document were written";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(dir.prefix("d") + ": sequences 0 to 1 were added after the "
                                                      "last end_document()"));
  }
  writer.end_document();
  writer.finish();
  EXPECT_THROW(writer.finish(), DataError);
  EXPECT_THROW(writer.add_sequence(ok), DataError);
  expect_dataset(IndexedDataset::open(dir.prefix("d")), TokenDtype::uint16,
                 {{{1, 65535}, {1, 65535}}});
}

TEST(IndexedDataset, WriterLeavesNoPairWhenItDoesNotFinish) {
  TempDir dir;
  const std::string prefix = dir.prefix("d");
  // Destroyed before finish (an exception unwinding): the temporaries are removed.
  {
    IndexedDatasetWriter writer(prefix, TokenDtype::int32);
    const std::vector<int32_t> ids = {1, 2, 3};
    writer.add_sequence(ids);
    writer.end_document();
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // A process that dies before finish: no pair, only temporaries.
  const auto crash = [&](bool overwrite) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      try {
        IndexedDatasetWriter writer(prefix, TokenDtype::int32, overwrite);
        std::vector<int32_t> ids(1 << 20, 7);  // more than the write buffer: the .tmp has bytes
        for (int i = 0; i < 3; ++i) writer.add_sequence(ids);
        writer.end_document();
        ::raise(SIGKILL);
      } catch (...) {
      }
      ::_exit(1);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
  };
  crash(false);
  EXPECT_FALSE(fs::exists(prefix + ".bin"));
  EXPECT_FALSE(fs::exists(prefix + ".idx"));
  EXPECT_GT(fs::file_size(prefix + ".bin.tmp"), 0u);
  try {
    IndexedDataset::open(prefix);
    ADD_FAILURE() << "a crashed write opened";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot open '" + prefix + ".idx'"));
  }
  // Overwriting a dataset and dying before finish leaves the old one whole.
  const Documents old = {{{5, 6}}, {}};
  write_with_pipemat(prefix, TokenDtype::int32, old);
  crash(true);
  expect_dataset(IndexedDataset::open(prefix), TokenDtype::int32, old);
  // The next writer replaces the leftover temporaries.
  write_with_pipemat(prefix, TokenDtype::int32, old, /*overwrite=*/true);
  expect_dataset(IndexedDataset::open(prefix), TokenDtype::int32, old);
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
}

}  // namespace
}  // namespace pipemat::data::indexed_test
