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
#include <sys/types.h>
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
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../../data/src/pattern.h"  // the pattern translation, tested alone

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
    if (count > 0) std::memcpy(ids.data(), bytes.data() + pos, size_t{count} * 4);
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

void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

size_t utf8_length(char32_t c) { return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4; }

// The code point `s` (valid UTF-8) begins with.
char32_t first_code_point(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(s[i])); };
  if (b(0) < 0x80) return b(0);
  if (b(0) < 0xE0) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (b(0) < 0xF0) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
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
TEST(TokenizerFixtures, SentencePieceBpeWithoutByteFallback) { check_fixture("sp-bpe-plain"); }
TEST(TokenizerFixtures, SentencePieceUnigram) { check_fixture("sp-unigram"); }

// Every code point that the pre-tokenizer classes match in the tokenizers package (Oniguruma)
// matches in pipemat's translation for PCRE2, and no other (Note [Oniguruma patterns in PCRE2]).
TEST(TokenizerPattern, CharacterClassesMatchTheTokenizersPackage) {
  TempDir dir;
  oracle(dir, {"classes", dir.file("classes.json")});
  const Json expected = Json::parse(read_file(dir.file("classes.json")));
  std::string all;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c < 0xD800 || c >= 0xE000) append_utf8(c, all);
  }
  std::string contractions;  // "'c\n" for every c but \n
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c < 0xE000) continue;
    contractions += '\'';
    append_utf8(c, contractions);
    contractions += '\n';
  }
  std::vector<pattern::Span> matches;
  for (const auto& [name, ranges] : expected.items()) {
    const bool contraction = name.starts_with("(?i:");
    const auto regex = pattern::Regex::oniguruma(name, "test");
    const std::string& text = contraction ? contractions : all;
    regex->find_all(text, matches);
    std::set<char32_t> ours;
    for (const auto& [begin, end] : matches) {
      std::string_view m(text.data() + begin, end - begin);
      if (contraction) {
        if (m.size() < 2 || m[0] != '\'') continue;
        m.remove_prefix(1);
      }
      const char32_t c = first_code_point(m);
      if (utf8_length(c) == m.size()) ours.insert(c);
    }
    std::set<char32_t> theirs;
    for (const Json& r : ranges) {
      for (auto c = r[0].get<char32_t>(); c <= r[1].get<char32_t>(); ++c) theirs.insert(c);
    }
    std::vector<char32_t> only_ours;
    std::vector<char32_t> only_theirs;
    std::set_difference(ours.begin(), ours.end(), theirs.begin(), theirs.end(),
                        std::back_inserter(only_ours));
    std::set_difference(theirs.begin(), theirs.end(), ours.begin(), ours.end(),
                        std::back_inserter(only_theirs));
    EXPECT_TRUE(only_ours.empty() && only_theirs.empty())
        << name << ": " << only_ours.size() << " code points only pipemat matches (first U+"
        << std::hex << (only_ours.empty() ? 0 : only_ours[0]) << "), " << std::dec
        << only_theirs.size() << " only the tokenizers package matches (first U+" << std::hex
        << (only_theirs.empty() ? 0 : only_theirs[0]) << ")";
  }
}

TEST(TokenizerPattern, RefusesWhatItDoesNotTranslate) {
  for (const char* p : {R"(\w+)", R"(\d)", R"(\bx)", R"(\p{Lu})", R"([[:alpha:]])", R"((?<n>a))",
                        R"((?m)a)", R"(a{1,2}+)", R"(\1)", R"([a&&b])", R"([\P{L}])"}) {
    try {
      pattern::Regex::oniguruma(p, "file.json: field 'x'");
      ADD_FAILURE() << p << " was accepted";
    } catch (const DataError& e) {
      EXPECT_THAT(e.what(), HasSubstr("file.json: field 'x': pattern '")) << p;
      EXPECT_THAT(e.what(), HasSubstr("is not supported")) << p;
    }
  }
  EXPECT_EQ(pattern::translate("a{,3}.^$\\v{x", "t"),
            "a{0,3}[^\\n](?<![^\\n])(?![^\\n])\\x{b}\\{x");
}

// The NFC normalizer writes what the tokenizers package's does, on every code point alone, the
// NFD form of each one that decomposes and pairs of combining marks (Note [NFC as the tokenizers
// package writes it]): the ids of a Qwen2-style tokenizer (NFC, then its Split) are equal.
TEST(TokenizerFixtures, Qwen2StyleNfcMatches) {
  TempDir dir;
  const std::string path = fixture(dir, "qwen2");
  oracle(dir, {"nfc-cases", dir.file("nfc.txt")});
  const std::vector<std::string> inputs = {read_file(dir.file("nfc.txt"))};
  ASSERT_GT(inputs[0].size(), 4000000u);
  expect_same_ids(*load_tokenizer(path), inputs, oracle_encode(dir, path, inputs), "nfc");
}

// A tokenizer.json of the gpt2 fixture with `edit` applied, written as tokenizer.json in a
// directory of its own; returns the DataError of loading it ("" when it loads).
std::string load_error(const TempDir& dir, const Json& base, const std::function<void(Json&)>& edit,
                       std::string* path = nullptr) {
  static int n = 0;
  const std::string file = dir.file("damaged-" + std::to_string(n++) + ".json");
  Json j = base;
  edit(j);
  write_file(file, j.dump());
  if (path != nullptr) *path = file;
  try {
    load_tokenizer(file);
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(file)) << "the error does not name the file";
    return e.what();
  }
  return "";
}

TEST(TokenizerDamaged, RefusedNamingTheFileAndTheField) {
  TempDir dir;
  const std::string path = fixture(dir, "gpt2");
  const std::string text = read_file(path);
  const Json base = Json::parse(text);

  // Truncated.
  write_file(dir.file("truncated.json"), text.substr(0, text.size() / 2));
  try {
    load_tokenizer(dir.file("truncated.json"));
    ADD_FAILURE() << "a truncated tokenizer.json loaded";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(dir.file("truncated.json") + ": not valid JSON"));
  }
  // A key twice (strict JSON).
  write_file(dir.file("twice.json"), "{\"model\": {}, \"model\": {}}");
  EXPECT_THROW(
      {
        try {
          load_tokenizer(dir.file("twice.json"));
        } catch (const DataError& e) {
          EXPECT_THAT(e.what(), HasSubstr("'model' appears twice"));
          throw;
        }
      },
      DataError);

  struct Case {
    std::function<void(Json&)> edit;
    std::vector<std::string> says;
  };
  const std::string first_merge_left = base["model"]["merges"][5][0].get<std::string>();
  const std::vector<Case> cases = {
      {[](Json& j) { j["model"]["merges"][5][1] = "NOT-A-TOKEN"; },
       {"field 'model.merges[5]'", "\"NOT-A-TOKEN\"", "not a token of the vocab"}},
      {[](Json& j) { j["model"]["merges"][7] = "a b c"; },
       {"field 'model.merges[7]'", "two tokens separated by one space"}},
      {[](Json& j) { j["model"]["merges"][9] = j["model"]["merges"][3]; },
       {"field 'model.merges[9]'", "again"}},
      {[](Json& j) { j["model"]["vocab"]["Ġthe"] = 5000; },
       {"field 'model.vocab'", "\"\\u0120the\"", "5000", "0..999"}},
      {[](Json& j) { j["model"]["vocab"]["Ġthe"] = j["model"]["vocab"]["Ġa"]; },
       {"field 'model.vocab'", "gives the id", "one token per id"}},
      {[](Json& j) { j["model"]["vocab"]["Ġthe"] = -1; }, {"field 'model.vocab'"}},
      {[](Json& j) { j["model"]["vocab"].erase("Ā"); }, {"field 'model.vocab'"}},
      {[](Json& j) { j["model"]["type"] = "WordPiece"; },
       {"field 'model.type'", "\"WordPiece\"", "BPE"}},
      {[](Json& j) { j["model"]["type"] = "Unigram"; }, {"field 'model.type'", "SentencePiece"}},
      {[](Json& j) { j["model"]["byte_fallback"] = true; }, {"field 'model.byte_fallback'"}},
      {[](Json& j) { j["model"]["dropout"] = 0.1; }, {"field 'model.dropout'", "0.1"}},
      {[](Json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       {"field 'model.continuing_subword_prefix'"}},
      {[](Json& j) { j["model"]["max_input_chars_per_word"] = 100; },
       {"field 'model.max_input_chars_per_word'", "it reads:"}},
      {[](Json& j) { j["model"].erase("merges"); }, {"field 'model.merges' is missing"}},
      {[](Json& j) { j.erase("model"); }, {"field 'model' is missing"}},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}};
       },
       {"field 'pre_tokenizer.type'", "\"Metaspace\"", "ByteLevel"}},
      {[](Json& j) { j["pre_tokenizer"] = nullptr; }, {"field 'pre_tokenizer'", "ByteLevel"}},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", "\\w+"}}},
                                  {"behavior", "Isolated"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"trim_offsets", true},
                                  {"use_regex", false}}}}};
       },
       {"field 'pre_tokenizer.pretokenizers[0].pattern.Regex'", "'\\w'", "not supported"}},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"trim_offsets", true},
                                  {"use_regex", false}},
                                 {{"type", "Digits"}, {"individual_digits", true}}}}};
       },
       {"field 'pre_tokenizer.pretokenizers[0].type'", "last"}},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Split"},
                               {"pattern", {{"Regex", " "}}},
                               {"behavior", "Isolated"},
                               {"invert", false}};
       },
       {"field 'pre_tokenizer'", "ByteLevel"}},
      {[](Json& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       },
       {"field 'normalizer.type'", "\"Lowercase\"", "NFC"}},
      {[](Json& j) {
         j["normalizer"] = {{"type", "NFKC"}};
       },
       {"field 'normalizer.type'"}},
      {[](Json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       },
       {"field 'decoder.type'"}},
      {[](Json& j) { j["decoder"] = nullptr; }, {"field 'decoder'"}},
      {[](Json& j) {
         j["truncation"] = {{"max_length", 512}};
       },
       {"field 'truncation'", "null"}},
      {[](Json& j) {
         j["padding"] = {{"strategy", "BatchLongest"}};
       },
       {"field 'padding'"}},
      {[](Json& j) { j["version"] = "2.0"; }, {"field 'version'"}},
      {[](Json& j) { j["extra"] = 1; }, {"field 'extra'", "not a field of a tokenizer.json"}},
      {[](Json& j) { j["added_tokens"][2]["id"] = 1005; },  // <mask>, the first beyond the vocab
       {"field 'added_tokens[2].id'", "is 1005 for \"<mask>\"", "the id 1000 (the next id"}},
      {[](Json& j) { j["added_tokens"][0]["id"] = 7; },
       {"field 'added_tokens[0].id'", "(its id in the vocab)"}},
      {[](Json& j) { j["added_tokens"][1]["single_word"] = true; },
       {"field 'added_tokens[1].single_word'"}},
      {[](Json& j) { j["added_tokens"][2]["content"] = ""; },
       {"field 'added_tokens[2].content'", "empty"}},
      {[](Json& j) { j["added_tokens"].push_back(j["added_tokens"][1]); },
       {"field 'added_tokens[", "expected each token once"}},
      {[](Json& j) { j["added_tokens"] = "x"; }, {"field 'added_tokens'", "an array"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string error = load_error(dir, base, cases[i].edit);
    EXPECT_FALSE(error.empty()) << "case " << i << " loaded";
    for (const std::string& part : cases[i].says) {
      EXPECT_THAT(error, HasSubstr(part)) << "case " << i << ": " << error;
    }
  }
  // The undamaged file loads.
  EXPECT_EQ(load_error(dir, base, [](Json&) {}), "");
}

TEST(TokenizerLoad, FilesDirectoriesAndWhatTheyAre) {
  TempDir dir;
  const std::string json = fixture(dir, "llama3");
  const std::string model = fixture(dir, "sp-unigram");

  // A directory with tokenizer.json; a directory with tokenizer.model only.
  const auto bpe = load_tokenizer(dir.file("llama3"));
  EXPECT_EQ(bpe->path(), json);
  EXPECT_EQ(bpe->vocab_size(), 1000);  // its special tokens are tokens of the vocab
  EXPECT_THAT(bpe->describe(), HasSubstr("byte-level BPE, 1,00"));
  EXPECT_THAT(bpe->describe(), HasSubstr("(" + json + ")"));
  const Json j = Json::parse(read_file(json));
  EXPECT_EQ(bpe->eos_id(), j["model"]["vocab"]["<|end_of_text|>"].get<int32_t>());
  EXPECT_EQ(bpe->bos_id(), j["model"]["vocab"]["<|begin_of_text|>"].get<int32_t>());

  const auto sp = load_tokenizer(dir.file("sp-unigram"));
  EXPECT_EQ(sp->path(), model);
  EXPECT_EQ(sp->vocab_size(), 800);
  EXPECT_EQ(sp->describe(), "SentencePiece unigram, 800 pieces (" + model + ")");
  EXPECT_EQ(sp->bos_id(), 1);  // SentencePiece's defaults: <unk> 0, <s> 1, </s> 2
  EXPECT_EQ(sp->eos_id(), 2);
  EXPECT_THAT(sp->encode("hello"), ::testing::Not(::testing::Contains(1)));  // no BOS added

  const auto gpt2 = load_tokenizer(fixture(dir, "gpt2"));
  EXPECT_EQ(gpt2->eos_id(), 0);  // <|endoftext|>
  EXPECT_EQ(gpt2->bos_id(), std::nullopt);

  auto refused = [](const std::string& path) {
    try {
      load_tokenizer(path);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  fs::create_directory(dir.file("empty"));
  EXPECT_THAT(refused(dir.file("empty")), HasSubstr("'" + dir.file("empty") + "' holds neither"));
  EXPECT_THAT(refused(dir.file("missing.json")),
              HasSubstr("cannot open '" + dir.file("missing.json")));
  write_file(dir.file("garbage.model"), "\x01\x02 not a model \xff");
  EXPECT_THAT(refused(dir.file("garbage.model")),
              HasSubstr(dir.file("garbage.model") + ": not a SentencePiece model"));
  write_file(dir.file("blank.json"), " \n");
  EXPECT_THAT(refused(dir.file("blank.json")), HasSubstr("the file is empty"));
  write_file(dir.file("array.json"), "[1, 2]");
  EXPECT_THAT(refused(dir.file("array.json")), HasSubstr("not an object"));
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  EXPECT_THAT(refused(dir.file("fifo")), HasSubstr("FIFO"));
}

TEST(TokenizerDecode, RefusesIdsOutsideTheVocab) {
  TempDir dir;
  for (const char* kind : {"gpt2", "sp-bpe"}) {
    const auto tok = load_tokenizer(fixture(dir, kind));
    const int32_t past = static_cast<int32_t>(tok->vocab_size());
    for (const int32_t bad : {past, -1, 1 << 30}) {
      const Ids ids = {5, bad};
      try {
        tok->decode(ids);
        ADD_FAILURE() << kind << ": decoded the id " << bad;
      } catch (const DataError& e) {
        EXPECT_THAT(e.what(),
                    HasSubstr(tok->path() + ": cannot decode token id " + std::to_string(bad)));
      }
      StreamDecoder stream(*tok);
      EXPECT_THROW(stream.push(bad), DataError);
    }
    EXPECT_NO_THROW(tok->decode(Ids{past - 1}));
  }
}

// A character split across tokens comes out of the stream whole, once its last byte is there.
TEST(TokenizerDecode, StreamReturnsWholeCharacters) {
  TempDir dir;
  const auto tok = load_tokenizer(fixture(dir, "gpt2"));
  const std::string text = "a€b😀";  // the fixture has no merges for these bytes
  const Ids ids = tok->encode(text);
  ASSERT_EQ(ids.size(), 9u);  // a, 3 bytes, b, 4 bytes
  StreamDecoder stream(*tok);
  std::vector<std::string> out;
  for (const int32_t id : ids) out.push_back(stream.push(id));
  EXPECT_EQ(out, (std::vector<std::string>{"a", "", "", "€", "b", "", "", "", "😀"}));
  EXPECT_EQ(stream.finish(), "");
  // A character cut off: finish writes U+FFFD; an ill-formed byte comes out at once.
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.push(ids[2]), "\xEF\xBF\xBD");  // a continuation byte alone
}

// encode from many threads at once gives what one thread gives (the word cache is shared).
TEST(TokenizerThreads, EncodeFromManyThreadsGivesTheSameIds) {
  TempDir dir;
  for (const char* kind : {"llama3", "sp-unigram"}) {
    const auto tok = load_tokenizer(fixture(dir, kind));
    const std::vector<std::string> texts = fortune_texts();
    std::vector<Ids> alone;
    for (const std::string& t : texts) alone.push_back(tok->encode(t));
    const auto fresh = load_tokenizer(tok->path());  // a cold cache, filled by 4 threads at once
    std::vector<Ids> together(texts.size());
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (size_t i = next++; i < texts.size(); i = next++) together[i] = fresh->encode(texts[i]);
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_TRUE(alone == together) << kind;
  }
}

}  // namespace
}  // namespace pipemat::data::tokenizer_test
