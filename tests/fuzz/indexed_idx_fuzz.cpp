// Fuzz target: a Megatron .idx's bytes and the size of its .bin (data::parse_indexed_index, what
// IndexedDataset::open checks; Note [Indexed dataset checks] in data/src/indexed_dataset.cpp and
// Note [Fuzz targets] in tests/fuzz/CMakeLists.txt).
//
// The input's first byte chooses the .bin's size:
//   even: the next 8 bytes are the .bin's size (little-endian), the rest is the .idx;
//   odd:  the rest is the .idx, and the .bin's size is the one its last pointer and length give
//         (0 without sequences), so mutations of the .idx reach the checks after the size's.
// Bad input must end in a DataError. What the parser accepts must be what it promises: offsets
// from 0, non-decreasing, each sequence below 2^31 tokens, covering the .bin exactly; document
// indices from 0, non-decreasing, ending at the sequence count; and encoded again, the index is
// the input's bytes exactly (the format has one spelling of each dataset).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "fuzz_expect.h"
#include "pipemat/data/indexed_dataset.h"

namespace {

using namespace pipemat::data;

void expect(bool ok, const char* what) { pipemat::fuzz::expect(ok, "indexed_idx", what); }

uint64_t le64(std::string_view bytes, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[at + i])) << (8 * i);
  return v;
}

// The .bin size that the .idx's last sequence gives (pointer + length x token size), or 0.
int64_t derived_bin_bytes(std::string_view idx) {
  if (idx.size() < 34) return 0;
  const uint8_t code = static_cast<uint8_t>(idx[17]);
  const int64_t sizes[] = {0, 1, 1, 2, 4, 8, 8, 4, 2};
  if (code < 1 || code > 8) return 0;
  const uint64_t n = le64(idx, 18);
  if (n == 0 || n > (idx.size() - 34) / 12) return 0;
  int32_t length = 0;
  std::memcpy(&length, idx.data() + 34 + 4 * (n - 1), 4);
  const auto pointer =
      static_cast<int64_t>(le64(idx, static_cast<size_t>(34 + 4 * n + 8 * (n - 1))));
  int64_t end = 0;
  if (length < 0 || __builtin_mul_overflow(int64_t{length}, sizes[code], &end) ||
      __builtin_add_overflow(end, pointer, &end) || end < 0) {
    return 0;
  }
  return end;
}

void check_accepted(const IndexedIndex& index, std::string_view idx, int64_t bin_bytes) {
  const auto& offsets = index.sequence_offsets;
  expect(!offsets.empty() && offsets.front() == 0, "sequence offsets start at 0");
  for (size_t i = 1; i < offsets.size(); ++i) {
    expect(offsets[i] >= offsets[i - 1], "sequence offsets are non-decreasing");
    expect(offsets[i] - offsets[i - 1] <= std::numeric_limits<int32_t>::max(),
           "a sequence's length fits int32");
  }
  expect(index.tokens() * token_size(index.dtype) == bin_bytes, "the sequences cover the .bin");
  const auto& docs = index.document_indices;
  expect(!docs.empty() && docs.front() == 0, "document indices start at 0");
  for (size_t k = 1; k < docs.size(); ++k) {
    expect(docs[k] >= docs[k - 1], "document indices are non-decreasing");
  }
  expect(docs.back() == index.sequences(), "the last document index is the sequence count");
  expect(static_cast<size_t>(index.sequences()) <= idx.size() / 12, "no more sequences than bytes");
  expect(encode_indexed_index(index) == idx, "encoded again, the index is the input's bytes");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  int64_t bin_bytes = 0;
  if (data[0] % 2 == 0) {
    if (input.size() < 8) return 0;
    bin_bytes = static_cast<int64_t>(le64(input, 0) & 0x7fffffffffffffffULL);
    input.remove_prefix(8);
  } else {
    bin_bytes = derived_bin_bytes(input);
  }
  IndexedIndex index;
  try {
    index = parse_indexed_index(input, bin_bytes, "fuzz.idx", "fuzz.bin");
  } catch (const DataError&) {
    return 0;  // bad input, refused as documented
  }
  check_accepted(index, input, bin_bytes);  // any exception here is a finding
  return 0;
}
