#pragma once
// The regular expressions of a tokenizer.json's pre-tokenizers (Oniguruma's Ruby syntax, as the
// tokenizers package compiles them) run by PCRE2: Note [Oniguruma patterns in PCRE2] in
// pattern.cpp.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct pcre2_real_code_8;

namespace pipemat::data::pattern {

// [begin, end) byte offsets of a match or a piece.
using Span = std::pair<size_t, size_t>;

// The PCRE2 pattern that matches what the Oniguruma pattern `onig` matches in the tokenizers
// package. DataError "<where>: ..." naming the construct and its offset when the pattern uses one
// that is not translated.
std::string translate(std::string_view onig, const std::string& where);

// A compiled pattern. Immutable; find_all is thread-safe.
class Regex {
 public:
  // `onig` through translate(), or the literal text `literal` (a Split's "String" pattern).
  static std::unique_ptr<Regex> oniguruma(std::string_view onig, const std::string& where);
  static std::unique_ptr<Regex> literal(std::string_view literal, const std::string& where);
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();

  // Replaces `out` with the matches in `text` (valid UTF-8) as the tokenizers package's find_iter
  // gives them: left to right, not overlapping, an empty match right where the previous match
  // ended skipped (the search then goes on one character later). DataError "<where>: ..." when
  // PCRE2 fails (a resource limit; never seen).
  void find_all(std::string_view text, std::vector<Span>& out) const;

  const std::string& source() const { return source_; }

 private:
  Regex(pcre2_real_code_8* code, std::string source, std::string where);
  pcre2_real_code_8* code_;
  bool jit_ = false;
  std::string source_;  // the PCRE2 pattern
  std::string where_;
};

}  // namespace pipemat::data::pattern
