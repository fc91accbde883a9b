// Fuzz target: a safetensors file's bytes (weights::parse_safetensors; Note [Safetensors checks]
// and Note [Fuzz targets] in tests/fuzz/CMakeLists.txt).
//
// The input's first byte chooses how the rest is read:
//   even: the rest is a whole file (length prefix, header, data buffer), as a file on disk;
//   odd:  two bytes of a data buffer size B (little-endian), then a header's JSON text H: the
//         file is H's length, H and B zero bytes. Mutations of H then keep a valid length
//         prefix, so the fuzzer reaches the checks of the header itself.
// Bad input must end in a WeightsError. What the reader accepts must be what it promises: the
// tensors in name order, each name once, each spanning its shape's bytes, together tiling the data
// buffer; and the writer writes them back into a file the reader reads as the same tensors.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_expect.h"
#include "pipemat/weights/safetensors.h"

namespace {

void expect(bool ok, const char* what) { pipemat::fuzz::expect(ok, "safetensors", what); }

using namespace pipemat::weights;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (size_t i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

void check_accepted(const SafetensorsHeader& h, std::string_view file) {
  const auto size = static_cast<int64_t>(file.size());
  expect(h.data_start >= 8 && h.data_start <= size, "the data buffer starts inside the file");
  int64_t covered = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const TensorInfo& t = h.tensors[i];
    expect(i == 0 || h.tensors[i - 1].name < t.name, "tensors in name order, each once");
    expect(t.name != kMetadataKey, "__metadata__ is no tensor");
    int64_t bytes = element_size(t.dtype);
    for (const int64_t d : t.shape) {
      expect(d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes), "a shape that fits 64 bits");
    }
    expect(0 <= t.begin && t.begin <= t.end && t.end <= size - h.data_start,
           "offsets within the buffer");
    expect(t.bytes() == bytes, "a tensor spans its shape's bytes");
    covered += t.bytes();
  }
  expect(covered == size - h.data_start, "the tensors tile the buffer");

  // Written back, read back the same (the writer refuses an empty name, which files may hold).
  std::vector<TensorBytes> tensors;
  for (const TensorInfo& t : h.tensors) {
    if (t.name.empty()) return;
    tensors.push_back(
        {t.name, t.dtype, t.shape,
         file.substr(static_cast<size_t>(h.data_start + t.begin), static_cast<size_t>(t.bytes()))});
  }
  std::ostringstream out;
  write_safetensors(out, tensors, h.metadata);
  const std::string written = out.str();
  const SafetensorsHeader back = parse_safetensors(written, "written");
  expect(back.metadata == h.metadata, "the metadata reads back");
  expect(back.tensors.size() == h.tensors.size(), "every tensor reads back");
  for (size_t i = 0; i < back.tensors.size(); ++i) {
    const TensorInfo& a = h.tensors[i];
    const TensorInfo& b = back.tensors[i];
    expect(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape, "a tensor reads back");
    expect(
        file.substr(static_cast<size_t>(h.data_start + a.begin), static_cast<size_t>(a.bytes())) ==
            std::string_view(written).substr(static_cast<size_t>(back.data_start + b.begin),
                                             static_cast<size_t>(b.bytes())),
        "a tensor's bytes read back");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string file;
  if (data[0] % 2 == 0) {
    file = input;
  } else {
    if (input.size() < 2) return 0;
    const size_t buffer = static_cast<uint8_t>(input[0]) | (static_cast<uint8_t>(input[1]) << 8);
    const std::string_view header = input.substr(2);
    file = le64(header.size()) + std::string(header) + std::string(buffer, '\0');
  }
  SafetensorsHeader h;
  try {
    h = parse_safetensors(file, "fuzz.safetensors");
  } catch (const WeightsError&) {
    return 0;  // bad input, refused as documented
  }
  check_accepted(h, file);  // any exception here is a finding
  return 0;
}
