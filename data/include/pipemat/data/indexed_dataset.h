#pragma once
// Megatron indexed datasets: the tokenized corpus format of megatron-core
// (megatron/core/datasets/indexed_dataset.py), a pair of files sharing a prefix:
//
//   PREFIX.idx  the index:  9 bytes of magic "MMIDIDX\0\0", the version (u64, 1), the token
//               dtype's code (u8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//               7 float32, 8 uint16), the sequence count n (u64), the count of document indices
//               d + 1 (u64), the sequence lengths (int32[n], in tokens), the sequence pointers
//               (int64[n], byte offsets into PREFIX.bin), the document indices (int64[d + 1]: the
//               first sequence of each document, then n), all little-endian;
//   PREFIX.bin  the tokens of every sequence, back to back, in the dtype of the index.
//
// A document is a run of sequences (d documents: sequences [indices[k], indices[k + 1])). The
// datasets pipemat reads and writes are those of megatron-core's IndexedDatasetBuilder and
// IndexedDataset for text: integer token ids, no sequence modes (the multimodal variant is
// refused). What is checked before anything is trusted: Note [Indexed dataset checks] in
// data/src/indexed_dataset.cpp; how a dataset is written: Note [Indexed dataset writes] there.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pipemat/core/files.h"
#include "pipemat/data/error.h"

namespace pipemat::data {

// The dtypes of token ids. megatron-core's DType also has float32 and float64, which a .idx may
// name but pipemat refuses: token ids are integers.
enum class TokenDtype { uint8, int8, int16, int32, int64, uint16 };

// "uint8", "int8", "int16", "int32", "int64", "uint16" (numpy's names, as megatron-core's).
const char* to_string(TokenDtype dtype);
// Bytes of one token: 1, 1, 2, 4, 8, 2.
int64_t token_size(TokenDtype dtype);
// megatron-core's DType code: 1, 2, 3, 4, 5, 8.
int megatron_dtype_code(TokenDtype dtype);

// The dtype megatron-core picks for a vocabulary (DType.optimal_dtype, which
// tools/preprocess_data.py calls with the tokenizer's vocab_size): uint16 when vocab_size <
// 65500, else int32. DataError when vocab_size is below 1 or above 2^31 (its ids would not fit
// int32).
TokenDtype dtype_for_vocab(int64_t vocab_size);

// What a .idx holds, checked (Note [Indexed dataset checks]). The pointers and lengths are kept
// as token offsets: after the checks pointer[i] = offset[i] * token_size and length[i] =
// offset[i + 1] - offset[i].
struct IndexedIndex {
  TokenDtype dtype = TokenDtype::int32;
  // sequences + 1 token offsets into the concatenation of all sequences: 0, then the end of
  // each sequence (the last is the dataset's token count).
  std::vector<int64_t> sequence_offsets{0};
  // documents + 1 sequence indices: 0, then the end of each document (the last is the sequence
  // count). Non-decreasing: a document may hold no sequence.
  std::vector<int64_t> document_indices{0};

  int64_t sequences() const { return static_cast<int64_t>(sequence_offsets.size()) - 1; }
  int64_t documents() const { return static_cast<int64_t>(document_indices.size()) - 1; }
  int64_t tokens() const { return sequence_offsets.back(); }
};

// The index held by the .idx bytes `idx`, whose .bin holds `bin_bytes` bytes, checked as
// IndexedDataset::open checks a pair of files (the .bin's size is part of the checks); DataError
// naming `idx_name` (or `bin_name`, for the .bin's size) where it is not valid. Allocates only
// after the counts were checked against idx.size(). For bytes that are not files (a fuzzer's
// input).
IndexedIndex parse_indexed_index(std::string_view idx, int64_t bin_bytes,
                                 const std::string& idx_name, const std::string& bin_name);

// The .idx bytes of `index` as megatron-core's IndexedDatasetBuilder writes them (its
// _IndexWriter). parse_indexed_index of them gives `index` back; InternalError when `index` does
// not hold what IndexedIndex promises.
std::string encode_indexed_index(const IndexedIndex& index);

// A Megatron indexed dataset opened read-only: PREFIX.idx read and checked whole at open,
// PREFIX.bin kept open and read on request with pread (Note [Indexed dataset checks]: why not a
// mapping). Move-only. Every method is safe to call from several threads at once.
class IndexedDataset {
 public:
  // Opens PREFIX.idx and PREFIX.bin (Note [Opening an input file]: a FIFO or a device is refused
  // at once) and checks them; DataError naming the file and what is wrong.
  static IndexedDataset open(const std::string& prefix);

  IndexedDataset(IndexedDataset&&) noexcept;
  IndexedDataset& operator=(IndexedDataset&&) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  ~IndexedDataset();

  const std::string& idx_path() const { return idx_path_; }
  const std::string& bin_path() const { return bin_path_; }
  int64_t sequences() const { return index_.sequences(); }
  int64_t documents() const { return index_.documents(); }
  int64_t tokens() const { return index_.tokens(); }
  TokenDtype dtype() const { return index_.dtype; }

  // The document boundaries: documents() + 1 sequence indices (0, ..., sequences()).
  const std::vector<int64_t>& document_indices() const { return index_.document_indices; }
  // Each sequence's token offset in the concatenation of all sequences: sequences() + 1 offsets
  // (0, ..., tokens()).
  const std::vector<int64_t>& sequence_offsets() const { return index_.sequence_offsets; }
  int64_t sequence_length(int64_t sequence) const;

  // Copies tokens [begin, begin + count) of the concatenation of all sequences into `out`
  // (count values), widened to int64. DataError when the range is not within [0, tokens()), or
  // when PREFIX.bin no longer holds them (it shrank since the open).
  void read_tokens(int64_t begin, int64_t count, int64_t* out) const;
  // The tokens of sequence `sequence`.
  std::vector<int64_t> sequence(int64_t sequence) const;

  // The largest token id of the dataset (a signed dtype may hold negative ids, which
  // validate_vocab refuses), -1 when it holds no token. The first call reads every
  // token once (the same pass as validate_vocab's), later calls return what it found.
  int64_t max_token() const;
  // DataError naming PREFIX.bin, the first token that is negative or not below `vocab_size`, its
  // sequence, document and offset, and the id. Reads every token once per dataset (shared with
  // max_token): linear in the dataset, meant to run once, when the trainer opens it.
  void validate_vocab(int64_t vocab_size) const;

 private:
  struct TokenRange;
  IndexedDataset(std::string idx_path, std::string bin_path, InputFile bin, IndexedIndex index);
  const TokenRange& token_range() const;

  std::string idx_path_;
  std::string bin_path_;
  InputFile bin_;
  IndexedIndex index_;
  std::unique_ptr<TokenRange> range_;  // the smallest and largest id, found on first use
};

// Writes PREFIX.bin and PREFIX.idx as megatron-core's IndexedDatasetBuilder does: the same bytes
// for the same sequences, documents and dtype (Note [Indexed dataset writes]). The files are
// written as PREFIX.bin.tmp and PREFIX.idx.tmp and renamed into place by finish(); a writer
// destroyed (or a process ended) before finish() leaves no PREFIX.bin / PREFIX.idx pair.
// Move-only.
class IndexedDatasetWriter {
 public:
  // DataError when PREFIX.bin or PREFIX.idx exists and `overwrite` is false, or when
  // PREFIX.bin.tmp cannot be created.
  IndexedDatasetWriter(std::string prefix, TokenDtype dtype, bool overwrite = false);
  IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&&) noexcept;
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  // Without finish(): removes the temporaries.
  ~IndexedDatasetWriter();

  // Appends one sequence to the current document. DataError when a token does not fit the
  // dtype (megatron-core's builder would wrap it around in silence) or the sequence holds 2^31
  // tokens or more (the .idx keeps lengths as int32).
  void add_sequence(std::span<const int32_t> tokens);
  // Ends the current document: the sequences added since the last end_document() (none: an
  // empty document, as the builder's).
  void end_document();
  // Writes PREFIX.idx and renames both files into place. DataError when sequences were added
  // after the last end_document() (megatron-core's reader would refuse the pair), when finish()
  // ran before, when the prefix exists now and `overwrite` is false, or when a write fails.
  void finish();

  const std::string& prefix() const { return prefix_; }
  TokenDtype dtype() const { return index_.dtype; }
  int64_t sequences() const { return index_.sequences(); }
  int64_t documents() const { return index_.documents(); }
  int64_t tokens() const { return index_.tokens(); }

 private:
  void discard() noexcept;

  std::string prefix_;
  bool overwrite_ = false;
  bool finished_ = false;
  int bin_fd_ = -1;  // PREFIX.bin.tmp while writing
  IndexedIndex index_;
  std::vector<unsigned char> buffer_;  // tokens not yet written to PREFIX.bin.tmp
};

}  // namespace pipemat::data
