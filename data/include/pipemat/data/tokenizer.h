#pragma once
// Text to token ids and back, without LibTorch: a Hugging Face tokenizer.json of a byte-level BPE
// (GPT-2, Llama 3, SmolLM, Qwen2 and what the tokenizers package trains like them) and a
// SentencePiece .model (through the SentencePiece library).
//
// Note [Text to tokens]
// A tokenizer here gives the ids the reference implementation gives, token for token: the
// Python tokenizers package's Tokenizer.from_file(path).encode(text, add_special_tokens=False)
// for a tokenizer.json, the sentencepiece package's SentencePieceProcessor(model_file=path)
// .encode(text) for a .model. A file for which pipemat could not promise that is refused when it
// is loaded, with a DataError naming the file and the field (Note [tokenizer.json as the
// tokenizers package reads it], Note [SentencePiece models] in data/src/).
//
//   - Text is bytes. Bytes that are not UTF-8 are read as Python's
//     bytes.decode("utf-8", "replace") reads them: each maximal subpart of an ill-formed
//     sequence (Unicode 3.9, table 3-8: a lead byte and the continuation bytes that may follow
//     it, up to the first that may not) becomes one U+FFFD, and the text is then encoded. So
//     encode(b) equals the reference's ids of b.decode("utf-8", "replace"): nothing is dropped or
//     refused, a stray 0xFF is the ids of U+FFFD, a character cut at the end of a document is one
//     U+FFFD. NUL and every other byte below 0x80 is text like any other.
//   - encode adds no special token: no BOS, no EOS (a post-processor's template, which
//     tokenizers applies with add_special_tokens=True, is not read; SentencePiece's Encode adds
//     none either, not even for a model with a BOS piece, as Llama's: a caller that wants <s>
//     writes bos_id() itself). Special tokens written in the text ("<|endoftext|>") are matched
//     as the reference matches them and become their ids, as the reference does by default.
//   - decode is the reference's decode with the special tokens kept (transformers'
//     skip_special_tokens=False; the tokenizers package skips them by default): the bytes of the
//     tokens (a tokenizer.json's added tokens read through the byte-level alphabet too, as its
//     ByteLevel decoder reads them), made valid UTF-8 as above. An id outside [0, vocab_size())
//     is a DataError.
//   - Every id encode returns is below vocab_size(), which counts the added tokens; the ids of a
//     tokenizer.json are 0..vocab_size()-1 without holes.
//   - eos_id() and bos_id() are the tokens that end and begin a document. A SentencePiece
//     model's </s> and <s> where they are control pieces. A tokenizer.json names no roles, so
//     they are the special added tokens spelled as the usual ones, in this order: "<|endoftext|>",
//     "<|end_of_text|>", "</s>", "<eos>" for the end, "<|begin_of_text|>", "<s>", "<bos>" for the
//     beginning (a chat model's end of turn, "<|im_end|>" or "<|eot_id|>", ends no document);
//     tokenizer_config.json is not read.
//   - A loaded tokenizer is immutable and thread-safe: encode from any number of threads.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pipemat/data/error.h"

namespace pipemat::data {

// A loaded tokenizer (Note [Text to tokens]). Immutable and thread-safe.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text` (bytes; invalid UTF-8 as Note [Text to tokens] says), without the special
  // tokens a post-processor would add (transformers' add_special_tokens=False).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The text of `ids`, special tokens included; DataError on an id < 0 or >= vocab_size().
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // Every id encode returns is below it (added tokens included).
  virtual int64_t vocab_size() const = 0;
  // The token that ends a document (Note [Text to tokens]), if the tokenizer has one.
  virtual std::optional<int32_t> eos_id() const = 0;
  // The token that begins a document, if the tokenizer has one.
  virtual std::optional<int32_t> bos_id() const = 0;
  // "byte-level BPE, 49,152 tokens (path/tokenizer.json)".
  virtual std::string describe() const = 0;
  // The file it was loaded from (the name given to parse_tokenizer_json).
  virtual std::string path() const = 0;
  // The bytes decode writes for `id` where the text decoded so far is empty (`at_start`) or not
  // (SentencePiece drops the space that begins the first piece), before the text is made valid
  // UTF-8; for StreamDecoder. DataError on an id outside [0, vocab_size()).
  virtual std::string token_bytes(int32_t id, bool at_start) const = 0;
};

// A tokenizer.json (Hugging Face, byte-level BPE), a SentencePiece .model, or a directory holding
// one of them (tokenizer.json preferred, else tokenizer.model). The file's content decides its
// kind: text that begins with '{' or '[' is read as a tokenizer.json, anything else as a
// SentencePiece model. DataError naming the path when it is none of them or not what it claims.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// The tokenizer.json whose text is `text`; DataError naming `name` (used as path() too) where
// it is not valid or uses what is not supported. For text that is not a file (a fuzzer's input).
std::unique_ptr<Tokenizer> parse_tokenizer_json(std::string_view text, const std::string& name);

// `bytes` with each maximal subpart of an ill-formed UTF-8 sequence replaced by U+FFFD (Python's
// bytes.decode("utf-8", "replace"), Rust's String::from_utf8_lossy): Note [Text to tokens].
std::string valid_utf8(std::string_view bytes);

// Decodes ids one at a time and returns only complete UTF-8: a multi-byte character split across
// tokens comes out whole once its last byte arrives. What push returns, followed by what finish
// returns, is decode(all the ids) for a tokenizer.json; for a SentencePiece model as well where
// the bytes of the ids are UTF-8 (where byte pieces make ill-formed UTF-8, SentencePiece writes one
// U+FFFD per byte, StreamDecoder one per maximal subpart).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer);

  // The complete characters `id` completes (maybe none, maybe several); ill-formed bytes that no
  // later byte can complete come out as U+FFFD. DataError on an id outside [0, vocab_size()).
  std::string push(int32_t id);
  // What is left: an incomplete character at the end as U+FFFD. The decoder then starts afresh.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;  // the bytes of a character that is not complete yet
  bool at_start_ = true;
};

}  // namespace pipemat::data
