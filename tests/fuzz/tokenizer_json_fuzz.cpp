// Fuzz target: a Hugging Face tokenizer.json (data::parse_tokenizer_json; Note [tokenizer.json as
// the tokenizers package reads it] in data/src/byte_level_bpe.cpp and Note [Fuzz targets] in
// tests/fuzz/CMakeLists.txt).
//
// Bad input must end in a DataError. What the parser accepts must encode: fixed texts (words,
// numbers, whitespace runs, special-token spellings, invalid UTF-8, every byte value) give ids
// below vocab_size(), the same ids twice (the word cache), and decode gives valid UTF-8, the text
// the stream decoder writes id by id.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_expect.h"
#include "pipemat/data/tokenizer.h"

namespace {

void expect(bool ok, const char* what) { pipemat::fuzz::expect(ok, "tokenizer_json", what); }

const std::vector<std::string>& texts() {
  static const std::vector<std::string> kTexts = [] {
    std::vector<std::string> t = {
        "Hello, world! It's 2024: 3.14159 and 1,000,000 -- don't panic.",
        "  leading and trailing spaces   \n\n\ttabs\r\n",
        "<|endoftext|>text<|endoftext|> <s></s> <mask> [RSTRIP]  x",
        "caf\xc3\xa9 e\xcc\x81 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 \xd9\xa3",
        "bad \xff\xfe utf-8 \xe2\x82 cut \xed\xa0\x80",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "",
    };
    std::string bytes;
    for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
    t.push_back(bytes);
    return t;
  }();
  return kTexts;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<pipemat::data::Tokenizer> tok;
  try {
    tok = pipemat::data::parse_tokenizer_json(text, "tokenizer.json");
  } catch (const pipemat::data::DataError&) {
    return 0;  // bad input, refused as documented
  }
  expect(tok->vocab_size() >= 256, "a byte-level vocab holds the 256 bytes");
  for (const std::string& t : texts()) {
    const std::vector<int32_t> ids = tok->encode(t);
    for (const int32_t id : ids) expect(id >= 0 && id < tok->vocab_size(), "ids below vocab_size");
    expect(tok->encode(t) == ids, "the same ids twice");
    const std::string decoded = tok->decode(ids);
    expect(pipemat::data::valid_utf8(decoded) == decoded, "decode writes valid UTF-8");
    pipemat::data::StreamDecoder stream(*tok);
    std::string streamed;
    for (const int32_t id : ids) streamed += stream.push(id);
    streamed += stream.finish();
    expect(streamed == decoded, "the stream decoder writes what decode writes");
  }
  return 0;
}
