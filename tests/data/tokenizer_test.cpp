// Tokenizers (pipemat/data/tokenizer.h) against the Python tokenizers and sentencepiece packages
// (tokenizer_oracle.py, run through PIPEMAT_DATA_PYTHON): small tokenizers of each supported kind
// trained by those packages on fortunes text, then the same ids token for token on every fortunes
// text file and on hostile strings (invalid UTF-8, a megabyte of one character, every byte value,
// special tokens inside the text, very long words), the same decoded text, the same character
// classes; damaged tokenizer.json files refused naming the file and the field; the speed of encode
// next to the tokenizers package's on two threads.

#include "pipemat/data/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace pipemat::data::tokenizer_test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Json = nlohmann::json;
using Ids = std::vector<int32_t>;

const std::string kPython = PIPEMAT_DATA_PYTHON;
const std::string kOracle = std::string(PIPEMAT_DATA_DIR) + "/tokenizer_oracle.py";
const std::string kRepo = std::string(PIPEMAT_DATA_DIR) + "/../..";
const std::string kFortunes = "/usr/share/games/fortunes";

// A scratch directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "pipemat-tokenizer-XXXXXX").string();
    const char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string quote(const std::string& arg) {
  std::string q = "'";
  for (const char c : arg) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

// Runs the oracle with `args`; throws with its output when it fails.
void oracle(const TempDir& dir, const std::vector<std::string>& args) {
  std::string command = quote(kPython) + " " + quote(kOracle);
  for (const std::string& a : args) command += " " + quote(a);
  const std::string log = dir.file("oracle.log");
  command += " >" + quote(log) + " 2>&1";
  const int rc = std::system(command.c_str());
  if (rc != 0) {
    throw std::runtime_error("the oracle failed (" + std::to_string(rc) + "): " + command + "\n" +
                             read_file(log));
  }
}

// Trains a fixture of `kind` into `dir`; the path of its tokenizer file.
std::string fixture(const TempDir& dir, const std::string& kind) {
  const std::string out = dir.file(kind);
  oracle(dir, {"fixture", kind, out});
  return out + (kind.starts_with("sp-") ? "/tokenizer.model" : "/tokenizer.json");
}

std::vector<std::string> write_inputs(const TempDir& dir, const std::vector<std::string>& texts) {
  std::vector<std::string> paths;
  for (size_t i = 0; i < texts.size(); ++i) {
    paths.push_back(dir.file("input-" + std::to_string(i)));
    write_file(paths.back(), texts[i]);
  }
  return paths;
}

// The reference's ids of each text.
std::vector<Ids> oracle_encode(const TempDir& dir, const std::string& tokenizer,
                               const std::vector<std::string>& texts) {
  std::vector<std::string> args = {"encode", tokenizer, dir.file("ids.bin")};
  for (const std::string& p : write_inputs(dir, texts)) args.push_back(p);
  oracle(dir, args);
  const std::string bytes = read_file(dir.file("ids.bin"));
  std::vector<Ids> out;
  size_t pos = 0;
  while (pos + 4 <= bytes.size()) {
    uint32_t count = 0;
    std::memcpy(&count, bytes.data() + pos, 4);
    pos += 4;
    if (bytes.size() - pos < size_t{count} * 4) throw std::runtime_error("ids.bin is cut short");
    Ids ids(count);
    std::memcpy(ids.data(), bytes.data() + pos, size_t{count} * 4);
    pos += size_t{count} * 4;
    out.push_back(std::move(ids));
  }
  return out;
}

// The reference's text of each id list.
std::vector<std::string> oracle_decode(const TempDir& dir, const std::string& tokenizer,
                                       const std::vector<Ids>& lists) {
  write_file(dir.file("decode-in.json"), Json{{"ids", lists}}.dump());
  oracle(dir, {"decode", tokenizer, dir.file("decode-in.json"), dir.file("decode-out.json")});
  return Json::parse(read_file(dir.file("decode-out.json")))
      .at("texts")
      .get<std::vector<std::string>>();
}

// The text files of the fortunes directory, sorted (as the oracle's trainer reads them).
std::vector<std::string> fortune_texts() {
  std::vector<std::string> paths;
  for (const auto& entry : fs::directory_iterator(kFortunes)) {
    if (entry.is_symlink() || !entry.is_regular_file() || entry.path().extension() == ".dat") {
      continue;
    }
    paths.push_back(entry.path().string());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<std::string> texts;
  for (const std::string& p : paths) texts.push_back(read_file(p));
  return texts;
}

// A short printable view of `text` around `at`, for failure messages.
std::string around(std::string_view text, size_t at) {
  const size_t from = at > 40 ? at - 40 : 0;
  std::string out;
  for (const char c : text.substr(from, 80)) {
    const auto b = static_cast<unsigned char>(c);
    if (b < 0x20 || b >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", b);
      out += hex;
    } else {
      out += c;
    }
  }
  return out;
}

// Expects ours == theirs for each input, naming the input and the first token that differs.
void expect_same_ids(const Tokenizer& tok, const std::vector<std::string>& inputs,
                     const std::vector<Ids>& theirs, const std::string& what) {
  ASSERT_EQ(inputs.size(), theirs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Ids ours = tok.encode(inputs[i]);
    if (ours == theirs[i]) continue;
    size_t k = 0;
    while (k < ours.size() && k < theirs[i].size() && ours[k] == theirs[i][k]) ++k;
    const Ids prefix(ours.begin(), ours.begin() + static_cast<std::ptrdiff_t>(k));
    const size_t at = tok.decode(prefix).size();
    ADD_FAILURE() << what << " input " << i << " (" << inputs[i].size()
                  << " bytes): " << ours.size() << " ids, the reference " << theirs[i].size()
                  << "; first difference at token " << k << " ("
                  << (k < ours.size() ? std::to_string(ours[k]) : "end") << " vs "
                  << (k < theirs[i].size() ? std::to_string(theirs[i][k]) : "end")
                  << "), text near it: '" << around(valid_utf8(inputs[i]), at) << "'";
  }
}

// Strings a tokenizer must take as the reference takes them.
std::vector<std::string> hostile_strings() {
  std::vector<std::string> s;
  s.push_back("");
  s.push_back("\xff");
  s.push_back("abc\xe2\x82");  // a character cut at the end
  s.push_back(
      "\xe2\x82"
      "abc\xe2\x82\xac");  // ... and at the start
  s.push_back("\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 \xf0\x9f\x98 \xe0\x80\xaf \x80\x80 x");
  std::string every_byte;
  for (int b = 0; b < 256; ++b) every_byte += static_cast<char>(b);
  s.push_back(every_byte);
  std::string spaced_bytes;
  for (int b = 0; b < 256; ++b) {
    spaced_bytes += static_cast<char>(b);
    spaced_bytes += b % 3 == 0 ? " " : "";
  }
  s.push_back(spaced_bytes);
  std::mt19937 rng(7);
  std::string random_bytes(20000, '\0');
  for (char& c : random_bytes) c = static_cast<char>(rng() & 0xFF);
  s.push_back(random_bytes);
  for (const char* one : {"a", " ", "\n", "1", "!", "\xc3\xa9"}) {
    std::string mb;
    while (mb.size() < (1u << 20)) mb += one;
    s.push_back(mb);
  }
  std::string long_word;
  for (int i = 0; i < 100000; ++i) long_word += static_cast<char>('a' + rng() % 26);
  s.push_back(long_word);
  std::string url = "https://";
  for (int i = 0; i < 20000; ++i) url += "ab/c.d-e_f?"[rng() % 11];
  s.push_back(url);
  s.push_back(std::string(30000, '7') + "x" + std::string(3000, '.'));
  s.push_back(
      "hello<|endoftext|>world <|endoftext|><|endoftext|> <|begin_of_text|>Hi<|end_of_text|>"
      "<|eot_id|><|reserved_special_token_2|> <|im_start|>user\nhi<|im_end|> <s> </s> <sep> "
      "a <mask> b  <mask>c x[RSTRIP]   y héllo wörld héllo wörldx x spaced y the other "
      "<|endoftext|>the<mask>the Amélie Ame\xcc\x81lie <|endoftext");
  s.push_back("I'm you're it's WE'LL 'S 'ſ 'K 'd've '' 'ſt shouldn't 'RE 'Ve");
  s.push_back(
      "\t\n\r\v\f \xc2\xa0\xe2\x80\x83\xe3\x80\x80\xc2\x85 \xe1\xa0\x8e a  \n\n  b \r\n\r\n "
      "trailing   ");
  s.push_back(
      "中文分词测试。日本語のテキスト、한국어 텍스트. العربية مرحبا. Ελληνικά. Русский текст. "
      "👩‍👩‍👧 🇫🇷 e\xcc\x81 \xef\xac\x81 ０１２ ٣٤٥ ⅫⅣ ²³ 𝟘𝟙 "
      "\xf0\x90\x97\x80\xf0\x93\x91\xa0 "
      "\xe1\xb2\x89 \xf0\x90\xb5\x80 x\xe2\x80\x8by\xef\xbb\xbfz");
  s.push_back("12345678901234567890 3.14159 1,000,000 -- a--b -- c;d,e! f? g. x1y22z333");
  return s;
}

// Random ids over the whole vocab (special tokens included), for decode.
std::vector<Ids> random_id_lists(int64_t vocab, int lists, int length) {
  std::mt19937 rng(11);
  std::vector<Ids> out(static_cast<size_t>(lists));
  for (Ids& ids : out) {
    for (int i = 0; i < length; ++i) ids.push_back(static_cast<int32_t>(rng() % vocab));
  }
  return out;
}

// What StreamDecoder gives for `ids`, one push at a time; each piece must be valid UTF-8.
std::string streamed(const Tokenizer& tok, const Ids& ids) {
  StreamDecoder stream(tok);
  std::string out;
  size_t invalid = 0;
  for (const int32_t id : ids) {
    const std::string piece = stream.push(id);
    if (valid_utf8(piece) != piece) ++invalid;
    out += piece;
  }
  EXPECT_EQ(invalid, 0u) << "pushes returned bytes that are not UTF-8";
  return out + stream.finish();
}

// The whole check of one fixture: every fortunes text file and the hostile strings encode to the
// reference's ids; their ids and random ids decode to the reference's text; the stream decoder
// writes what decode writes.
void check_fixture(const std::string& kind, bool random_decode = true) {
  TempDir dir;
  const std::string path = fixture(dir, kind);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(path);
  std::vector<std::string> inputs = fortune_texts();
  ASSERT_GE(inputs.size(), 30u);
  const size_t fortunes = inputs.size();
  for (std::string& h : hostile_strings()) inputs.push_back(std::move(h));
  const std::vector<Ids> theirs = oracle_encode(dir, path, inputs);
  expect_same_ids(*tok, inputs, theirs, kind);

  // Decode: the fortunes' and the hostile strings' ids (not the megabytes), and random ids.
  std::vector<Ids> lists;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].size() < 200000 || i < fortunes) lists.push_back(theirs[i]);
  }
  const size_t encoded = lists.size();
  if (random_decode) {
    for (Ids& ids : random_id_lists(tok->vocab_size(), 50, 40)) lists.push_back(std::move(ids));
  }
  const std::vector<std::string> texts = oracle_decode(dir, path, lists);
  for (size_t i = 0; i < lists.size(); ++i) {
    EXPECT_EQ(tok->decode(lists[i]), texts[i]) << kind << ": decode of list " << i;
    if (i < encoded) {
      EXPECT_EQ(streamed(*tok, lists[i]), texts[i]) << kind << ": stream decode of list " << i;
    }
  }
  for (const int32_t id : lists[0]) ASSERT_LT(id, tok->vocab_size());
}

TEST(TokenizerUtf8, ReplacesMaximalSubpartsAsPython) {
  TempDir dir;
  std::vector<std::string> inputs = {"",
                                     "plain ascii",
                                     "\xff\xfe",
                                     "\xc2",
                                     "\xc2\x41",
                                     "\xe0\x80\x80",
                                     "\xe0\xa0",
                                     "\xe0\xa0\x80",
                                     "\xed\x9f\xbf\xed\xa0\x80",
                                     "\xf0\x8f\xbf\xbf",
                                     "\xf0\x90\x80",
                                     "\xf4\x8f\xbf\xbf\xf4\x90\x80\x80",
                                     "\xf5\x80\x80\x80",
                                     "a\xc0\xaf"
                                     "b",
                                     "\xe2\x82\xac\xe2\x82\xe2"};
  std::mt19937 rng(3);
  for (int i = 0; i < 200; ++i) {
    std::string s(1 + rng() % 12, '\0');
    for (char& c : s) c = static_cast<char>(0x70 + rng() % 0x90);  // mostly 0x80..0xFF
    inputs.push_back(s);
  }
  std::vector<std::string> args = {"utf8", dir.file("utf8.json")};
  for (const std::string& p : write_inputs(dir, inputs)) args.push_back(p);
  oracle(dir, args);
  const auto texts =
      Json::parse(read_file(dir.file("utf8.json"))).at("texts").get<std::vector<std::string>>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(valid_utf8(inputs[i]), texts[i]) << "input " << i << ": " << around(inputs[i], 0);
  }
}

TEST(TokenizerFixtures, Gpt2Style) { check_fixture("gpt2"); }
TEST(TokenizerFixtures, RobertaStylePrefixSpace) { check_fixture("roberta"); }
TEST(TokenizerFixtures, Llama3Style) { check_fixture("llama3"); }
TEST(TokenizerFixtures, Qwen2StyleWithNfc) { check_fixture("qwen2"); }
TEST(TokenizerFixtures, SmolLmStyleDigits) { check_fixture("smollm"); }
TEST(TokenizerFixtures, EverySplitBehavior) { check_fixture("splits"); }
TEST(TokenizerFixtures, SentencePieceBpeWithByteFallback) { check_fixture("sp-bpe"); }
TEST(TokenizerFixtures, SentencePieceUnigram) { check_fixture("sp-unigram"); }

}  // namespace
}  // namespace pipemat::data::tokenizer_test
