// Megatron indexed datasets (pipemat/data/indexed_dataset.h): the checks of a .idx and its .bin,
// the reads of tokens, and the writer.

#include "pipemat/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <mutex>
#include <span>
#include <type_traits>
#include <utility>

#include "pipemat/core/files.h"

namespace pipemat::data {

static_assert(std::endian::native == std::endian::little,
              "Megatron indexed datasets are little-endian; pipemat reads them on little-endian "
              "hosts only");

// Note [Indexed dataset checks]
// A .idx and its .bin come from anywhere (a preprocessing job, a copy, a download), so nothing of
// them is trusted before it is checked, and every refusal is a DataError naming the file and
// what is wrong. megatron-core's own reader asserts the magic and the version and then takes the
// counts as given (numpy.frombuffer of them); pipemat checks, in this order:
//   - the magic MMIDIDX\0\0 (a file that is no .idx is named as such), the 34-byte header, the
//     version 1, a dtype code of megatron-core's DType (1..8), and an integer one: float32 and
//     float64 are refused, token ids are integers;
//   - the counts against the file's size before anything is allocated: n sequences need 12 n
//     bytes of lengths and pointers, d + 1 document indices 8 (d + 1) bytes after them, and the
//     file ends there. Exactly n bytes more are the int8 sequence modes of a multimodal dataset
//     (megatron-core reads them only when told the dataset is multimodal; the .idx does not say):
//     refused by name, pipemat trains on text. At least one document index (the builder always
//     writes the leading 0);
//   - every length non-negative, and the pointers the lengths give: pointer[0] = 0,
//     pointer[i + 1] = pointer[i] + length[i] * token size (what the builder writes; megatron-core
//     reads sequence i at pointer[i], so a pointer off this chain would read another sequence's
//     bytes, or bytes past the file);
//   - the .bin's size equals the sum of the lengths times the token size: a shorter .bin is
//     truncated (a mapped read past its end would be a SIGBUS, a read a short one), a longer one
//     holds bytes no sequence owns (most likely it belongs to another .idx);
//   - the document indices: the first 0, non-decreasing (an empty document repeats one), the
//     last n (megatron-core's IndexedDataset asserts it).
// After these every token range the index gives lies inside the .bin, so reads need no more
// checks than their own bounds. The token ids are not looked at when opening (that is linear in
// the dataset); validate_vocab reads them all, once, and the trainer calls it once when it opens
// a dataset for a model of a known vocabulary.
//
// The .bin is read with pread on the descriptor of the open (Note [Opening an input file]), not
// mapped: a window of a micro-batch is a few hundred tokens, one pread of a few hundred bytes
// from the page cache (microseconds; IndexedDataset.ReadSpeed measures it), and a .bin that
// shrinks while a run reads it (rewritten in place by another job) ends in a DataError naming
// it, where a mapping would end the process with SIGBUS.

// In a namespace of their own: the unity build compiles this file with the other sources of
// the library, whose anonymous namespaces are the same.
namespace mmidx {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

template <class T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void store(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

std::string hex_of(std::string_view bytes) {
  static const char* const kDigits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (i > 0) out += ' ';
    const auto b = static_cast<unsigned char>(bytes[i]);
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

const char* const kDtypeList = "uint8, int8, int16, int32, int64 and uint16";

TokenDtype dtype_of_code(uint8_t code, const std::string& idx_name) {
  switch (code) {
    case 1:
      return TokenDtype::uint8;
    case 2:
      return TokenDtype::int8;
    case 3:
      return TokenDtype::int16;
    case 4:
      return TokenDtype::int32;
    case 5:
      return TokenDtype::int64;
    case 8:
      return TokenDtype::uint16;
    case 6:
    case 7:
      PIPEMAT_THROW(DataError, "indexed dataset: ", idx_name, ": dtype code ", int{code}, " (",
                    code == 6 ? "float64" : "float32", ") holds floats; token ids are integers ",
                    "and pipemat reads ", kDtypeList);
    default:
      PIPEMAT_THROW(DataError, "indexed dataset: ", idx_name, ": unknown dtype code ", int{code},
                    "; megatron-core's codes are 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, ",
                    "6 float64, 7 float32, 8 uint16");
  }
}

// Calls fn(T{}) with T the C++ type of `dtype`.
template <class Fn>
decltype(auto) with_type(TokenDtype dtype, Fn&& fn) {
  switch (dtype) {
    case TokenDtype::uint8:
      return fn(uint8_t{});
    case TokenDtype::int8:
      return fn(int8_t{});
    case TokenDtype::int16:
      return fn(int16_t{});
    case TokenDtype::int32:
      return fn(int32_t{});
    case TokenDtype::int64:
      return fn(int64_t{});
    case TokenDtype::uint16:
      return fn(uint16_t{});
  }
  PIPEMAT_INTERNAL_ASSERT(false, "unknown TokenDtype");
  __builtin_unreachable();
}

// The bytes [offset, offset + bytes) of the .bin into out; DataError when the file holds fewer.
void read_bin(const InputFile& bin, int64_t offset, void* out, int64_t bytes) {
  const int64_t n = bin.read_at(offset, out, bytes);
  if (n == bytes) return;
  PIPEMAT_CHECK(n >= 0, DataError, "indexed dataset: ", bin.path(), ": reading ", bytes,
                " bytes at byte ", offset, " failed (", std::strerror(errno), ")");
  PIPEMAT_THROW(DataError, "indexed dataset: ", bin.path(), ": read ", n, " of ", bytes,
                " bytes at byte ", offset, "; the file shrank since it was opened (was it ",
                "rewritten while this run reads it?)");
}

// Reads tokens [begin, begin + count) of type T, chunk by chunk, handing each chunk (a span of
// T) and the token index of its first element to fn; fn returns false to stop.
template <class T, class Fn>
void for_each_chunk(const InputFile& bin, int64_t begin, int64_t count, int64_t chunk_tokens,
                    T* buffer, Fn&& fn) {
  for (int64_t at = begin; at < begin + count;) {
    const int64_t n = std::min(chunk_tokens, begin + count - at);
    read_bin(bin, at * static_cast<int64_t>(sizeof(T)), buffer,
             n * static_cast<int64_t>(sizeof(T)));
    if (!fn(std::span<const T>(buffer, static_cast<size_t>(n)), at)) return;
    at += n;
  }
}

}  // namespace
}  // namespace mmidx

const char* to_string(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::uint8:
      return "uint8";
    case TokenDtype::int8:
      return "int8";
    case TokenDtype::int16:
      return "int16";
    case TokenDtype::int32:
      return "int32";
    case TokenDtype::int64:
      return "int64";
    case TokenDtype::uint16:
      return "uint16";
  }
  return "?";
}

int64_t token_size(TokenDtype dtype) {
  return mmidx::with_type(dtype, [](auto t) { return static_cast<int64_t>(sizeof(t)); });
}

int megatron_dtype_code(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::uint8:
      return 1;
    case TokenDtype::int8:
      return 2;
    case TokenDtype::int16:
      return 3;
    case TokenDtype::int32:
      return 4;
    case TokenDtype::int64:
      return 5;
    case TokenDtype::uint16:
      return 8;
  }
  return 0;
}

TokenDtype dtype_for_vocab(int64_t vocab_size) {
  PIPEMAT_CHECK(vocab_size >= 1, DataError, "indexed dataset: vocab_size ", vocab_size,
                " is below 1");
  PIPEMAT_CHECK(vocab_size <= (int64_t{1} << 31), DataError, "indexed dataset: vocab_size ",
                vocab_size,
                " is above 2^31: its ids do not fit int32, the widest dtype "
                "megatron-core picks for a vocabulary");
  return vocab_size < 65500 ? TokenDtype::uint16 : TokenDtype::int32;
}

IndexedIndex parse_indexed_index(std::string_view idx, int64_t bin_bytes,
                                 const std::string& idx_name, const std::string& bin_name) {
  const auto size = static_cast<int64_t>(idx.size());
  const std::string where = "indexed dataset: " + idx_name + ": ";
  PIPEMAT_CHECK(size >= 9 && idx.substr(0, 9) == std::string_view(mmidx::kMagic, 9), DataError,
                where, "does not start with the magic MMIDIDX\\0\\0 of a Megatron .idx (found ",
                size == 0 ? std::string("an empty file") : mmidx::hex_of(idx.substr(0, 9)),
                "); not a Megatron indexed dataset index");
  PIPEMAT_CHECK(size >= mmidx::kHeaderBytes, DataError, where, size,
                " bytes, too short for the 34-byte header of a Megatron .idx (magic, version, "
                "dtype code, sequence and document counts); the file is truncated");
  const char* p = idx.data();
  const auto version = mmidx::load<uint64_t>(p + 9);
  PIPEMAT_CHECK(version == 1, DataError, where, "version ", version,
                "; pipemat reads version 1, the one megatron-core writes");
  IndexedIndex index;
  index.dtype = mmidx::dtype_of_code(static_cast<uint8_t>(p[17]), idx_name);
  const int64_t item = token_size(index.dtype);
  const auto n_raw = mmidx::load<uint64_t>(p + 18);
  const auto d_raw = mmidx::load<uint64_t>(p + 26);

  // The counts against the file's size, before anything is allocated.
  const auto rest = static_cast<uint64_t>(size - mmidx::kHeaderBytes);
  PIPEMAT_CHECK(n_raw <= rest / 12, DataError, where, "sequence count ", n_raw,
                " needs 12 bytes each of lengths and pointers but the file holds only ", rest,
                " bytes after its header; the count is wrong or the file is truncated");
  const auto n = static_cast<int64_t>(n_raw);
  const uint64_t after_sequences = rest - 12 * n_raw;
  PIPEMAT_CHECK(d_raw >= 1, DataError, where,
                "document count 0; a .idx holds documents + 1 document indices (at least the "
                "leading 0 that megatron-core's builder writes)");
  PIPEMAT_CHECK(d_raw <= after_sequences / 8, DataError, where, "document count ", d_raw,
                " needs 8 bytes each of document indices but the file holds only ", after_sequences,
                " bytes after the ", n,
                " sequences' lengths and pointers; the count is wrong or the file is truncated");
  const uint64_t extra = after_sequences - 8 * d_raw;
  PIPEMAT_CHECK(extra == 0 || extra != n_raw, DataError, where, "holds ", extra,
                " bytes after the document indices, one per sequence: the sequence modes of a "
                "multimodal dataset, which pipemat does not read (it reads text tokens)");
  PIPEMAT_CHECK(extra == 0, DataError, where, "holds ", extra,
                " bytes after the document indices, where the file should end (", n, " sequences, ",
                d_raw, " document indices)");
  const auto d = static_cast<int64_t>(d_raw);

  const char* lengths = p + mmidx::kHeaderBytes;
  const char* pointers = lengths + 4 * n;
  const char* documents = pointers + 8 * n;
  index.sequence_offsets.assign(static_cast<size_t>(n) + 1, 0);
  int64_t at = 0;  // in tokens
  for (int64_t i = 0; i < n; ++i) {
    const auto length = mmidx::load<int32_t>(lengths + 4 * i);
    PIPEMAT_CHECK(length >= 0, DataError, where, "sequence ", i, " has length ", length,
                  "; lengths are token counts");
    const auto pointer = mmidx::load<int64_t>(pointers + 8 * i);
    // at * item cannot overflow: at + length stays below 2^63 / 8 (checked below).
    PIPEMAT_CHECK(pointer == at * item, DataError, where, "sequence ", i, " points at byte ",
                  pointer, " but the sequences before it end at byte ", at * item,
                  i == 0 ? std::string(" (the first sequence starts at 0)")
                         : " (pointer " + std::to_string(i - 1) + " + length " +
                               std::to_string(i - 1) + " x " + std::to_string(item) + ")",
                  "; the pointers do not match the lengths");
    at += length;
    PIPEMAT_CHECK(at <= std::numeric_limits<int64_t>::max() / 8, DataError, where, "the first ",
                  i + 1, " sequences hold ", at, " tokens, more than any file holds");
    index.sequence_offsets[static_cast<size_t>(i) + 1] = at;
  }
  PIPEMAT_CHECK(at * item == bin_bytes, DataError, "indexed dataset: ", bin_name, ": holds ",
                bin_bytes, " bytes but ", idx_name, " gives its ", n, " sequences ", at,
                " tokens of ", to_string(index.dtype), ", ", at * item, " bytes; ",
                bin_bytes < at * item ? "the .bin is truncated"
                                      : "bytes after the last sequence belong to none",
                " (or the two files are not one dataset)");

  index.document_indices.assign(static_cast<size_t>(d), 0);
  for (int64_t k = 0; k < d; ++k) {
    const auto v = mmidx::load<int64_t>(documents + 8 * k);
    if (k == 0) {
      PIPEMAT_CHECK(v == 0, DataError, where, "the first document index is ", v,
                    "; documents start at sequence 0");
    } else {
      const int64_t before = index.document_indices[static_cast<size_t>(k) - 1];
      PIPEMAT_CHECK(v >= before, DataError, where, "document index ", k, " is ", v,
                    ", below document index ", k - 1, " (", before,
                    "); document indices are non-decreasing");
      PIPEMAT_CHECK(v <= n, DataError, where, "document index ", k, " is ", v,
                    ", past the sequence count ", n);
    }
    index.document_indices[static_cast<size_t>(k)] = v;
  }
  PIPEMAT_CHECK(index.document_indices.back() == n, DataError, where, "the last document index is ",
                index.document_indices.back(), " but there are ", n,
                " sequences; the sequences after it belong to no document");
  return index;
}

std::string encode_indexed_index(const IndexedIndex& index) {
  const int64_t n = index.sequences();
  const int64_t d = static_cast<int64_t>(index.document_indices.size());
  PIPEMAT_INTERNAL_ASSERT(n >= 0 && d >= 1 && index.sequence_offsets.front() == 0 &&
                              index.document_indices.front() == 0 &&
                              index.document_indices.back() == n,
                          "an IndexedIndex that does not hold what it promises");
  const int64_t item = token_size(index.dtype);
  std::string out;
  out.reserve(static_cast<size_t>(mmidx::kHeaderBytes + 12 * n + 8 * d));
  out.append(mmidx::kMagic, 9);
  mmidx::store<uint64_t>(out, 1);
  mmidx::store<uint8_t>(out, static_cast<uint8_t>(megatron_dtype_code(index.dtype)));
  mmidx::store<uint64_t>(out, static_cast<uint64_t>(n));
  mmidx::store<uint64_t>(out, static_cast<uint64_t>(d));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t length = index.sequence_offsets[static_cast<size_t>(i) + 1] -
                           index.sequence_offsets[static_cast<size_t>(i)];
    PIPEMAT_INTERNAL_ASSERT(length >= 0 && length <= std::numeric_limits<int32_t>::max(),
                            "sequence length ", length);
    mmidx::store<int32_t>(out, static_cast<int32_t>(length));
  }
  for (int64_t i = 0; i < n; ++i) {
    mmidx::store<int64_t>(out, index.sequence_offsets[static_cast<size_t>(i)] * item);
  }
  for (const int64_t v : index.document_indices) mmidx::store<int64_t>(out, v);
  return out;
}

// ---- IndexedDataset ----

struct IndexedDataset::TokenRange {
  std::once_flag once;
  int64_t min = 0;
  int64_t max = -1;
};

IndexedDataset::IndexedDataset(std::string idx_path, std::string bin_path, InputFile bin,
                               IndexedIndex index)
    : idx_path_(std::move(idx_path)),
      bin_path_(std::move(bin_path)),
      bin_(std::move(bin)),
      index_(std::move(index)),
      range_(std::make_unique<TokenRange>()) {}

IndexedDataset::IndexedDataset(IndexedDataset&&) noexcept = default;
IndexedDataset& IndexedDataset::operator=(IndexedDataset&&) noexcept = default;
IndexedDataset::~IndexedDataset() = default;

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  std::string idx_path = prefix + ".idx";
  std::string bin_path = prefix + ".bin";
  // Both opened (and a FIFO or a device refused) before either is read.
  const InputFile idx = open_input_file<DataError>(idx_path, "indexed dataset");
  InputFile bin = open_input_file<DataError>(bin_path, "indexed dataset");
  std::string problem;
  const std::string bytes = read_whole(idx, problem);
  PIPEMAT_CHECK(problem.empty(), DataError, "indexed dataset: ", problem);
  IndexedIndex index = parse_indexed_index(bytes, bin.size(), idx_path, bin_path);
  return IndexedDataset(std::move(idx_path), std::move(bin_path), std::move(bin), std::move(index));
}

int64_t IndexedDataset::sequence_length(int64_t sequence) const {
  PIPEMAT_CHECK(sequence >= 0 && sequence < sequences(), DataError, "indexed dataset: ", idx_path_,
                ": no sequence ", sequence, "; it holds ", sequences());
  const auto i = static_cast<size_t>(sequence);
  return index_.sequence_offsets[i + 1] - index_.sequence_offsets[i];
}

void IndexedDataset::read_tokens(int64_t begin, int64_t count, int64_t* out) const {
  PIPEMAT_CHECK(begin >= 0 && count >= 0 && begin <= tokens() && count <= tokens() - begin,
                DataError, "indexed dataset: ", bin_path_, ": cannot read ", count,
                " tokens from token ", begin, "; it holds tokens [0, ", tokens(), ")");
  if (count == 0) return;
  mmidx::with_type(index_.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, int64_t>) {
      mmidx::read_bin(bin_, begin * 8, out, count * 8);
    } else {
      constexpr int64_t kChunk = 8192;
      std::array<T, kChunk> buffer;
      mmidx::for_each_chunk<T>(bin_, begin, count, kChunk, buffer.data(),
                               [&](std::span<const T> chunk, int64_t at) {
                                 int64_t* to = out + (at - begin);
                                 for (size_t i = 0; i < chunk.size(); ++i) to[i] = chunk[i];
                                 return true;
                               });
    }
  });
}

std::vector<int64_t> IndexedDataset::sequence(int64_t sequence) const {
  std::vector<int64_t> out(static_cast<size_t>(sequence_length(sequence)));
  read_tokens(index_.sequence_offsets[static_cast<size_t>(sequence)],
              static_cast<int64_t>(out.size()), out.data());
  return out;
}

namespace mmidx {
namespace {

constexpr int64_t kScanBytes = int64_t{1} << 20;

// The smallest and largest of `chunk` folded into lo and hi. In lanes of 64 bytes so that GCC
// vectorizes the loop at -O2 (a plain min/max loop of unknown length it vectorizes only at -O3).
template <class T>
void fold_range(std::span<const T> chunk, T& lo, T& hi) {
  constexpr size_t kLanes = 64 / sizeof(T);
  T a[kLanes];
  T b[kLanes];
  for (size_t j = 0; j < kLanes; ++j) {
    a[j] = lo;
    b[j] = hi;
  }
  const T* p = chunk.data();
  size_t i = 0;
  for (; i + kLanes <= chunk.size(); i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) {
      a[j] = p[i + j] < a[j] ? p[i + j] : a[j];
      b[j] = p[i + j] > b[j] ? p[i + j] : b[j];
    }
  }
  T x = lo;
  T y = hi;
  for (size_t j = 0; j < kLanes; ++j) {
    x = a[j] < x ? a[j] : x;
    y = b[j] > y ? b[j] : y;
  }
  for (; i < chunk.size(); ++i) {
    x = p[i] < x ? p[i] : x;
    y = p[i] > y ? p[i] : y;
  }
  lo = x;
  hi = y;
}

}  // namespace
}  // namespace mmidx

const IndexedDataset::TokenRange& IndexedDataset::token_range() const {
  std::call_once(range_->once, [&] {
    if (tokens() == 0) return;
    mmidx::with_type(index_.dtype, [&](auto t) {
      using T = decltype(t);
      std::vector<T> buffer(static_cast<size_t>(mmidx::kScanBytes) / sizeof(T));
      T lo = std::numeric_limits<T>::max();
      T hi = std::numeric_limits<T>::min();
      mmidx::for_each_chunk<T>(bin_, 0, tokens(), static_cast<int64_t>(buffer.size()),
                               buffer.data(), [&](std::span<const T> chunk, int64_t) {
                                 mmidx::fold_range(chunk, lo, hi);
                                 return true;
                               });
      range_->min = lo;
      range_->max = hi;
    });
  });
  return *range_;
}

int64_t IndexedDataset::max_token() const { return token_range().max; }

void IndexedDataset::validate_vocab(int64_t vocab_size) const {
  PIPEMAT_CHECK(vocab_size >= 1, DataError, "indexed dataset: ", bin_path_, ": vocabulary size ",
                vocab_size, " is below 1");
  const TokenRange& range = token_range();
  if (tokens() == 0 || (range.min >= 0 && range.max < vocab_size)) return;
  // Some id is outside [0, vocab_size): find the first, to name it.
  int64_t found = -1;
  int64_t id = 0;
  mmidx::with_type(index_.dtype, [&](auto t) {
    using T = decltype(t);
    std::vector<T> buffer(static_cast<size_t>(mmidx::kScanBytes) / sizeof(T));
    mmidx::for_each_chunk<T>(bin_, 0, tokens(), static_cast<int64_t>(buffer.size()), buffer.data(),
                             [&](std::span<const T> chunk, int64_t at) {
                               for (size_t i = 0; i < chunk.size(); ++i) {
                                 const auto v = static_cast<int64_t>(chunk[i]);
                                 if (v < 0 || v >= vocab_size) {
                                   found = at + static_cast<int64_t>(i);
                                   id = v;
                                   return false;
                                 }
                               }
                               return true;
                             });
  });
  PIPEMAT_INTERNAL_ASSERT(found >= 0, "the second read found no token outside the vocabulary");
  const auto& offsets = index_.sequence_offsets;
  // The sequence holding token `found`: the last offset <= found whose sequence is not empty.
  const auto s = static_cast<int64_t>(std::upper_bound(offsets.begin(), offsets.end(), found) -
                                      offsets.begin() - 1);
  const auto& docs = index_.document_indices;
  const auto doc =
      static_cast<int64_t>(std::upper_bound(docs.begin(), docs.end(), s) - docs.begin() - 1);
  PIPEMAT_THROW(DataError, "indexed dataset: ", bin_path_, ": token id ", id, " at sequence ", s,
                " (document ", doc, "), offset ", found - offsets[static_cast<size_t>(s)],
                " (token ", found, " of the dataset) ",
                id < 0 ? std::string("is negative")
                       : "is not below the vocabulary size " + std::to_string(vocab_size),
                "; the dataset was tokenized for another vocabulary (ids of this one are in [",
                range.min, ", ", range.max, "])");
}

// ---- IndexedDatasetWriter ----

// Note [Indexed dataset writes]
// IndexedDatasetWriter writes what megatron-core's IndexedDatasetBuilder writes for the same
// add_item / end_document calls and dtype, byte for byte (IndexedDatasetOracle.*
// compares the files): the tokens in the dtype, back to back, in PREFIX.bin; the .idx of
// encode_indexed_index (the builder's _IndexWriter: header, int32 lengths, int64 byte pointers,
// int64 document indices with the leading 0). It is stricter than the builder in two places,
// both where the builder would write a dataset that is wrong without saying so: a token that
// does not fit the dtype is refused (numpy's cast would wrap 70000 to 4464 in uint16), and
// finish() refuses sequences after the last end_document() (megatron-core's reader asserts that
// the last document index is the sequence count).
//
// A run that dies while writing must not leave something that reads as a dataset. The tokens go
// to PREFIX.bin.tmp as they come (the writer keeps only 8 bytes per sequence and per document);
// finish() writes PREFIX.idx.tmp, syncs both, and only then renames them into place: first
// removes an old PREFIX.idx (overwrite), then renames the .bin, then the .idx, then syncs the
// directory. At every instant the prefix is the old pair, a .bin without a .idx, or the new pair:
// never a new .bin beside an old .idx, which the size check of Note [Indexed dataset checks]
// could miss when the two happened to agree. A writer destroyed before finish() removes its
// temporaries; a killed process leaves only *.tmp files, which the next writer replaces.

namespace mmidx {
namespace {

constexpr size_t kWriteBuffer = size_t{1} << 20;

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

void check_absent(const std::string& prefix) {
  for (const char* ext : {".bin", ".idx"}) {
    const std::string path = prefix + ext;
    PIPEMAT_CHECK(!exists(path), DataError, "indexed dataset: ", path,
                  " exists; pass overwrite to replace the dataset ", prefix,
                  " (or write it to another prefix)");
  }
}

// Writes all of [data, data + bytes) to fd; DataError naming `path` when it cannot.
void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const int error = write_fully(fd, data, bytes);
  PIPEMAT_CHECK(error == 0, DataError, "indexed dataset: writing ", path, " failed (",
                std::strerror(error), ")");
}

void sync_and_close(int fd, const std::string& path) {
  const int synced = ::fsync(fd);
  const int error = errno;
  const int closed = ::close(fd);
  PIPEMAT_CHECK(synced == 0 && closed == 0, DataError, "indexed dataset: writing ", path,
                " failed (", std::strerror(synced != 0 ? error : errno), ")");
}

int create_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  PIPEMAT_CHECK(fd >= 0, DataError, "indexed dataset: cannot create ", path, " (",
                std::strerror(errno), ")");
  return fd;
}

void rename_into_place(const std::string& from, const std::string& to) {
  PIPEMAT_CHECK(std::rename(from.c_str(), to.c_str()) == 0, DataError,
                "indexed dataset: cannot rename ", from, " to ", to, " (", std::strerror(errno),
                ")");
}

void sync_directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // the files are in place; only their durability is not forced
  ::fsync(fd);
  ::close(fd);
}

template <class T>
void append_tokens(std::span<const int32_t> tokens, std::vector<unsigned char>& out,
                   TokenDtype dtype, int64_t sequence) {
  constexpr int64_t lo = std::numeric_limits<T>::min();
  constexpr int64_t hi = std::numeric_limits<T>::max();
  const size_t start = out.size();
  out.resize(start + tokens.size() * sizeof(T));
  unsigned char* to = out.data() + start;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t v = tokens[i];
    if (v < lo || v > hi) {
      out.resize(start);
      PIPEMAT_THROW(DataError, "indexed dataset: token ", v, " (sequence ", sequence, ", offset ",
                    i, ") does not fit ", to_string(dtype), " [", lo, ", ", hi,
                    "]; write the dataset with a wider dtype (dtype_for_vocab)");
    }
    const auto narrow = static_cast<T>(v);
    std::memcpy(to + i * sizeof(T), &narrow, sizeof(T));
  }
}

}  // namespace
}  // namespace mmidx

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDtype dtype, bool overwrite)
    : prefix_(std::move(prefix)), overwrite_(overwrite) {
  index_.dtype = dtype;
  if (!overwrite_) mmidx::check_absent(prefix_);
  bin_fd_ = mmidx::create_file(prefix_ + ".bin.tmp");
  buffer_.reserve(mmidx::kWriteBuffer);
}

IndexedDatasetWriter::IndexedDatasetWriter(IndexedDatasetWriter&& other) noexcept
    : prefix_(std::move(other.prefix_)),
      overwrite_(other.overwrite_),
      finished_(other.finished_),
      bin_fd_(std::exchange(other.bin_fd_, -1)),
      index_(std::move(other.index_)),
      buffer_(std::move(other.buffer_)) {
  other.finished_ = true;
}

IndexedDatasetWriter& IndexedDatasetWriter::operator=(IndexedDatasetWriter&& other) noexcept {
  if (this != &other) {
    discard();
    prefix_ = std::move(other.prefix_);
    overwrite_ = other.overwrite_;
    finished_ = std::exchange(other.finished_, true);
    bin_fd_ = std::exchange(other.bin_fd_, -1);
    index_ = std::move(other.index_);
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

IndexedDatasetWriter::~IndexedDatasetWriter() { discard(); }

void IndexedDatasetWriter::discard() noexcept {
  if (bin_fd_ >= 0) {
    ::close(bin_fd_);
    bin_fd_ = -1;
  }
  if (!finished_) {
    ::unlink((prefix_ + ".bin.tmp").c_str());
    ::unlink((prefix_ + ".idx.tmp").c_str());
    finished_ = true;
  }
}

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> ids) {
  PIPEMAT_CHECK(!finished_ && bin_fd_ >= 0, DataError, "indexed dataset: ", prefix_,
                ": add_sequence after finish()");
  PIPEMAT_CHECK(ids.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), DataError,
                "indexed dataset: ", prefix_, ": sequence ", sequences(), " holds ", ids.size(),
                " tokens; a .idx keeps lengths as int32 (split it)");
  mmidx::with_type(index_.dtype, [&](auto t) {
    mmidx::append_tokens<decltype(t)>(ids, buffer_, index_.dtype, sequences());
  });
  index_.sequence_offsets.push_back(tokens() + static_cast<int64_t>(ids.size()));
  if (buffer_.size() >= mmidx::kWriteBuffer) {
    mmidx::write_all(bin_fd_, buffer_.data(), buffer_.size(), prefix_ + ".bin.tmp");
    buffer_.clear();
  }
}

void IndexedDatasetWriter::end_document() {
  PIPEMAT_CHECK(!finished_, DataError, "indexed dataset: ", prefix_,
                ": end_document after finish()");
  index_.document_indices.push_back(sequences());
}

void IndexedDatasetWriter::finish() {
  PIPEMAT_CHECK(!finished_ && bin_fd_ >= 0, DataError, "indexed dataset: ", prefix_,
                ": finish() ran before");
  PIPEMAT_CHECK(index_.document_indices.back() == sequences(), DataError,
                "indexed dataset: ", prefix_, ": sequences ", index_.document_indices.back(),
                " to ", sequences() - 1,
                " were added after the last end_document(); end their document first");
  const std::string bin_tmp = prefix_ + ".bin.tmp";
  const std::string idx_tmp = prefix_ + ".idx.tmp";
  mmidx::write_all(bin_fd_, buffer_.data(), buffer_.size(), bin_tmp);
  buffer_.clear();
  const int bin_fd = std::exchange(bin_fd_, -1);
  mmidx::sync_and_close(bin_fd, bin_tmp);
  const std::string idx = encode_indexed_index(index_);
  const int idx_fd = mmidx::create_file(idx_tmp);
  try {
    mmidx::write_all(idx_fd, idx.data(), idx.size(), idx_tmp);
  } catch (...) {
    ::close(idx_fd);
    throw;
  }
  mmidx::sync_and_close(idx_fd, idx_tmp);
  if (!overwrite_) mmidx::check_absent(prefix_);
  const std::string idx_path = prefix_ + ".idx";
  PIPEMAT_CHECK(::unlink(idx_path.c_str()) == 0 || errno == ENOENT, DataError,
                "indexed dataset: cannot replace ", idx_path, " (", std::strerror(errno), ")");
  mmidx::rename_into_place(bin_tmp, prefix_ + ".bin");
  mmidx::rename_into_place(idx_tmp, idx_path);
  finished_ = true;
  mmidx::sync_directory_of(idx_path);
}

}  // namespace pipemat::data
