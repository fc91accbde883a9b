#pragma once
// What the tokenizer sources share (private to pipemat::data).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "pipemat/data/tokenizer.h"

namespace pipemat::data {

// The SentencePiece model whose serialized bytes are `bytes` (sentencepiece.cpp); DataError
// naming `path` when the SentencePiece library refuses them.
std::unique_ptr<Tokenizer> make_sentencepiece(std::string bytes, const std::string& path);

// "49,152".
std::string with_commas(int64_t n);

}  // namespace pipemat::data

namespace pipemat::data::unicode {

// `text` (valid UTF-8) in Normalization Form C, as the tokenizers package's NFC normalizer
// writes it (unicode_nfc.cpp).
std::string nfc(std::string_view text);

// Whether `cp` is White_Space (Rust's char::is_whitespace, the added tokens' lstrip and rstrip).
inline bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

}  // namespace pipemat::data::unicode
