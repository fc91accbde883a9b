#pragma once
// UTF-8 as the tokenizers read it (Note [Text to tokens] in pipemat/data/tokenizer.h): well-formed
// sequences per Unicode 3.9 table 3-7, ill-formed ones replaced by U+FFFD one maximal subpart at a
// time.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pipemat::data::utf8 {

inline constexpr char32_t kReplacement = 0xFFFD;
inline constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";

// One step of reading: the code point at the position and the bytes it took. `valid` false: the
// `length` >= 1 bytes are a maximal subpart of an ill-formed sequence (to replace by one U+FFFD);
// `truncated` true too when the subpart ends at the end of the input (more bytes could still
// complete it).
struct Step {
  char32_t code_point = 0;
  int length = 1;
  bool valid = true;
  bool truncated = false;  // ill-formed only because the input ends
};

// The second byte's range after a lead byte (table 3-7); the others are 0x80..0xBF.
inline bool second_byte_ok(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0:
      return b >= 0xA0 && b <= 0xBF;
    case 0xED:
      return b >= 0x80 && b <= 0x9F;
    case 0xF0:
      return b >= 0x90 && b <= 0xBF;
    case 0xF4:
      return b >= 0x80 && b <= 0x8F;
    default:
      return b >= 0x80 && b <= 0xBF;
  }
}

// Reads the character at `pos` (< text.size()).
inline Step read(std::string_view text, size_t pos) {
  const auto lead = static_cast<uint8_t>(text[pos]);
  Step step;
  if (lead < 0x80) {
    step.code_point = lead;
    return step;
  }
  int need = 0;
  char32_t cp = 0;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
    cp = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    cp = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    cp = lead & 0x07;
  } else {
    step.valid = false;  // a continuation byte, C0, C1 or F5..FF: never a lead
    return step;
  }
  for (int i = 1; i <= need; ++i) {
    if (pos + i >= text.size()) {
      step.valid = false;
      step.truncated = true;
      step.length = i;
      return step;
    }
    const auto b = static_cast<uint8_t>(text[pos + i]);
    const bool ok = i == 1 ? second_byte_ok(lead, b) : (b >= 0x80 && b <= 0xBF);
    if (!ok) {
      step.valid = false;
      step.length = i;
      return step;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  step.code_point = cp;
  step.length = need + 1;
  return step;
}

// Whether `text` is well-formed UTF-8 (ASCII runs are checked eight bytes at a time).
inline bool is_valid(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (pos + 8 <= text.size()) {
      uint64_t word = 0;
      for (int i = 0; i < 8; ++i) word |= uint64_t{static_cast<uint8_t>(text[pos + i])} << (8 * i);
      if ((word & 0x8080808080808080ULL) == 0) {
        pos += 8;
        continue;
      }
    }
    const Step step = read(text, pos);
    if (!step.valid) return false;
    pos += step.length;
  }
  return true;
}

// Appends the UTF-8 of `cp` (a scalar value) to `out`.
inline void append(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Appends `text` to `out` with each maximal subpart of an ill-formed sequence replaced by U+FFFD.
// `keep_truncated_tail`: an ill-formed subpart that ends at the end of `text` (a character that
// more bytes could complete) is not appended; returns its length (0 when there is none).
inline size_t append_valid(std::string_view text, std::string& out,
                           bool keep_truncated_tail = false) {
  size_t pos = 0;
  size_t run = 0;  // the start of the valid bytes not yet appended
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Step step = read(text, pos);
    if (step.valid) {
      pos += step.length;
      continue;
    }
    out.append(text.substr(run, pos - run));
    if (step.truncated && keep_truncated_tail) return text.size() - pos;
    out.append(kReplacementUtf8);
    pos += step.length;
    run = pos;
  }
  out.append(text.substr(run));
  return 0;
}

}  // namespace pipemat::data::utf8
