// NFC for the tokenizer.json normalizer of that name.
//
// Note [NFC as the tokenizers package writes it]
// Normalization Form C (UAX #15): every character decomposed canonically (recursively; Hangul
// syllables by arithmetic), each run of combining marks put in the order of their combining
// classes (a stable sort), then composed again from left to right: a mark joins the last starter
// when a primary composite of the two exists and no mark between them has a class as high as it
// (or it follows the starter directly). The tables (unicode_nfc_tables.h) are Unicode's as the
// tokenizers package's NFC has them, not the newest: that package's tables are older than Unicode
// 10, so 98 marks assigned since have class 0 there (they are not reordered) and U+11938's
// decomposition (Unicode 13) is not there. tests/data/tokenizer_oracle.py nfc-tables generates them
// from Python's Unicode data, probing the tokenizers package for what it lacks; the test
// TokenizerFixtures.Qwen2StyleNfcMatches encodes every code point alone, each decomposable one
// in its NFD form and pairs of marks, and compares the ids. Text below U+0300 is in NFC already
// (no character there decomposes, none composes with another) and is returned as it is.

#include <algorithm>
#include <vector>

#include "tokenizers.h"
#include "unicode_nfc_tables.h"
#include "utf8.h"

namespace pipemat::data::unicode {
namespace {

constexpr char32_t kHangulBase = 0xAC00;
constexpr char32_t kLeadBase = 0x1100;
constexpr char32_t kVowelBase = 0x1161;
constexpr char32_t kTrailBase = 0x11A7;
constexpr char32_t kVowels = 21;
constexpr char32_t kTrails = 28;
constexpr char32_t kHangulCount = 19 * kVowels * kTrails;

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  const auto it = std::upper_bound(kCombiningClasses.begin(), kCombiningClasses.end(), cp,
                                   [](char32_t c, const ClassRange& r) { return c < r.first; });
  if (it == kCombiningClasses.begin()) return 0;
  const ClassRange& r = *(it - 1);
  return cp <= r.last ? r.ccc : 0;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kHangulBase && cp < kHangulBase + kHangulCount) {
    const char32_t s = cp - kHangulBase;
    out.push_back(kLeadBase + s / (kVowels * kTrails));
    out.push_back(kVowelBase + (s % (kVowels * kTrails)) / kTrails);
    if (s % kTrails != 0) out.push_back(kTrailBase + s % kTrails);
    return;
  }
  if (cp >= 0xC0) {
    const auto it =
        std::lower_bound(kDecompositions.begin(), kDecompositions.end(), cp,
                         [](const Decomposition& d, char32_t c) { return d.code_point < c; });
    if (it != kDecompositions.end() && it->code_point == cp) {
      decompose(it->first, out);
      if (it->second != 0) decompose(it->second, out);
      return;
    }
  }
  out.push_back(cp);
}

// The primary composite of `a` and `b`, or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLeadBase && a < kLeadBase + 19 && b >= kVowelBase && b < kVowelBase + kVowels) {
    return kHangulBase + ((a - kLeadBase) * kVowels + (b - kVowelBase)) * kTrails;
  }
  if (a >= kHangulBase && a < kHangulBase + kHangulCount && (a - kHangulBase) % kTrails == 0 &&
      b > kTrailBase && b < kTrailBase + kTrails) {
    return a + (b - kTrailBase);
  }
  const auto it =
      std::lower_bound(kCompositions.begin(), kCompositions.end(), std::pair(a, b),
                       [](const Composition& c, const std::pair<char32_t, char32_t>& k) {
                         return std::pair(c.first, c.second) < k;
                       });
  if (it != kCompositions.end() && it->first == a && it->second == b) return it->composite;
  return 0;
}

}  // namespace

std::string nfc(std::string_view text) {
  // Below U+0300 (lead bytes under 0xCC) everything is NFC already.
  if (std::none_of(text.begin(), text.end(),
                   [](char c) { return static_cast<uint8_t>(c) >= 0xCC; })) {
    return std::string(text);
  }
  std::vector<char32_t> chars;
  chars.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const utf8::Step step = utf8::read(text, pos);
    decompose(step.valid ? step.code_point : utf8::kReplacement, chars);
    pos += step.length;
  }
  // Canonical order: each run of marks sorted by class, stably.
  std::vector<uint8_t> classes(chars.size());
  for (size_t i = 0; i < chars.size(); ++i) classes[i] = combining_class(chars[i]);
  for (size_t i = 0; i < chars.size();) {
    if (classes[i] == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < chars.size() && classes[end] != 0) ++end;
    if (end - i > 1) {
      std::vector<std::pair<uint8_t, char32_t>> run;
      for (size_t k = i; k < end; ++k) run.emplace_back(classes[k], chars[k]);
      std::stable_sort(run.begin(), run.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      for (size_t k = i; k < end; ++k) {
        classes[k] = run[k - i].first;
        chars[k] = run[k - i].second;
      }
    }
    i = end;
  }
  // Composition (UAX #15's sample algorithm).
  size_t kept = 0;
  size_t starter = 0;
  bool have_starter = false;
  int last_class = -1;
  for (size_t i = 0; i < chars.size(); ++i) {
    const char32_t ch = chars[i];
    const int cls = classes[i];
    if (have_starter && (last_class < cls || last_class == 0)) {
      if (const char32_t composite = compose(chars[starter], ch); composite != 0) {
        chars[starter] = composite;
        continue;
      }
    }
    if (cls == 0) {
      starter = kept;
      have_starter = true;
    }
    last_class = cls;
    chars[kept] = ch;
    classes[kept] = static_cast<uint8_t>(cls);
    ++kept;
  }
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < kept; ++i) utf8::append(chars[i], out);
  return out;
}

}  // namespace pipemat::data::unicode
