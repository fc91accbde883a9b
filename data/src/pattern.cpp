// The pre-tokenizer patterns of a tokenizer.json, run by PCRE2.
//
// Note [Oniguruma patterns in PCRE2]
// The tokenizers package compiles a pre-tokenizer's pattern (ByteLevel's GPT-2 pattern, a
// Split's Regex) with Oniguruma in its Ruby syntax; pipemat runs them with PCRE2 (UTF and UCP
// mode, JIT-compiled where the library has a JIT), a backtracking engine with the same
// leftmost-first semantics. Where the two read a construct differently the pattern is translated,
// and what is not translated is refused when the tokenizer is loaded, naming the construct and its
// offset, so a pattern never silently splits text another way:
//   - \s is Oniguruma's White_Space: \t \n \v \f \r, U+0020, U+0085, U+00A0, U+1680,
//     U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000, written out as that class (PCRE2's
//     \s also takes U+180E). \S is its complement, also inside a class.
//   - \p{L} and \p{N}: Oniguruma in tokenizers 0.23 has Unicode 16's tables, PCRE2 10.42 Unicode
//     14's. The letters and numbers of Unicode 15 and 16 (kNewLetters and kNewNumbers below, 35
//     and 10 ranges) are added to PCRE2's \p{L} and \p{N}; with a newer PCRE2 they are merely
//     redundant. \P{L}, \P{N}, \p{^L} and \p{^N} are the complements (outside a class only).
//     Other properties (\p{Lu}, \p{P}, ...) are refused: their tables would need the same care.
//   - '.' is any character but \n, '^' and '$' match at line starts and ends (Oniguruma's Ruby
//     syntax is always multi-line), written as (?<![^\n]) and (?![^\n]).
//   - \v is U+000B (PCRE2: any vertical space), \uHHHH a code point, {,n} is {0,n}, a '{' that
//     starts no interval is a literal '{'; a capturing group is compiled as a non-capturing one
//     (nothing reads its captures).
//   - Refused: \w \d \h \b and the other letter escapes, back-references and octal escapes, nested
//     classes, POSIX brackets and && in a class, named groups, comments, inline options other
//     than i, a '+' after an interval (Ruby repeats the interval again, PCRE2 would make it
//     possessive).
// The test TokenizerPattern.CharacterClassesMatchTheTokenizersPackage checks every code point
// against the tokenizers package for \s, \S, \p{L}, \p{N}, the classes of the GPT-2, Llama 3 and
// Qwen2 patterns and their case-insensitive contractions, so a tokenizers or PCRE2 upgrade that
// moves a character shows there, with the code points to add to the tables.
//
// Matches are iterated as Oniguruma's find_iter does (the onig crate): search from the end of the
// previous match with the whole text as context (look-behind sees what precedes it); an empty
// match right at the end of the previous match is skipped and the search goes on one character
// later. PCRE2's limits are lifted (match and depth limits, a heap limit of 4 GiB, a JIT stack of
// up to 256 MiB) so that a megabyte of one character matches as it does in Oniguruma.

#include "pattern.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <limits>

#include "pipemat/data/error.h"
#include "utf8.h"

namespace pipemat::data::pattern {
namespace {

// Code points that Oniguruma in tokenizers 0.23.3 (Unicode 16.0) counts as \p{L} and \p{N} and
// PCRE2 10.42 (Unicode 14.0) does not: what Unicode 15.0, 15.1 and 16.0 assigned.
constexpr std::array<std::pair<char32_t, char32_t>, 35> kNewLetters = {{
    {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},   {0x105C0, 0x105F3},
    {0x10D4A, 0x10D65}, {0x10D6F, 0x10D85}, {0x10EC2, 0x10EC4}, {0x1123F, 0x11240},
    {0x11380, 0x11389}, {0x1138B, 0x1138B}, {0x1138E, 0x1138E}, {0x11390, 0x113B5},
    {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0},
    {0x11F02, 0x11F02}, {0x11F04, 0x11F10}, {0x11F12, 0x11F33}, {0x1342F, 0x1342F},
    {0x13441, 0x13446}, {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D40, 0x16D6C},
    {0x18CFF, 0x18CFF}, {0x1B132, 0x1B132}, {0x1B155, 0x1B155}, {0x1DF25, 0x1DF2A},
    {0x1E030, 0x1E06D}, {0x1E4D0, 0x1E4EB}, {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0},
    {0x2B739, 0x2B739}, {0x2EBF0, 0x2EE5D}, {0x31350, 0x323AF},
}};
constexpr std::array<std::pair<char32_t, char32_t>, 10> kNewNumbers = {{
    {0x10D40, 0x10D49},
    {0x116D0, 0x116E3},
    {0x11BF0, 0x11BF9},
    {0x11F50, 0x11F59},
    {0x16130, 0x16139},
    {0x16D70, 0x16D79},
    {0x1CCF0, 0x1CCF9},
    {0x1D2C0, 0x1D2D3},
    {0x1E4F0, 0x1E4F9},
    {0x1E5F1, 0x1E5FA},
}};
// Oniguruma's \s (Unicode White_Space), as class items, and its complement.
constexpr std::string_view kSpaceItems =
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}"
    "\\x{205f}\\x{3000}";
constexpr std::string_view kNotSpaceItems =
    "\\x{0}-\\x{8}\\x{e}-\\x{1f}\\x{21}-\\x{84}\\x{86}-\\x{9f}\\x{a1}-\\x{167f}\\x{1681}-\\x{1fff}"
    "\\x{200b}-\\x{2027}\\x{202a}-\\x{202e}\\x{2030}-\\x{205e}\\x{2060}-\\x{2fff}"
    "\\x{3001}-\\x{d7ff}\\x{e000}-\\x{10ffff}";

std::string hex(char32_t cp) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string digits;
  do {
    digits.insert(digits.begin(), kDigits[cp & 0xF]);
    cp >>= 4;
  } while (cp != 0);
  return "\\x{" + digits + "}";
}

template <size_t N>
std::string items_of(const std::array<std::pair<char32_t, char32_t>, N>& ranges) {
  std::string items;
  for (const auto& [first, last] : ranges) {
    items += hex(first);
    if (last != first) items += "-" + hex(last);
  }
  return items;
}

// The class items of \p{L} or \p{N} as Oniguruma has them.
std::string property_items(char name) {
  static const std::string letters = "\\p{L}" + items_of(kNewLetters);
  static const std::string numbers = "\\p{N}" + items_of(kNewNumbers);
  return name == 'L' ? letters : numbers;
}

bool is_hex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

// One pass over an Oniguruma pattern, writing its PCRE2 translation.
class Translator {
 public:
  Translator(std::string_view onig, const std::string& where) : p_(onig), where_(where) {}

  std::string run() {
    while (i_ < p_.size()) {
      const char c = p_[i_];
      switch (c) {
        case '\\':
          escape(/*in_class=*/false);
          break;
        case '[':
          char_class();
          break;
        case '(':
          group();
          break;
        case '{':
          interval();
          break;
        case '.':
          out_ += "[^\\n]";
          ++i_;
          break;
        case '^':
          out_ += "(?<![^\\n])";
          ++i_;
          break;
        case '$':
          out_ += "(?![^\\n])";
          ++i_;
          break;
        default:
          copy_char();
      }
    }
    return out_;
  }

 private:
  [[noreturn]] void refuse(size_t at, const std::string& what) const {
    std::string shown(p_.substr(0, 200));
    PIPEMAT_THROW(DataError, where_, ": pattern '", shown, p_.size() > 200 ? "..." : "",
                  "': ", what, " at offset ", at,
                  " is not supported (pipemat runs the patterns with PCRE2 and translates "
                  "literals, classes, groups, look-arounds, quantifiers, \\s \\S \\p{L} \\p{N} "
                  "and the escapes of characters: Note [Oniguruma patterns in PCRE2])");
  }

  // Copies one UTF-8 character (the pattern is a JSON string: valid UTF-8).
  void copy_char() {
    const utf8::Step step = utf8::read(p_, i_);
    out_.append(p_.substr(i_, step.length));
    i_ += step.length;
  }

  // A hex escape's digits after \x or \u: "{H...}" or `fixed` digits (\xHH takes one or two).
  void hex_escape(size_t start, bool braces_allowed, size_t min_digits, size_t max_digits) {
    if (braces_allowed && i_ < p_.size() && p_[i_] == '{') {
      const size_t close = p_.find('}', i_);
      if (close == std::string_view::npos || close == i_ + 1 || close - i_ - 1 > 8) {
        refuse(start, "a malformed \\x{...} escape");
      }
      for (size_t k = i_ + 1; k < close; ++k) {
        if (!is_hex(p_[k])) refuse(start, "a malformed \\x{...} escape");
      }
      out_ += "\\x{" + std::string(p_.substr(i_ + 1, close - i_ - 1)) + "}";
      i_ = close + 1;
      return;
    }
    size_t n = 0;
    while (n < max_digits && i_ + n < p_.size() && is_hex(p_[i_ + n])) ++n;
    if (n < min_digits) refuse(start, "a malformed hex escape");
    out_ += "\\x{" + std::string(p_.substr(i_, n)) + "}";
    i_ += n;
  }

  void escape(bool in_class) {
    const size_t start = i_;
    if (i_ + 1 >= p_.size()) refuse(start, "a '\\' at the end of the pattern");
    const char c = p_[i_ + 1];
    i_ += 2;
    switch (c) {
      case 's':
        out_ += in_class ? std::string(kSpaceItems) : "[" + std::string(kSpaceItems) + "]";
        return;
      case 'S':
        out_ += in_class ? std::string(kNotSpaceItems) : "[" + std::string(kNotSpaceItems) + "]";
        return;
      case 'p':
      case 'P': {
        const size_t close = p_.find('}', i_);
        if (i_ >= p_.size() || p_[i_] != '{' || close == std::string_view::npos) {
          refuse(start, "a \\p without {name}");
        }
        std::string name(p_.substr(i_ + 1, close - i_ - 1));
        bool negated = c == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.erase(0, 1);
        }
        if (name != "L" && name != "N") refuse(start, "the property \\p{" + name + "}");
        if (negated && in_class) refuse(start, "a negated property inside a class");
        const std::string items = property_items(name[0]);
        out_ += in_class ? items : (negated ? "[^" : "[") + items + "]";
        i_ = close + 1;
        return;
      }
      case 'n':
        out_ += "\\n";
        return;
      case 't':
        out_ += "\\t";
        return;
      case 'r':
        out_ += "\\r";
        return;
      case 'f':
        out_ += "\\f";
        return;
      case 'v':
        out_ += "\\x{b}";
        return;
      case 'a':
        out_ += "\\x{7}";
        return;
      case 'e':
        out_ += "\\x{1b}";
        return;
      case 'x':
        hex_escape(start, true, 1, 2);
        return;
      case 'u':
        hex_escape(start, false, 4, 4);
        return;
      default:
        break;
    }
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80 && !std::isalnum(byte) && byte >= 0x20) {
      out_ += '\\';
      out_ += c;
      return;
    }
    refuse(start, "the escape '\\" + std::string(1, c) + "'");
  }

  void char_class() {
    const size_t start = i_;
    out_ += '[';
    ++i_;
    if (i_ < p_.size() && p_[i_] == '^') {
      out_ += '^';
      ++i_;
    }
    bool first = true;
    while (true) {
      if (i_ >= p_.size()) refuse(start, "a class without its ']'");
      const char c = p_[i_];
      if (c == ']') {
        if (first) refuse(i_, "a ']' first in a class");
        out_ += ']';
        ++i_;
        return;
      }
      if (c == '[') refuse(i_, "a '[' inside a class (a nested class or a POSIX bracket)");
      if (c == '&' && i_ + 1 < p_.size() && p_[i_ + 1] == '&') refuse(i_, "'&&' in a class");
      if (c == '\\') {
        escape(/*in_class=*/true);
      } else {
        copy_char();
      }
      first = false;
    }
  }

  void group() {
    const size_t start = i_;
    ++i_;
    if (i_ >= p_.size() || p_[i_] != '?') {
      out_ += "(?:";  // nothing reads captures
      return;
    }
    const std::string_view rest = p_.substr(i_ + 1);
    for (std::string_view form : {":", "=", "!", "<=", "<!", ">", "i:", "i)", "-i:", "-i)"}) {
      if (rest.substr(0, form.size()) == form) {
        out_ += "(?" + std::string(form);
        i_ += 1 + form.size();
        return;
      }
    }
    refuse(start, "the group '(?" + std::string(rest.substr(0, 2)) + "'");
  }

  // {n}, {n,}, {n,m} and {,m}; anything else is a literal '{' (as in Oniguruma).
  void interval() {
    const size_t close = p_.find('}', i_);
    if (close != std::string_view::npos) {
      const std::string_view body = p_.substr(i_ + 1, close - i_ - 1);
      const size_t comma = body.find(',');
      auto digits = [](std::string_view s) {
        for (char d : s) {
          if (d < '0' || d > '9') return false;
        }
        return true;
      };
      const std::string_view low = body.substr(0, comma);
      const std::string_view high =
          comma == std::string_view::npos ? std::string_view() : body.substr(comma + 1);
      const bool ok =
          !body.empty() && digits(low) && digits(high) &&
          (comma == std::string_view::npos ? !low.empty()
                                           : body.find(',', comma + 1) == std::string_view::npos &&
                                                 !(low.empty() && high.empty()));
      if (ok) {
        out_ += "{" + std::string(low.empty() ? "0" : low) +
                (comma == std::string_view::npos ? "" : "," + std::string(high)) + "}";
        i_ = close + 1;
        if (i_ < p_.size() && p_[i_] == '+') {
          refuse(i_,
                 "a '+' after an interval (Ruby repeats the interval, PCRE2 reads it as "
                 "possessive)");
        }
        return;
      }
    }
    out_ += "\\{";
    ++i_;
  }

  std::string_view p_;
  const std::string& where_;
  size_t i_ = 0;
  std::string out_;
};

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buffer{};
  if (pcre2_get_error_message(code, buffer.data(), buffer.size()) < 0) {
    return "PCRE2 error " + std::to_string(code);
  }
  return reinterpret_cast<const char*>(buffer.data());
}

// What one thread matches with: match data (the whole match only), a context with the limits
// lifted, and a JIT stack.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    if (context != nullptr) {
      pcre2_set_match_limit(context, std::numeric_limits<uint32_t>::max());
      pcre2_set_depth_limit(context, std::numeric_limits<uint32_t>::max());
      pcre2_set_heap_limit(context, uint32_t{4} << 20);  // KiB: 4 GiB
      stack = pcre2_jit_stack_create(64 << 10, 256 << 20, nullptr);
      if (stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
    }
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

std::string translate(std::string_view onig, const std::string& where) {
  return Translator(onig, where).run();
}

Regex::Regex(pcre2_real_code_8* code, std::string source, std::string where)
    : code_(code), source_(std::move(source)), where_(std::move(where)) {
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(code_); }

namespace {

pcre2_code* compile_pcre2(const std::string& source, uint32_t options, const std::string& where,
                          std::string_view shown) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                                   options, &error, &offset, nullptr);
  if (code == nullptr) {
    PIPEMAT_THROW(DataError, where, ": pattern '", shown,
                  "' does not compile (PCRE2: ", pcre2_message(error), ", at offset ", offset,
                  " of its translation '", source, "')");
  }
  return code;
}

}  // namespace

std::unique_ptr<Regex> Regex::oniguruma(std::string_view onig, const std::string& where) {
  std::string source = translate(onig, where);
  pcre2_code* code =
      compile_pcre2(source, PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C, where, onig);
  return std::unique_ptr<Regex>(new Regex(code, std::move(source), where));
}

std::unique_ptr<Regex> Regex::literal(std::string_view literal, const std::string& where) {
  std::string source(literal);
  pcre2_code* code = compile_pcre2(source, PCRE2_UTF | PCRE2_LITERAL, where, literal);
  return std::unique_ptr<Regex>(new Regex(code, std::move(source), where));
}

void Regex::find_all(std::string_view text, std::vector<Span>& out) const {
  out.clear();
  MatchState& state = match_state();
  PIPEMAT_CHECK(state.data != nullptr && state.context != nullptr, DataError, where_,
                ": out of memory for PCRE2's match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t last_end = 0;
  bool matched_before = false;
  size_t last_match_end = 0;
  while (last_end <= text.size()) {
    const int rc =
        jit_ ? pcre2_jit_match(code_, subject, text.size(), last_end, 0, state.data, state.context)
             : pcre2_match(code_, subject, text.size(), last_end, PCRE2_NO_UTF_CHECK, state.data,
                           state.context);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      PIPEMAT_THROW(DataError, where_, ": matching the pattern '", source_, "' on a text of ",
                    text.size(), " bytes failed (PCRE2: ", pcre2_message(rc), ")");
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    if (start == end && matched_before && last_match_end == end) {
      // An empty match where the previous one ended: go on one character later.
      last_end += last_end < text.size() ? utf8::read(text, last_end).length : 1;
      continue;
    }
    last_end = end;
    last_match_end = end;
    matched_before = true;
    out.emplace_back(start, end);
  }
}

}  // namespace pipemat::data::pattern
