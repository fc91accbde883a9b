#pragma once
// A text corpus for byte-level language models: any text file, or every text file under a
// directory, split deterministically into train and validation bytes, and random windows of it
// as micro-batches.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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

// Reads `path`: a text file, or every regular file under a directory (recursively, in path
// order; binary files, those with a NUL byte, are skipped and counted; a symlink to a file
// already read is read once). Splits it with `validation_fraction` in (0, 1). ConfigError
// naming data.path when the path does not exist, a given file is empty or binary, a directory
// holds no text, or a split has fewer than `min_bytes` bytes (a window needs seq_len + 1).
TextCorpus load_text(const std::string& path, double validation_fraction, int64_t min_bytes);

// `batch` windows of `seq_len` + 1 bytes at offsets drawn uniformly from a generator seeded
// with (seed, step, micro_batch): ids [batch, seq_len] (int64, the bytes) and targets, the next
// byte of each. The same on every rank and in every run for the same arguments.
std::pair<at::Tensor, at::Tensor> text_windows(const std::string& text, int64_t batch,
                                               int64_t seq_len, uint64_t seed, int64_t step,
                                               int64_t micro_batch);

}  // namespace pipemat::train
