#pragma once
// The tensor wire format of tensor.h (private): the single-tensor header and the list header,
// writing them, and parsing a received message with the checks every header passes before any
// of its data is handed out (Note [Tensor header checks]). tensor.cpp (single tensors) and
// tensor_list.cpp (lists) send and receive with it.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/comm/tensor.h"
#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

constexpr uint32_t kTensorMagic = 0x504d5431;  // "PMT1"
constexpr int kMaxDims = 64;

struct WireHeader {
  uint32_t magic = kTensorMagic;
  int32_t dtype = 0;
  int32_t ndim = 0;
  int32_t sender = -1;
  uint64_t nbytes = 0;
  uint64_t flags = 0;  // tensor lists only (kFlag*); 0 and ignored for single tensors
  // followed by ndim int64 dims
};
static_assert(sizeof(WireHeader) == 32, "tensor header layout");

constexpr uint64_t kFlagRequiresGrad = 1;
constexpr uint64_t kFlagUndefined = 2;
// A device lane's list (Note [Device lanes]): the entry's bytes come over the lane's link, not
// after its header.
constexpr uint64_t kFlagOnLane = 4;

// Bytes of a tensor header with `ndim` dims: the fixed part and the dims, padded to 64 bytes.
size_t header_size(size_t ndim);

// Writes a header into `out`, which holds header_size(shape.size()) zeroed bytes.
void write_header(uint8_t* out, int32_t dtype, const std::vector<int64_t>& shape, int sender,
                  uint64_t nbytes, uint64_t flags);

std::vector<uint8_t> encode_header(const TensorMeta& meta, int sender);

// True when `data` starts like a single-tensor message (magic and room for the fixed header).
bool has_tensor_magic(const uint8_t* data, size_t size);

// The list header of send_tensors (wire format in tensor.h).
constexpr uint32_t kListMagic = 0x504d4c31;  // "PML1"
constexpr size_t kListHeaderBytes = 64;

struct ListHeader {
  uint32_t magic = kListMagic;
  int32_t sender = -1;
  uint32_t count = 0;
  uint32_t reserved = 0;
  uint64_t total_bytes = 0;  // the whole message, this header included
};
static_assert(sizeof(ListHeader) == 24 && sizeof(ListHeader) <= kListHeaderBytes,
              "list header layout");

// A device lane's control message (Note [Device lanes]): a list whose header has this magic and
// the list's tag in its `reserved` field.
constexpr uint32_t kLaneListMagic = 0x504d4431;  // "PMD1"

// True when `data` starts with the list header's magic.
bool is_tensor_list(const uint8_t* data, size_t size);

// Note [Wire dtype codes]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A header's dtype field is pipemat's own code, from one table in tensor_wire.cpp (13 dtypes:
// the floating, integer, complex and bool types; each number is the one LibTorch's ScalarType
// gives it today, float32 = 6), never a cast of that enum: the enum grows between LibTorch
// releases (the value of Undefined moved), and ranks built against two releases must agree on
// every byte. A code outside the table is refused on receipt, a dtype
// outside it on send (quantized tensors among them). An undefined list entry carries
// kUndefinedDtypeCode.
constexpr int32_t kUndefinedDtypeCode = 255;

// The wire code of `dtype`; nullopt when tensor messages do not carry it.
std::optional<int32_t> wire_dtype_code(at::ScalarType dtype);
// The dtype of wire code `code`; nullopt when it is not in the table (kUndefinedDtypeCode
// included).
std::optional<at::ScalarType> dtype_of_wire_code(int32_t code);
// "float32, float64, ...": the dtypes tensor messages carry, for error messages.
std::string carried_dtypes();

enum class Decoded { kOk, kNotATensor, kCorrupt };

// Parses and checks a single-tensor message of `message_size` bytes sent by rank `sender`,
// whose first `head_size` bytes (at least min(message_size, header_size(kMaxDims))) are at
// `head`. kOk: `meta` and `header_bytes` describe it and the sizes add up.
Decoded decode_tensor(const uint8_t* head, size_t head_size, size_t message_size, int sender,
                      TensorMeta& meta, size_t& header_bytes, std::string& why);

// Every block of a tensor list starts at a multiple of kBlock bytes.
constexpr size_t kBlock = 64;

inline size_t pad_bytes(size_t n) { return (kBlock - n % kBlock) % kBlock; }

// Parses a received tensor-list message. Every read is bounds-checked against `size`; on failure
// returns false with `why` describing the first problem.
// With `lane` (a lane's control message), entries flagged kFlagOnLane are accepted: each gets an
// undefined place in `out` and its index, meta and requires_grad in `lane`.
struct LaneEntry {
  size_t index = 0;
  TensorMeta meta;
  bool requires_grad = false;
};
bool decode_list(const Buffer& buffer, const WorkInfo& info, std::vector<at::Tensor>& out,
                 std::string& why, std::vector<LaneEntry>* lane = nullptr);

// The tensor whose bytes a message carries: `tensor` when it is a contiguous CPU tensor, else a
// contiguous CPU copy. A device (CUDA) tensor is copied to host memory with a blocking copy,
// which waits for the device work that produces it; a received message lands in host memory
// and the caller moves it to its device.
at::Tensor host_contiguous(const at::Tensor& tensor);

}  // namespace pipemat::comm::detail
