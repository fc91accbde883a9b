#pragma once
// The safetensors format (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of a JSON object
//   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<value>", ...}}
// (padded with spaces), then the data buffer: every tensor's bytes, little-endian, row-major,
// contiguous, at [begin, end) of the buffer. The tensors cover the buffer exactly: no holes,
// no overlaps.
//
// Note [Safetensors checks]
// A weight file comes from anywhere, so nothing of it is trusted before it is checked: the
// header length against a cap (kMaxHeaderBytes, before anything is allocated) and against the
// file's size; the header is JSON, an object, of objects with exactly dtype, shape and
// data_offsets; no name (and no key of an entry) twice, which a JSON library would resolve in
// silence by keeping the last; a known dtype; a shape of non-negative integers whose product
// times the element size does not overflow and equals end - begin; offsets that are
// non-negative integers within the buffer; and the tensors, in offset order, tile the buffer
// from 0 to its end. The header is read with core's strict JSON parser (Note [Strict JSON] in
// pipemat/core/json.h): no NaN, no number that overflows, UTF-8 strings, at most 128 levels. Every
// error is a WeightsError naming the file and the tensor. The file is opened once (Note [Opening
// an input file] in pipemat/core/files.h: a FIFO or a device is refused at once); reads of a
// tensor then read exactly its bytes from that descriptor (a rank reads only its stages'
// tensors).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"

namespace pipemat::weights {

// Every error of this library is a pipemat::WeightsError (core/error.h) naming the file and the
// tensor.
using ::pipemat::WeightsError;

enum class Dtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL".
const char* to_string(Dtype dtype);
// The dtype spelled `text`, or nothing.
std::optional<Dtype> dtype_from_string(std::string_view text);
// Bytes of one element: 8, 4, 2, 2, 8, 4, 2, 1, 1, 1.
int64_t element_size(Dtype dtype);

// The largest header a reader accepts (100 MiB): a length above it is refused before any
// allocation (the reference implementation's cap).
inline constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;

// The name of the file metadata key, in the header, that is not a tensor.
inline constexpr const char* kMetadataKey = "__metadata__";

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;  // empty: a scalar
  int64_t begin = 0;           // [begin, end) of the data buffer
  int64_t end = 0;
  int64_t numel() const;  // 1 for a scalar
  int64_t bytes() const { return end - begin; }
};

// What a safetensors header holds, checked (Note [Safetensors checks]).
struct SafetensorsHeader {
  int64_t data_start = 0;           // the offset of the data buffer: 8 + the header length
  std::vector<TensorInfo> tensors;  // in name order
  std::map<std::string, std::string> metadata;
};

// The header of the safetensors file whose bytes are `bytes` (the whole file: the data buffer's
// size is part of the checks), checked as SafetensorsFile checks a file; WeightsError naming
// `name` where it is not valid. For bytes that are not a file (a buffer, a fuzzer's input).
SafetensorsHeader parse_safetensors(std::string_view bytes, const std::string& name);

// One safetensors file, its header read and checked (Note [Safetensors checks]). The data is
// read tensor by tensor, on request.
class SafetensorsFile {
 public:
  // WeightsError naming `path` when it is not a regular file, cannot be read, or is not a valid
  // safetensors file.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return path_; }
  // Every tensor, in name order.
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  // The tensor `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const;
  // The header's "__metadata__" (empty when it has none).
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  // The offset of the data buffer in the file: 8 + the header length.
  int64_t data_start() const { return header_.data_start; }
  // The file's size when it was opened.
  int64_t size() const { return file_->size(); }

  // Reads tensor `name`'s bytes into `out` (info.bytes() of them). WeightsError naming the file
  // and the tensor when there is no such tensor or the file no longer holds its bytes.
  void read(const std::string& name, void* out) const;
  // The same, returned.
  std::string read(const std::string& name) const;

 private:
  std::string path_;
  // Open from the header's read to the last tensor's (Note [Opening an input file]); shared by
  // copies of this object.
  std::shared_ptr<const InputFile> file_;
  SafetensorsHeader header_;
  std::map<std::string, size_t> by_name_;
};

// A tensor to write: its bytes (little-endian, row-major, contiguous) are `data`, which must
// hold numel(shape) * element_size(dtype) bytes.
struct TensorBytes {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  std::string_view data;
};

// Writes a safetensors file of `tensors` and `metadata` to `out`, in the layout of the reference
// implementation (Python's safetensors.torch.save_file): the data ordered by dtype (the wider
// first, so every tensor is aligned) then by name, the header compact JSON in that order with
// "__metadata__" first (absent when empty; its keys sorted), padded with spaces to a multiple
// of 8 bytes. The same tensors always give the same bytes. WeightsError when a name repeats, is
// "__metadata__" or empty, or a tensor's data does not have the size of its shape.
void write_safetensors(std::ostream& out, std::vector<TensorBytes> tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The same into the file `path`: written to "<path>.tmp", flushed and renamed, so `path` is
// either the whole new file or untouched. WeightsError naming the path when it cannot be
// written.
void write_safetensors_file(const std::string& path, std::vector<TensorBytes> tensors,
                            const std::map<std::string, std::string>& metadata = {});

// The header `write_safetensors` writes (8-byte length included).
std::string safetensors_header(const std::vector<TensorBytes>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

// The index file of a checkpoint split into several files.
inline constexpr const char* kIndexFile = "model.safetensors.index.json";

// Weights from one safetensors file or a directory: with model.safetensors.index.json
// ({"weight_map": {name: file}}, files named relative to the directory), the files it names;
// without one, the directory's model.safetensors. Every file's header is checked when opened;
// each name maps to the one file the index gives (WeightsError when that file lacks it, or
// when a file holds a tensor the index maps elsewhere).
class WeightSource {
 public:
  explicit WeightSource(const std::string& path);

  const std::string& path() const { return path_; }
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  // The tensor `name` (nullptr when there is none) and its file.
  const TensorInfo* find(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;
  // The files' metadata together (a key in two files: the first file's value, files in name
  // order).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  void read(const std::string& name, void* out) const;
  std::string read(const std::string& name) const;

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> file_by_name_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace pipemat::weights
