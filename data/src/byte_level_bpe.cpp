// A byte-level BPE tokenizer read from a Hugging Face tokenizer.json.
//
// Note [tokenizer.json as the tokenizers package reads it]
// parse_tokenizer_json reads the file with core's strict JSON (Note [Strict JSON]) and takes the
// parts that decide the ids as the tokenizers package (0.23) takes them; every other value of a
// part it reads is a DataError naming the field and what is supported, so a file pipemat loads is
// one whose ids it gives token for token (Note [Text to tokens]):
//   - model: type "BPE", a vocab of tokens to the ids 0..N-1 (no id twice, no hole), merges as
//     "a b" strings or [a, b] pairs (both tokens and their concatenation in the vocab, no merge
//     twice: tokenizers would keep the later rank in silence), ignore_merges (a pre-token that is
//     a token is that token), dropout null or 0, unk_token (unused: see below), fuse_unk,
//     byte_fallback false, continuing_subword_prefix and end_of_word_suffix null or "".
//   - The byte-level alphabet: the vocab holds the 256 characters GPT-2 maps the bytes to. A
//     vocab without one of them would drop that byte from the text in silence (with unk_token
//     null) or turn it into the unknown token; neither is text a language model should train on.
//   - normalizer: null, NFC, or a Sequence of those. pre_tokenizer: ByteLevel (add_prefix_space,
//     use_regex: the GPT-2 pattern), or a Sequence of Split (a Regex or String pattern, each of
//     the five behaviors, invert) and Digits (individual_digits or not) ending in ByteLevel, as
//     Llama 3, Qwen2 and SmolLM write it. The patterns run with PCRE2 (Note [Oniguruma patterns
//     in PCRE2] in pattern.cpp). decoder: ByteLevel. post_processor: not read (encode adds no
//     special token). truncation and padding: null (they would cut or pad what encode returns).
//   - added_tokens: content, id, lstrip, rstrip, normalized, special; single_word true is
//     refused. They are matched as tokenizers' AddedVocabulary matches them: first the tokens
//     with normalized false in the raw text, then, in each stretch between those, after the
//     normalizer, the tokens with normalized true (their content normalized too), each set
//     leftmost-longest; lstrip and rstrip take the White_Space before and after into the token.
//     An id must be the one tokenizers gives the token (the vocab's id of a token the vocab holds,
//     else the next id after the vocab and the added tokens before it): tokenizers gives its own
//     id with a warning in a log, which would make pipemat's ids differ.
//   - Pre-tokens are then merged as tokenizers' BPE merges them: repeatedly the adjacent pair of
//     lowest rank, the leftmost of equal ranks (a min-scan for words up to kScanLimit bytes, a
//     heap of (rank, position) as tokenizers has for longer ones: a megabyte of one letter is one
//     pre-token). The merge table is an open-addressing hash of the pair of ids.
// Speed: a text's pre-tokens repeat, so the ids of each pre-token of up to kMaxCachedBytes bytes
// are kept in a cache of 64 shards (a mutex and a hash map each; a full shard is emptied), shared
// by every thread that encodes; decode is a table of each id's bytes.

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "pattern.h"
#include "pipemat/core/json.h"
#include "tokenizers.h"
#include "utf8.h"

namespace pipemat::data {
namespace bpe_impl {

using Json = nlohmann::json;

constexpr size_t kScanLimit = 64;
constexpr size_t kMaxCachedBytes = 256;

// GPT-2's bytes_to_unicode: the character each byte is written as in a byte-level vocab.
struct ByteAlphabet {
  std::array<char32_t, 256> char_of_byte{};
  std::array<int16_t, 324> byte_of_char{};  // -1: not a character of the alphabet
  ByteAlphabet() {
    byte_of_char.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      char_of_byte[b] = printable ? static_cast<char32_t>(b) : next++;
      byte_of_char[char_of_byte[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet kAlphabet;
  return kAlphabet;
}

// The bytes a byte-level token stands for, or nothing when a character of it is not of the
// alphabet.
std::optional<std::string> bytes_of_token(std::string_view token) {
  std::string bytes;
  size_t pos = 0;
  while (pos < token.size()) {
    const utf8::Step step = utf8::read(token, pos);
    if (!step.valid || step.code_point >= alphabet().byte_of_char.size() ||
        alphabet().byte_of_char[step.code_point] < 0) {
      return std::nullopt;
    }
    bytes += static_cast<char>(alphabet().byte_of_char[step.code_point]);
    pos += step.length;
  }
  return bytes;
}

// A value as a message shows it: its JSON, cut after 60 characters.
std::string shown(const Json& value) {
  std::string text = value.dump(-1, ' ', /*ensure_ascii=*/true);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

// A token as a message shows it: quoted, non-ASCII and control bytes as \xNN, cut.
std::string token_text(std::string_view token) { return shown(Json(std::string(token))); }

// The fields of one JSON object of the file, failing with the field's path.
class Fields {
 public:
  Fields(const Json& object, const std::string& file, std::string path)
      : object_(object), file_(file), path_(std::move(path)) {}

  std::string name(std::string_view field) const {
    if (path_.empty()) return std::string(field);
    if (field.empty()) return path_;
    return path_ + "." + std::string(field);
  }
  [[noreturn]] void fail(std::string_view field, const std::string& message) const {
    PIPEMAT_THROW(DataError, file_, ": field '", name(field), "' ", message);
  }
  // Every key of the object is one of `known`.
  void only(std::initializer_list<std::string_view> known, const std::string& what) const {
    for (const auto& [key, value] : object_.items()) {
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::string list;
        for (std::string_view k : known) list += (list.empty() ? "" : ", ") + std::string(k);
        fail(key, "is not a field of " + what + " that pipemat reads (it reads: " + list + ")");
      }
    }
  }
  bool given(std::string_view field) const {
    const auto it = object_.find(field);
    return it != object_.end() && !it->is_null();
  }
  const Json& at(std::string_view field) const {
    const auto it = object_.find(field);
    if (it == object_.end()) fail(field, "is missing");
    return *it;
  }
  bool boolean(std::string_view field, std::optional<bool> absent) const {
    const auto it = object_.find(field);
    if (it == object_.end()) {
      if (!absent) fail(field, "is missing; expected true or false");
      return *absent;
    }
    if (!it->is_boolean()) fail(field, "is " + shown(*it) + "; expected true or false");
    return it->get<bool>();
  }
  std::string text(std::string_view field) const {
    const Json& v = at(field);
    if (!v.is_string()) fail(field, "is " + shown(v) + "; expected a string");
    return v.get<std::string>();
  }
  std::string type() const {
    if (!object_.is_object()) fail("", "is " + shown(object_) + "; expected an object");
    return text("type");
  }
  const Json& object() const { return object_; }
  const std::string& file() const { return file_; }

 private:
  const Json& object_;
  const std::string& file_;
  std::string path_;
};

// The merges: (left id, right id) -> (rank, merged id), open addressing.
class MergeTable {
 public:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  explicit MergeTable(size_t count) {
    size_t capacity = 16;
    while (capacity < 2 * count + 1) capacity *= 2;
    keys_.assign(capacity, kEmpty);
    values_.resize(capacity);
    mask_ = capacity - 1;
  }
  // false when the pair is there already.
  bool insert(int32_t left, int32_t right, Merge merge) {
    const uint64_t key = pack(left, right);
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return false;
      if (keys_[i] == kEmpty) {
        keys_[i] = key;
        values_[i] = merge;
        return true;
      }
    }
  }
  const Merge* find(int32_t left, int32_t right) const {
    const uint64_t key = pack(left, right);
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = std::numeric_limits<uint64_t>::max();
  static uint64_t pack(int32_t left, int32_t right) {
    return (uint64_t{static_cast<uint32_t>(left)} << 32) | static_cast<uint32_t>(right);
  }
  size_t slot(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> 17) & mask_;
  }
  std::vector<uint64_t> keys_;
  std::vector<Merge> values_;
  size_t mask_ = 0;
};

// The ids of recent pre-tokens, shared by the threads that encode.
class WordCache {
 public:
  bool find(std::string_view word, std::vector<int32_t>& out) {
    Shard& shard = shard_of(word);
    std::lock_guard<std::mutex> lock(shard.mutex);
    const auto it = shard.map.find(word);
    if (it == shard.map.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }
  void put(std::string_view word, const int32_t* ids, size_t count) {
    Shard& shard = shard_of(word);
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.map.size() >= kPerShard) shard.map.clear();
    shard.map.try_emplace(std::string(word), ids, ids + count);
  }

 private:
  static constexpr size_t kShards = 64;
  static constexpr size_t kPerShard = 4096;
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>> map;
  };
  Shard& shard_of(std::string_view word) {
    // Not the map's own hash bits: FNV-1a of the word.
    uint32_t h = 2166136261u;
    for (const char c : word) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
    return shards_[h % kShards];
  }
  std::array<Shard, kShards> shards_;
};

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// A stretch of text that is an added token (token >= 0) or to be tokenized (-1).
struct Segment {
  size_t begin = 0;
  size_t end = 0;
  int32_t token = -1;
};

// The char before `end`, read backwards.
char32_t char_before(std::string_view text, size_t end, size_t& length) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80 && end - start < 4) {
    --start;
  }
  const utf8::Step step = utf8::read(text, start);
  length = end - start;
  return step.code_point;
}

// One set of added tokens matched leftmost-longest (tokenizers' aho-corasick with
// MatchKind::LeftmostLongest), then stripped as AddedVocabulary::find_matches strips them.
class AddedMatcher {
 public:
  void add(const AddedToken& token, std::string_view pattern) {
    if (nodes_.empty()) nodes_.emplace_back();
    size_t node = 0;
    for (const char c : pattern) {
      const auto byte = static_cast<uint8_t>(c);
      int32_t next = -1;
      for (const auto& [b, n] : nodes_[node].next) {
        if (b == byte) next = n;
      }
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].next.emplace_back(byte, next);
        nodes_.emplace_back();
      }
      node = static_cast<size_t>(next);
    }
    nodes_[node].token = static_cast<int32_t>(tokens_.size());
    tokens_.push_back(&token);
    first_[static_cast<uint8_t>(pattern.front())] = true;
  }
  bool empty() const { return tokens_.empty(); }

  // Replaces `out` with the segments of `sentence`.
  void split(std::string_view sentence, std::vector<Segment>& out) const {
    out.clear();
    if (tokens_.empty() || sentence.empty()) {
      out.push_back({0, sentence.size(), -1});
      return;
    }
    size_t start_offset = 0;
    size_t pos = 0;
    while (pos < sentence.size()) {
      if (!first_[static_cast<uint8_t>(sentence[pos])]) {
        ++pos;
        continue;
      }
      // The longest token starting at pos.
      size_t node = 0;
      int32_t found = -1;
      size_t found_end = 0;
      for (size_t i = pos; i < sentence.size(); ++i) {
        int32_t next = -1;
        for (const auto& [b, n] : nodes_[node].next) {
          if (b == static_cast<uint8_t>(sentence[i])) next = n;
        }
        if (next < 0) break;
        node = static_cast<size_t>(next);
        if (nodes_[node].token >= 0) {
          found = nodes_[node].token;
          found_end = i + 1;
        }
      }
      if (found < 0) {
        ++pos;
        continue;
      }
      const AddedToken& token = *tokens_[static_cast<size_t>(found)];
      size_t start = pos;
      size_t stop = found_end;
      pos = found_end;  // the next match starts after this one, whatever rstrip takes
      if (token.lstrip) {
        size_t begin = start;
        while (begin > 0) {
          size_t length = 0;
          if (!unicode::is_white_space(char_before(sentence, begin, length))) break;
          begin -= length;
        }
        start = std::max(begin, start_offset);
      }
      if (token.rstrip) {
        while (stop < sentence.size()) {
          const utf8::Step step = utf8::read(sentence, stop);
          if (!unicode::is_white_space(step.code_point)) break;
          stop += step.length;
        }
      }
      if (start > start_offset) out.push_back({start_offset, start, -1});
      out.push_back({start, stop, token.id});
      start_offset = stop;
    }
    if (start_offset != sentence.size()) out.push_back({start_offset, sentence.size(), -1});
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;
    int32_t token = -1;
  };
  std::vector<Node> nodes_;
  std::vector<const AddedToken*> tokens_;
  std::array<bool, 256> first_{};
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One pre-tokenizer of the chain: a split (Split, Digits) or the final ByteLevel.
struct PreStep {
  std::unique_ptr<pattern::Regex> regex;  // ByteLevel: the GPT-2 pattern when use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool byte_level = false;
  bool add_prefix_space = false;
};

// The pieces a Split leaves of `text`, as NormalizedString::split computes them from the
// matches (tokenizers/src/tokenizer/normalizer.rs); empty pieces are dropped by the caller.
void split_pieces(std::string_view text, const PreStep& step,
                  const std::vector<pattern::Span>& matches, std::vector<pattern::Span>& pieces) {
  pieces.clear();
  if (text.empty()) return;
  // (offsets, is_match) as Pattern::find_matches gives them.
  struct Part {
    pattern::Span span;
    bool match;
  };
  std::vector<Part> parts;
  parts.reserve(2 * matches.size() + 1);
  size_t prev = 0;
  for (const auto& [start, end] : matches) {
    if (prev != start) parts.push_back({{prev, start}, step.invert});
    parts.push_back({{start, end}, !step.invert});
    prev = end;
  }
  if (prev != text.size()) parts.push_back({{prev, text.size()}, step.invert});

  switch (step.behavior) {
    case Behavior::kIsolated:
      for (const Part& p : parts) pieces.push_back(p.span);
      return;
    case Behavior::kRemoved:
      for (const Part& p : parts) {
        if (!p.match) pieces.push_back(p.span);
      }
      return;
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (const Part& p : parts) {
        if (p.match == previous_match && !pieces.empty()) {
          pieces.back().second = p.span.second;
        } else {
          pieces.push_back(p.span);
        }
        previous_match = p.match;
      }
      return;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Part& p : parts) {
        if (p.match && !previous_match && !pieces.empty()) {
          pieces.back().second = p.span.second;
        } else {
          pieces.push_back(p.span);
        }
        previous_match = p.match;
      }
      return;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !previous_match && !pieces.empty()) {
          pieces.back().first = it->span.first;
        } else {
          pieces.push_back(it->span);
        }
        previous_match = it->match;
      }
      std::reverse(pieces.begin(), pieces.end());
      return;
    }
  }
}

// The vectors one encode call reuses, one set per pre-tokenizer level.
struct Scratch {
  std::vector<Segment> raw_segments;
  std::vector<Segment> normalized_segments;
  std::array<std::vector<pattern::Span>, 8> matches;
  std::array<std::vector<pattern::Span>, 8> pieces;
};

class ByteLevelBpe final : public Tokenizer {
 public:
  ByteLevelBpe(const Json& top, const std::string& name);

  std::vector<int32_t> encode(std::string_view text) const override {
    std::string cleaned;
    std::string_view s = text;
    if (!utf8::is_valid(text)) {
      cleaned = valid_utf8(text);
      s = cleaned;
    }
    std::vector<int32_t> ids;
    ids.reserve(s.size() / 3 + 1);
    Scratch scratch;
    raw_matcher_.split(s, scratch.raw_segments);
    for (const Segment& segment : scratch.raw_segments) {
      if (segment.token >= 0) {
        ids.push_back(segment.token);
      } else {
        encode_normalized(s.substr(segment.begin, segment.end - segment.begin), ids, scratch);
      }
    }
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string bytes;
    for (const int32_t id : ids) bytes += token_bytes_of(id);
    return valid_utf8(bytes);
  }

  std::string token_bytes(int32_t id, bool) const override { return token_bytes_of(id); }

  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  std::optional<int32_t> eos_id() const override { return eos_; }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::string describe() const override {
    return "byte-level BPE, " + with_commas(vocab_size()) + " tokens (" + name_ + ")";
  }
  std::string path() const override { return name_; }

 private:
  const std::string& token_bytes_of(int32_t id) const {
    PIPEMAT_CHECK(id >= 0 && id < static_cast<int64_t>(token_bytes_.size()), DataError, name_,
                  ": cannot decode token id ", id, ": the tokenizer's ids are 0..",
                  token_bytes_.size() - 1);
    return token_bytes_[static_cast<size_t>(id)];
  }

  void read_model(const Fields& model);
  void read_added_tokens(const Fields& top);
  void read_normalizer(const Fields& top);
  void read_pre_tokenizer(const Fields& top);
  void read_pre_step(const Fields& step, bool last);
  void read_decoder(const Fields& top);

  void encode_normalized(std::string_view piece, std::vector<int32_t>& ids,
                         Scratch& scratch) const {
    if (piece.empty()) return;
    std::string normalized;
    if (nfc_) {
      normalized = unicode::nfc(piece);
      piece = normalized;
    }
    if (normalized_matcher_.empty()) {
      run_step(piece, 0, ids, scratch);
      return;
    }
    normalized_matcher_.split(piece, scratch.normalized_segments);
    for (const Segment& segment : scratch.normalized_segments) {  // run_step leaves them be
      if (segment.token >= 0) {
        ids.push_back(segment.token);
      } else {
        run_step(piece.substr(segment.begin, segment.end - segment.begin), 0, ids, scratch);
      }
    }
  }

  void run_step(std::string_view piece, size_t level, std::vector<int32_t>& ids,
                Scratch& scratch) const {
    if (piece.empty()) return;
    const PreStep& step = steps_[level];
    std::vector<pattern::Span>& matches = scratch.matches[level];
    if (step.byte_level) {
      std::string prefixed;
      if (step.add_prefix_space && piece.front() != ' ') {
        prefixed.reserve(piece.size() + 1);
        prefixed += ' ';
        prefixed += piece;
        piece = prefixed;
      }
      if (!step.regex) {
        word(piece, ids);
        return;
      }
      step.regex->find_all(piece, matches);
      size_t prev = 0;
      for (const auto& [start, end] : matches) {
        if (start > prev) word(piece.substr(prev, start - prev), ids);
        if (end > start) word(piece.substr(start, end - start), ids);
        prev = end;
      }
      if (prev < piece.size()) word(piece.substr(prev), ids);
      return;
    }
    step.regex->find_all(piece, matches);
    std::vector<pattern::Span>& pieces = scratch.pieces[level];
    split_pieces(piece, step, matches, pieces);
    for (const auto& [start, end] : pieces) {
      if (end > start) run_step(piece.substr(start, end - start), level + 1, ids, scratch);
    }
  }

  // The ids of one pre-token (its bytes).
  void word(std::string_view bytes, std::vector<int32_t>& ids) const {
    if (bytes.size() == 1) {
      ids.push_back(byte_id_[static_cast<uint8_t>(bytes[0])]);
      return;
    }
    if (ignore_merges_) {
      if (const auto it = vocab_.find(bytes); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    const bool cached = bytes.size() <= kMaxCachedBytes;
    if (cached && cache_.find(bytes, ids)) return;
    const size_t before = ids.size();
    if (bytes.size() <= kScanLimit) {
      merge_scan(bytes, ids);
    } else {
      merge_heap(bytes, ids);
    }
    if (cached) cache_.put(bytes, ids.data() + before, ids.size() - before);
  }

  static constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();

  void merge_scan(std::string_view bytes, std::vector<int32_t>& ids) const {
    std::array<int32_t, kScanLimit> symbol;
    std::array<int32_t, kScanLimit> rank;
    std::array<int32_t, kScanLimit> merged;
    size_t n = bytes.size();
    for (size_t i = 0; i < n; ++i) symbol[i] = byte_id_[static_cast<uint8_t>(bytes[i])];
    auto pair_at = [&](size_t i) {
      const MergeTable::Merge* m = merges_.find(symbol[i], symbol[i + 1]);
      rank[i] = m != nullptr ? m->rank : kNoRank;
      merged[i] = m != nullptr ? m->id : -1;
    };
    for (size_t i = 0; i + 1 < n; ++i) pair_at(i);
    while (n > 1) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < n; ++i) {
        if (rank[i] < rank[best]) best = i;
      }
      if (rank[best] == kNoRank) break;
      symbol[best] = merged[best];
      for (size_t i = best + 1; i + 1 < n; ++i) symbol[i] = symbol[i + 1];
      for (size_t i = best + 1; i + 2 < n; ++i) {
        rank[i] = rank[i + 1];
        merged[i] = merged[i + 1];
      }
      --n;
      if (best > 0) pair_at(best - 1);
      if (best + 1 < n) pair_at(best);
    }
    ids.insert(ids.end(), symbol.begin(), symbol.begin() + static_cast<std::ptrdiff_t>(n));
  }

  // tokenizers' Word::merge_all: a heap of (rank, position), stale entries skipped.
  void merge_heap(std::string_view bytes, std::vector<int32_t>& ids) const {
    struct Symbol {
      int32_t id;
      int32_t prev;
      int32_t next;
      bool alive;
    };
    struct Candidate {
      int32_t rank;
      int32_t pos;
      int32_t id;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    const auto n = static_cast<int32_t>(bytes.size());
    std::vector<Symbol> symbols(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      symbols[i] = {byte_id_[static_cast<uint8_t>(bytes[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
    }
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    for (int32_t i = 0; i + 1 < n; ++i) {
      if (const MergeTable::Merge* m = merges_.find(symbols[i].id, symbols[i + 1].id)) {
        queue.push({m->rank, i, m->id});
      }
    }
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (!left.alive || left.next < 0) continue;
      Symbol& right = symbols[left.next];
      const MergeTable::Merge* m = merges_.find(left.id, right.id);
      if (m == nullptr || m->id != top.id) continue;  // a stale entry
      left.id = top.id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) symbols[left.next].prev = top.pos;
      if (left.prev >= 0) {
        if (const MergeTable::Merge* p = merges_.find(symbols[left.prev].id, left.id)) {
          queue.push({p->rank, left.prev, p->id});
        }
      }
      if (left.next >= 0) {
        if (const MergeTable::Merge* p = merges_.find(left.id, symbols[left.next].id)) {
          queue.push({p->rank, top.pos, p->id});
        }
      }
    }
    for (const Symbol& s : symbols) {
      if (s.alive) ids.push_back(s.id);
    }
  }

  std::string name_;
  std::vector<std::string> token_bytes_;  // id -> the bytes decode writes
  std::unordered_map<std::string, int32_t, std::hash<std::string>, std::equal_to<>> vocab_names_;
  struct BytesHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  std::unordered_map<std::string, int32_t, BytesHash, std::equal_to<>> vocab_;  // bytes -> id
  std::array<int32_t, 256> byte_id_{};
  MergeTable merges_{0};
  bool ignore_merges_ = false;
  bool nfc_ = false;
  std::vector<PreStep> steps_;
  std::vector<AddedToken> added_;
  AddedMatcher raw_matcher_;
  AddedMatcher normalized_matcher_;
  std::optional<int32_t> eos_;
  std::optional<int32_t> bos_;
  mutable WordCache cache_;
};

ByteLevelBpe::ByteLevelBpe(const Json& top, const std::string& name) : name_(name) {
  const Fields hf(top, name_, "");
  hf.only({"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
           "post_processor", "decoder", "model"},
          "a tokenizer.json");
  if (hf.given("version") &&
      (!hf.at("version").is_string() || hf.at("version").get<std::string>() != "1.0")) {
    hf.fail("version", "is " + shown(hf.at("version")) +
                           "; the tokenizers package reads version \"1.0\" only");
  }
  for (const char* field : {"truncation", "padding"}) {
    if (hf.given(field)) {
      hf.fail(field, "is " + shown(hf.at(field)) +
                         "; expected null (pipemat tokenizes whole documents: a truncation or "
                         "padding would change what encode returns)");
    }
  }
  if (!hf.given("model")) hf.fail("model", "is missing; expected the BPE model");
  read_model(Fields(hf.at("model"), name_, "model"));
  read_added_tokens(hf);
  read_normalizer(hf);
  read_pre_tokenizer(hf);
  read_decoder(hf);
  // The added tokens' two matchers: normalized false in the raw text, normalized true (their
  // content normalized) after the normalizer. Decoded, an added token is its content (normalized
  // where it is matched normalized) read through the byte-level alphabet as the ByteLevel decoder
  // reads any token: tokenizers' decode hands every token to the decoder.
  for (const AddedToken& token : added_) {
    const std::string text = token.normalized && nfc_ ? unicode::nfc(token.content) : token.content;
    if (token.normalized) {
      normalized_matcher_.add(token, text);
    } else {
      raw_matcher_.add(token, text);
    }
    token_bytes_[static_cast<size_t>(token.id)] = bytes_of_token(text).value_or(text);
  }
  if (hf.given("post_processor") && !hf.at("post_processor").is_object()) {
    hf.fail("post_processor", "is " + shown(hf.at("post_processor")) + "; expected an object");
  }
  // The document's ends, by their usual spellings (Note [Text to tokens]).
  auto special = [&](std::initializer_list<std::string_view> names) -> std::optional<int32_t> {
    for (std::string_view n : names) {
      for (const AddedToken& t : added_) {
        if (t.special && t.content == n) return t.id;
      }
    }
    return std::nullopt;
  };
  eos_ = special({"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"});
  bos_ = special({"<|begin_of_text|>", "<s>", "<bos>"});
}

void ByteLevelBpe::read_model(const Fields& model) {
  if (model.type() != "BPE") {
    model.fail("type", "is " + token_text(model.text("type")) +
                           "; pipemat reads byte-level BPE models (\"BPE\") from a tokenizer.json "
                           "(a SentencePiece model is read from its .model file)");
  }
  model.only({"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
              "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"},
             "a BPE model");
  if (model.given("dropout")) {
    const Json& d = model.at("dropout");
    if (!d.is_number() || d.get<double>() != 0.0) {
      model.fail("dropout", "is " + shown(d) +
                                "; expected null (BPE dropout samples other merges at random: "
                                "encode would not be deterministic)");
    }
  }
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.given(field) && model.at(field) != Json("")) {
      model.fail(field, "is " + shown(model.at(field)) +
                            "; expected null (a byte-level BPE has no subword markers)");
    }
  }
  if (model.boolean("byte_fallback", false)) {
    model.fail("byte_fallback",
               "is true; expected false (a byte-level BPE has every byte in its alphabet; "
               "byte fallback is SentencePiece's, read from a .model file)");
  }
  model.boolean("fuse_unk", false);
  ignore_merges_ = model.boolean("ignore_merges", false);
  if (model.given("unk_token") && !model.at("unk_token").is_string()) {
    model.fail("unk_token", "is " + shown(model.at("unk_token")) + "; expected a string or null");
  }

  // The vocab: token -> id, ids 0..N-1.
  const Json& vocab = model.at("vocab");
  if (!vocab.is_object()) model.fail("vocab", "is " + shown(vocab) + "; expected an object");
  const size_t n = vocab.size();
  if (n < 256) {
    model.fail("vocab", "holds " + std::to_string(n) +
                            " tokens; a byte-level BPE holds at least the 256 of its bytes");
  }
  std::vector<const std::string*> names(n, nullptr);
  vocab_names_.reserve(n);
  for (const auto& [token, value] : vocab.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
        value.get<int64_t>() >= static_cast<int64_t>(n) ||
        (value.is_number_unsigned() && value.get<uint64_t>() >= n)) {
      model.fail("vocab", "gives the token " + token_text(token) + " the id " + shown(value) +
                              "; expected the ids 0.." + std::to_string(n - 1) + " of its " +
                              std::to_string(n) + " tokens");
    }
    const auto id = value.get<size_t>();
    if (names[id] != nullptr) {
      model.fail("vocab", "gives the id " + std::to_string(id) + " to both " +
                              token_text(*names[id]) + " and " + token_text(token) +
                              "; expected one token per id");
    }
    const auto [it, inserted] = vocab_names_.emplace(token, static_cast<int32_t>(id));
    names[id] = &it->first;
  }
  // (no id twice among n tokens with ids below n: every id 0..n-1 is there)
  token_bytes_.resize(n);
  vocab_.reserve(n);
  for (size_t id = 0; id < n; ++id) {
    if (std::optional<std::string> bytes = bytes_of_token(*names[id])) {
      vocab_.emplace(*bytes, static_cast<int32_t>(id));
      token_bytes_[id] = std::move(*bytes);
    } else {
      token_bytes_[id] = *names[id];  // the ByteLevel decoder writes such a token as it is
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string c;
    utf8::append(alphabet().char_of_byte[b], c);
    const auto it = vocab_names_.find(c);
    if (it == vocab_names_.end()) {
      model.fail("vocab", "lacks the token " + token_text(c) + " of the byte 0x" +
                              "0123456789abcdef"[b >> 4] + "0123456789abcdef"[b & 15] +
                              "; a byte-level BPE holds all 256 (without it that byte could not "
                              "be encoded)");
    }
    byte_id_[b] = it->second;
  }

  // The merges, in rank order.
  const Json& merges = model.at("merges");
  if (!merges.is_array()) model.fail("merges", "is " + shown(merges) + "; expected an array");
  merges_ = MergeTable(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const Json& m = merges[rank];
    const std::string field = "merges[" + std::to_string(rank) + "]";
    std::string left;
    std::string right;
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        model.fail(field, "is " + shown(m) + "; expected two tokens separated by one space");
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      model.fail(field, "is " + shown(m) + "; expected \"a b\" or [\"a\", \"b\"]");
    }
    auto id_of = [&](const std::string& token) {
      const auto it = vocab_names_.find(token);
      if (it == vocab_names_.end()) {
        model.fail(field, "names " + token_text(token) + ", which is not a token of the vocab");
      }
      return it->second;
    };
    const int32_t a = id_of(left);
    const int32_t b = id_of(right);
    const int32_t merged = id_of(left + right);
    if (!merges_.insert(a, b, {static_cast<int32_t>(rank), merged})) {
      model.fail(field, "merges " + token_text(left) + " and " + token_text(right) +
                            " again; expected each merge once (tokenizers would keep the later "
                            "rank)");
    }
  }
}

void ByteLevelBpe::read_added_tokens(const Fields& top) {
  if (!top.given("added_tokens")) return;
  const Json& list = top.at("added_tokens");
  if (!list.is_array()) top.fail("added_tokens", "is " + shown(list) + "; expected an array");
  const auto model_size = static_cast<int32_t>(token_bytes_.size());
  std::optional<int32_t> max_id;
  std::unordered_map<std::string, size_t> seen;
  added_.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const Fields t(list[i], name_, "added_tokens[" + std::to_string(i) + "]");
    if (!list[i].is_object()) t.fail("", "is " + shown(list[i]) + "; expected an object");
    t.only({"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"},
           "an added token");
    AddedToken token;
    token.content = t.text("content");
    if (token.content.empty()) t.fail("content", "is empty; expected the token's text");
    if (t.boolean("single_word", false)) {
      t.fail("single_word", "is true; pipemat matches added tokens anywhere (expected false)");
    }
    token.lstrip = t.boolean("lstrip", false);
    token.rstrip = t.boolean("rstrip", false);
    token.special = t.boolean("special", false);
    token.normalized = t.boolean("normalized", !token.special);
    if (const auto [it, fresh] = seen.emplace(token.content, i); !fresh) {
      t.fail("content", "is " + token_text(token.content) + ", as added_tokens[" +
                            std::to_string(it->second) + "]'s; expected each token once");
    }
    // The id tokenizers gives it (AddedVocabulary::add_tokens).
    int32_t id = 0;
    if (const auto it = vocab_names_.find(token.content); it != vocab_names_.end()) {
      id = it->second;
    } else {
      id = (max_id && *max_id >= model_size) ? *max_id + 1 : model_size;
    }
    max_id = std::max(max_id.value_or(id), id);
    const Json& given = t.at("id");
    if (!given.is_number_integer() || given.get<int64_t>() != id ||
        (given.is_number_unsigned() && given.get<uint64_t>() != static_cast<uint64_t>(id))) {
      t.fail("id", "is " + shown(given) + " for " + token_text(token.content) +
                       "; the tokenizers package gives it the id " + std::to_string(id) +
                       (id < model_size ? " (its id in the vocab)"
                                        : " (the next id after the vocab and the added tokens "
                                          "before it)") +
                       ", so the file's ids are not the ones it encodes with");
    }
    token.id = id;
    added_.push_back(std::move(token));
  }
  if (max_id && *max_id >= model_size) token_bytes_.resize(static_cast<size_t>(*max_id) + 1);
}

void ByteLevelBpe::read_normalizer(const Fields& top) {
  if (!top.given("normalizer")) return;
  const Fields n(top.at("normalizer"), name_, "normalizer");
  const std::string type = n.type();
  auto refuse = [&](const Fields& f, const std::string& t) {
    f.fail("type", "is " + token_text(t) +
                       "; pipemat reads the normalizers null, NFC and a Sequence of NFC "
                       "(as Qwen2's tokenizer.json has)");
  };
  if (type == "NFC") {
    n.only({"type"}, "the NFC normalizer");
    nfc_ = true;
  } else if (type == "Sequence") {
    n.only({"type", "normalizers"}, "a Sequence normalizer");
    const Json& list = n.at("normalizers");
    if (!list.is_array()) n.fail("normalizers", "is " + shown(list) + "; expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const Fields item(list[i], name_, "normalizer.normalizers[" + std::to_string(i) + "]");
      const std::string t = item.type();
      if (t != "NFC") refuse(item, t);
      item.only({"type"}, "the NFC normalizer");
      nfc_ = true;
    }
  } else {
    refuse(n, type);
  }
}

void ByteLevelBpe::read_pre_step(const Fields& f, bool last) {
  const std::string type = f.type();
  PreStep step;
  if (type == "ByteLevel") {
    f.only({"type", "add_prefix_space", "trim_offsets", "use_regex"},
           "the ByteLevel pre-tokenizer");
    if (!last) {
      f.fail("type",
             "is \"ByteLevel\" before the end of the Sequence; pipemat reads ByteLevel as "
             "the last pre-tokenizer (it writes the bytes in the byte-level alphabet)");
    }
    step.byte_level = true;
    step.add_prefix_space = f.boolean("add_prefix_space", std::nullopt);
    f.boolean("trim_offsets", true);
    if (f.boolean("use_regex", true)) {
      step.regex = pattern::Regex::oniguruma(
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
          name_ + ": the GPT-2 pattern of field '" + f.name("") + "'");
    }
  } else if (type == "Split") {
    f.only({"type", "pattern", "behavior", "invert"}, "the Split pre-tokenizer");
    const Fields p(f.at("pattern"), name_, f.name("pattern"));
    if (!p.object().is_object() || p.object().size() != 1 ||
        !(p.object().contains("Regex") || p.object().contains("String"))) {
      f.fail("pattern", "is " + shown(p.object()) +
                            "; expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    }
    if (p.object().contains("Regex")) {
      step.regex =
          pattern::Regex::oniguruma(p.text("Regex"), name_ + ": field '" + p.name("Regex") + "'");
    } else {
      step.regex =
          pattern::Regex::literal(p.text("String"), name_ + ": field '" + p.name("String") + "'");
    }
    const std::string behavior = f.text("behavior");
    static const std::array<std::pair<std::string_view, Behavior>, 5> kBehaviors = {{
        {"Removed", Behavior::kRemoved},
        {"Isolated", Behavior::kIsolated},
        {"MergedWithPrevious", Behavior::kMergedWithPrevious},
        {"MergedWithNext", Behavior::kMergedWithNext},
        {"Contiguous", Behavior::kContiguous},
    }};
    const auto it = std::find_if(kBehaviors.begin(), kBehaviors.end(),
                                 [&](const auto& b) { return b.first == behavior; });
    if (it == kBehaviors.end()) {
      f.fail("behavior", "is " + token_text(behavior) +
                             "; expected Removed, Isolated, MergedWithPrevious, MergedWithNext or "
                             "Contiguous");
    }
    step.behavior = it->second;
    step.invert = f.boolean("invert", std::nullopt);
  } else if (type == "Digits") {
    f.only({"type", "individual_digits"}, "the Digits pre-tokenizer");
    const bool individual = f.boolean("individual_digits", false);
    step.regex = pattern::Regex::oniguruma("\\p{N}", name_ + ": field '" + f.name("") + "'");
    step.behavior = individual ? Behavior::kIsolated : Behavior::kContiguous;
  } else {
    f.fail("type", "is " + token_text(type) +
                       "; pipemat reads the pre-tokenizers ByteLevel, and Split and Digits "
                       "before a ByteLevel in a Sequence");
  }
  steps_.push_back(std::move(step));
}

void ByteLevelBpe::read_pre_tokenizer(const Fields& top) {
  if (!top.given("pre_tokenizer")) {
    top.fail("pre_tokenizer",
             "is missing or null; a byte-level BPE needs the ByteLevel pre-tokenizer (it writes "
             "the text's bytes in the alphabet of the vocab)");
  }
  const Fields p(top.at("pre_tokenizer"), name_, "pre_tokenizer");
  if (p.type() == "Sequence") {
    p.only({"type", "pretokenizers"}, "a Sequence pre-tokenizer");
    const Json& list = p.at("pretokenizers");
    if (!list.is_array() || list.empty()) {
      p.fail("pretokenizers", "is " + shown(list) + "; expected a non-empty array");
    }
    if (list.size() > Scratch().matches.size()) {
      p.fail("pretokenizers", "holds " + std::to_string(list.size()) +
                                  " pre-tokenizers; pipemat reads up to " +
                                  std::to_string(Scratch().matches.size()));
    }
    for (size_t i = 0; i < list.size(); ++i) {
      read_pre_step(
          Fields(list[i], name_, "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]"),
          i + 1 == list.size());
    }
    if (!steps_.back().byte_level) {
      p.fail("pretokenizers",
             "does not end in a ByteLevel pre-tokenizer; a byte-level BPE needs "
             "it (it writes the text's bytes in the alphabet of the vocab)");
    }
  } else {
    read_pre_step(p, true);
    if (!steps_.back().byte_level) {
      p.fail("", "is a " + p.type() +
                     " pre-tokenizer alone; a byte-level BPE needs ByteLevel (alone, or last in a "
                     "Sequence: it writes the text's bytes in the alphabet of the vocab)");
    }
  }
}

void ByteLevelBpe::read_decoder(const Fields& top) {
  if (!top.given("decoder")) {
    top.fail("decoder", "is missing or null; expected the ByteLevel decoder");
  }
  const Fields d(top.at("decoder"), name_, "decoder");
  const std::string type = d.type();
  if (type != "ByteLevel") {
    d.fail("type", "is " + token_text(type) + "; pipemat reads the ByteLevel decoder");
  }
  d.only({"type", "add_prefix_space", "trim_offsets", "use_regex"}, "the ByteLevel decoder");
  for (const char* field : {"add_prefix_space", "trim_offsets", "use_regex"}) {
    d.boolean(field, true);
  }
}

}  // namespace bpe_impl

std::unique_ptr<Tokenizer> parse_tokenizer_json(std::string_view text, const std::string& name) {
  nlohmann::json top;
  try {
    top = parse_json(text);
  } catch (const JsonError& e) {
    if (e.kind() == JsonError::Kind::kSyntax) {
      PIPEMAT_THROW(DataError, name, ": not valid JSON (", e.what(), ")");
    }
    PIPEMAT_THROW(DataError, name, ": ", e.what());
  }
  PIPEMAT_CHECK(top.is_object(), DataError, name, " is a JSON ", top.type_name(),
                ", not an object (a Hugging Face tokenizer.json)");
  return std::make_unique<bpe_impl::ByteLevelBpe>(top, name);
}

}  // namespace pipemat::data
