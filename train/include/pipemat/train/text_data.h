#pragma once
// The data of the gpt and the llama: a text corpus (any text file, or every text file under a
// directory, split deterministically into train and validation bytes), read as bytes or as the
// ids of a tokenizer, or a Megatron indexed dataset of token ids split by documents; and random
// windows of a split as micro-batches.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/train/options.h"

namespace pipemat::train {

struct TextCorpus {
  std::string train;               // bytes
  std::string validation;          // bytes
  std::vector<std::string> files;  // read, in path order
  int64_t skipped_binary = 0;      // files under a directory skipped as binary (a NUL byte)
};

// Split unit: the corpus (the files concatenated in path order) is cut into blocks of this many
// bytes; block i goes to validation when floor((i + 1) * fraction) > floor(i * fraction), so
// validation is `fraction` of the blocks, spread evenly over the files.
inline constexpr int64_t kSplitBlock = 4096;

struct TextFile {
  std::string path;
  std::string text;
};

// The text files of `path`: the file itself, or every regular file under a directory
// (recursively, in path order; empty files left out, binary ones, those with a NUL byte,
// skipped and counted in `skipped_binary`; a symlink to a file already read is read once), at
// most kMaxInputFileBytes (core/files.h) in all. ConfigError naming `key` (data.path, --input)
// when the path does not exist, a given file is empty or binary, or a directory holds no text.
std::vector<TextFile> read_text_files(const std::string& path, const std::string& key,
                                      int64_t* skipped_binary = nullptr);

// Reads `path` (read_text_files): a text file, or every regular file under a directory
// (recursively, in path order; binary files, those with a NUL byte, are skipped and counted; a
// symlink to a file already read is read once). Splits it with `validation_fraction` in (0, 1).
// ConfigError naming data.path when the path does not exist, a given file is empty or binary, a
// directory holds no text, or a split has fewer than `min_bytes` bytes (a window needs seq_len +
// 1).
TextCorpus load_text(const std::string& path, double validation_fraction, int64_t min_bytes);

// `batch` windows of `seq_len` + 1 bytes at offsets drawn uniformly from a generator seeded
// with (seed, step, micro_batch): ids [batch, seq_len] (int64, the bytes) and targets, the next
// byte of each. The same on every rank and in every run for the same arguments.
std::pair<at::Tensor, at::Tensor> text_windows(const std::string& text, int64_t batch,
                                               int64_t seq_len, uint64_t seed, int64_t step,
                                               int64_t micro_batch);

// One split (train or validation) as a sequence of token ids.
class TokenSplit {
 public:
  virtual ~TokenSplit() = default;
  virtual int64_t size() const = 0;  // tokens
  // Tokens [begin, begin + count) into `out`, as int64.
  virtual void read(int64_t begin, int64_t count, int64_t* out) const = 0;
};

struct TokenData {
  std::shared_ptr<const TokenSplit> train, validation;
  // Validation tokens per byte of the text they encode (the loss per token times it is the loss
  // per byte); 1 for bytes; 0 when unknown (an indexed dataset without a tokenizer).
  double validation_tokens_per_byte = 0;
  std::string summary;  // one line: what was read, its splits, the tokenizer
};

// The data of `data` for a model of `vocab` ids, with windows of `min_tokens` (model.seq_len +
// 1). format text: load_text, then the bytes (no tokenizer) or each split's token ids; indexed:
// data.path's PREFIX.idx / PREFIX.bin (pipemat/data/indexed_dataset.h), document i held out for
// validation by the block rule above (floor((i + 1) * fraction) > floor(i * fraction)), each
// split the concatenation of its documents. ConfigError naming the key: a tokenizer or a
// dataset with an id >= vocab (model.vocab), a split shorter than a window, a file that is not
// what it claims (the DataError's text).
TokenData load_token_data(const DataOptions& data, int64_t vocab, int64_t min_tokens);

// As text_windows, over the tokens of `split`: the same offsets for the same arguments.
std::pair<at::Tensor, at::Tensor> token_windows(const TokenSplit& split, int64_t batch,
                                                int64_t seq_len, uint64_t seed, int64_t step,
                                                int64_t micro_batch);

}  // namespace pipemat::train
