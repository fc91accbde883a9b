#include "tensor_wire.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "pipemat/core/error.h"

namespace pipemat::comm {

TensorMeta TensorMeta::of(const at::Tensor& tensor) {
  TensorMeta meta;
  meta.dtype = tensor.scalar_type();
  meta.shape = tensor.sizes().vec();
  return meta;
}

int64_t TensorMeta::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorMeta::nbytes() const { return static_cast<size_t>(numel()) * c10::elementSize(dtype); }

namespace {

struct WireDtype {
  int32_t code;
  at::ScalarType dtype;
  const char* name;
};
// Note [Wire dtype codes] (tensor_wire.h).
constexpr WireDtype kWireDtypes[] = {
    {0, at::ScalarType::Byte, "uint8"},
    {1, at::ScalarType::Char, "int8"},
    {2, at::ScalarType::Short, "int16"},
    {3, at::ScalarType::Int, "int32"},
    {4, at::ScalarType::Long, "int64"},
    {5, at::ScalarType::Half, "float16"},
    {6, at::ScalarType::Float, "float32"},
    {7, at::ScalarType::Double, "float64"},
    {8, at::ScalarType::ComplexHalf, "complex32"},
    {9, at::ScalarType::ComplexFloat, "complex64"},
    {10, at::ScalarType::ComplexDouble, "complex128"},
    {11, at::ScalarType::Bool, "bool"},
    {15, at::ScalarType::BFloat16, "bfloat16"},
};

const WireDtype* find_dtype(at::ScalarType dtype) {
  for (const WireDtype& entry : kWireDtypes) {
    if (entry.dtype == dtype) return &entry;
  }
  return nullptr;
}

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  const WireDtype* entry = find_dtype(dtype);
  return entry != nullptr ? entry->name : c10::toString(dtype);
}

std::string TensorMeta::to_string() const {
  std::string out = dtype_name(dtype) + " [";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

namespace detail {
namespace {

// value *= factor when the product of these positive numbers fits in int64; false otherwise.
bool multiply_within_int64(int64_t& value, int64_t factor) {
  if (value > std::numeric_limits<int64_t>::max() / factor) return false;
  value *= factor;
  return true;
}

bool can_require_grad(at::ScalarType dtype) {
  return c10::isFloatingType(dtype) || c10::isComplexType(dtype);
}

// Note [Tensor header checks]
// The single-tensor receives and the list receives check a tensor header the same way (wire
// format and list of checks in tensor.h), so a hostile header gets the same words on both.
// `subject` names the header in the message: "entry 2" (lists) or "the tensor".

// ndim within [0, kMaxDims]; checked before the dims are read.
bool check_ndim(const WireHeader& header, const std::string& subject, std::string& why) {
  if (header.ndim >= 0 && header.ndim <= kMaxDims) return true;
  why = ::pipemat::detail::concat(subject, " has ", header.ndim, " dimensions; expected 0 to ",
                                  kMaxDims);
  return false;
}

// The dtype code, the dims (`dims`: header.ndim int64 values, unaligned) and the nbytes field.
// On success `meta` and `nbytes` describe the tensor.
bool check_meta(const WireHeader& header, const uint8_t* dims, const std::string& subject,
                TensorMeta& meta, int64_t& nbytes, std::string& why) {
  using ::pipemat::detail::concat;
  const std::optional<at::ScalarType> dtype = dtype_of_wire_code(header.dtype);
  if (!dtype) {
    if (header.dtype == kUndefinedDtypeCode) {
      why = concat(subject, " has dtype code ", header.dtype,
                   " (undefined) but is not marked as an undefined entry");
    } else {
      why = concat(subject, " has dtype code ", header.dtype,
                   ", which is not a dtype tensor messages carry");
    }
    return false;
  }
  meta.dtype = *dtype;
  meta.shape.resize(static_cast<size_t>(header.ndim));
  if (header.ndim > 0) std::memcpy(meta.shape.data(), dims, 8 * static_cast<size_t>(header.ndim));
  // The product of max(dim, 1) must fit in int64 (it bounds every contiguous stride, even of
  // an empty tensor); numel * element size must fit as well.
  int64_t strides_product = 1;
  bool empty = false;
  for (size_t d = 0; d < meta.shape.size(); ++d) {
    const int64_t dim = meta.shape[d];
    if (dim < 0) {
      why = concat(subject, " has size ", dim, " in dimension ", d, " (shape ", meta.to_string(),
                   "); sizes cannot be negative");
      return false;
    }
    empty = empty || dim == 0;
    if (!multiply_within_int64(strides_product, std::max<int64_t>(dim, 1))) {
      why = concat(subject, " has shape ", meta.to_string(),
                   ", whose number of elements overflows int64");
      return false;
    }
  }
  const int64_t numel = empty ? 0 : strides_product;
  nbytes = numel;
  if (numel > 0 &&
      !multiply_within_int64(nbytes, static_cast<int64_t>(c10::elementSize(meta.dtype)))) {
    why = concat(subject, " is ", meta.to_string(), ", whose size in bytes overflows");
    return false;
  }
  if (header.nbytes != static_cast<uint64_t>(nbytes)) {
    why = concat(subject, " is ", meta.to_string(), " (", nbytes, " bytes) but its header says ",
                 header.nbytes, " bytes");
    return false;
  }
  return true;
}

}  // namespace

size_t header_size(size_t ndim) {
  size_t raw = sizeof(WireHeader) + 8 * ndim;
  return (raw + 63) / 64 * 64;
}

void write_header(uint8_t* out, int32_t dtype, const std::vector<int64_t>& shape, int sender,
                  uint64_t nbytes, uint64_t flags) {
  WireHeader header;
  header.dtype = dtype;
  header.ndim = static_cast<int32_t>(shape.size());
  header.sender = sender;
  header.nbytes = nbytes;
  header.flags = flags;
  std::memcpy(out, &header, sizeof(header));
  if (!shape.empty()) std::memcpy(out + sizeof(header), shape.data(), 8 * shape.size());
}

std::vector<uint8_t> encode_header(const TensorMeta& meta, int sender) {
  std::vector<uint8_t> bytes(header_size(meta.shape.size()), 0);
  write_header(bytes.data(), wire_dtype_code(meta.dtype).value(), meta.shape, sender, meta.nbytes(),
               0);
  return bytes;
}

bool has_tensor_magic(const uint8_t* data, size_t size) {
  uint32_t magic = 0;
  if (size < sizeof(WireHeader)) return false;
  std::memcpy(&magic, data, sizeof(magic));
  return magic == kTensorMagic;
}

bool is_tensor_list(const uint8_t* data, size_t size) {
  uint32_t magic = 0;
  if (size < sizeof(magic)) return false;
  std::memcpy(&magic, data, sizeof(magic));
  return magic == kListMagic;
}

std::optional<int32_t> wire_dtype_code(at::ScalarType dtype) {
  const WireDtype* entry = find_dtype(dtype);
  if (entry == nullptr) return std::nullopt;
  return entry->code;
}

std::optional<at::ScalarType> dtype_of_wire_code(int32_t code) {
  for (const WireDtype& entry : kWireDtypes) {
    if (entry.code == code) return entry.dtype;
  }
  return std::nullopt;
}

std::string carried_dtypes() {
  std::string out;
  for (const WireDtype& entry : kWireDtypes) {
    if (!out.empty()) out += ", ";
    out += entry.name;
  }
  return out;
}

Decoded decode_tensor(const uint8_t* head, size_t head_size, size_t message_size, int sender,
                      TensorMeta& meta, size_t& header_bytes, std::string& why) {
  using ::pipemat::detail::concat;
  if (!has_tensor_magic(head, head_size)) return Decoded::kNotATensor;
  WireHeader header;
  std::memcpy(&header, head, sizeof(header));
  const std::string subject = "the tensor";
  if (!check_ndim(header, subject, why)) return Decoded::kCorrupt;
  header_bytes = header_size(static_cast<size_t>(header.ndim));
  if (message_size < header_bytes) {
    why = concat("its header with ", header.ndim, " dimensions needs ", header_bytes,
                 " bytes but the message has only ", message_size);
    return Decoded::kCorrupt;
  }
  PIPEMAT_INTERNAL_ASSERT(head_size >= header_bytes, "tensor header of ", header_bytes,
                          " bytes decoded from ", head_size, " bytes");
  int64_t nbytes = 0;
  if (!check_meta(header, head + sizeof(WireHeader), subject, meta, nbytes, why)) {
    return Decoded::kCorrupt;
  }
  if (header.sender != sender) {
    why = concat("the header says it was sent by rank ", header.sender);
    return Decoded::kCorrupt;
  }
  if (message_size - header_bytes != static_cast<uint64_t>(nbytes)) {
    why = concat("header says ", meta.to_string(), " (", nbytes, " bytes) but ",
                 message_size - header_bytes, " bytes followed");
    return Decoded::kCorrupt;
  }
  return Decoded::kOk;
}

namespace {

// The list header of a message of `size` bytes from rank `peer`.
bool check_list_header(const uint8_t* data, size_t size, int peer, ListHeader& header,
                       std::string& why) {
  using ::pipemat::detail::concat;
  if (size < kListHeaderBytes) {
    why = concat("the message has ", size, " bytes, less than the ", kListHeaderBytes,
                 "-byte list header");
    return false;
  }
  std::memcpy(&header, data, sizeof(header));
  if (header.count > kMaxListTensors) {
    why = concat("the header says ", header.count, " tensors, more than the limit of ",
                 kMaxListTensors, " (kMaxListTensors)");
    return false;
  }
  if (header.total_bytes != size) {
    why = concat("the header says the message has ", header.total_bytes, " bytes, but ", size,
                 " bytes arrived");
    return false;
  }
  if (header.sender != peer) {
    why = concat("the header says it was sent by rank ", header.sender);
    return false;
  }
  return true;
}

// An entry marked undefined: a bare header of header_size(0) bytes.
bool decode_undefined_entry(const WireHeader& entry, uint32_t index, size_t left,
                            std::vector<at::Tensor>& out, size_t& offset, std::string& why) {
  using ::pipemat::detail::concat;
  if (entry.flags != kFlagUndefined || entry.ndim != 0 || entry.nbytes != 0 ||
      entry.dtype != kUndefinedDtypeCode) {
    why = concat("entry ", index,
                 " is marked undefined but has a dtype, dimensions, bytes or requires_grad");
    return false;
  }
  if (left < header_size(0)) {
    why = concat("entry ", index, " is cut off: its header needs ", header_size(0),
                 " bytes but only ", left, " are left");
    return false;
  }
  out.emplace_back();
  offset += header_size(0);
  return true;
}

// A tensor entry: its header, then its bytes (a view of the buffer) and their padding.
bool decode_tensor_entry(const Buffer& buffer, const WireHeader& entry, uint32_t index, size_t left,
                         std::vector<at::Tensor>& out, size_t& offset, std::string& why,
                         std::vector<LaneEntry>* lane) {
  using ::pipemat::detail::concat;
  const std::string subject = concat("entry ", index);
  if (!check_ndim(entry, subject, why)) return false;
  const size_t entry_header = header_size(static_cast<size_t>(entry.ndim));
  if (left < entry_header) {
    why = concat("entry ", index, " is cut off: its header with ", entry.ndim, " dimensions needs ",
                 entry_header, " bytes but only ", left, " are left");
    return false;
  }
  TensorMeta meta;
  int64_t nbytes = 0;
  if (!check_meta(entry, buffer.data() + offset + sizeof(WireHeader), subject, meta, nbytes, why)) {
    return false;
  }
  const bool requires_grad = (entry.flags & kFlagRequiresGrad) != 0;
  if (requires_grad && !can_require_grad(meta.dtype)) {
    why = concat("entry ", index, " is ", meta.to_string(),
                 " and marked requires_grad, which only floating point and complex tensors can be");
    return false;
  }
  if (entry.flags & kFlagOnLane) {  // its bytes come over the lane's link
    lane->push_back(LaneEntry{index, meta, requires_grad});
    out.emplace_back();
    offset += entry_header;
    return true;
  }
  const size_t after_header = left - entry_header;
  if (static_cast<uint64_t>(nbytes) > after_header ||
      pad_bytes(static_cast<size_t>(nbytes)) > after_header - static_cast<size_t>(nbytes)) {
    why = concat("entry ", index, " (", meta.to_string(), ", ", nbytes,
                 " bytes and padding) is cut off: only ", after_header, " bytes are left");
    return false;
  }
  const size_t data_offset = offset + entry_header;
  auto storage = buffer.storage();
  at::Tensor tensor = at::from_blob(
      buffer.data() + data_offset, meta.shape, [storage](void*) mutable { storage.reset(); },
      at::TensorOptions().dtype(meta.dtype).device(at::kCPU));
  if (requires_grad) tensor.set_requires_grad(true);
  out.push_back(std::move(tensor));
  offset = data_offset + static_cast<size_t>(nbytes) + pad_bytes(static_cast<size_t>(nbytes));
  return true;
}

// Entry `index`, whose header starts at `offset`; moves `offset` past it.
bool decode_entry(const Buffer& buffer, uint32_t index, std::vector<at::Tensor>& out,
                  size_t& offset, std::string& why, std::vector<LaneEntry>* lane) {
  using ::pipemat::detail::concat;
  const size_t size = buffer.size();
  const size_t left = size - offset;
  if (left < sizeof(WireHeader)) {
    why = concat("entry ", index, " is cut off: its header starts at byte ", offset,
                 " but the message ends at byte ", size);
    return false;
  }
  WireHeader entry;
  std::memcpy(&entry, buffer.data() + offset, sizeof(entry));
  if (entry.magic != kTensorMagic) {
    why = concat("entry ", index, " at byte ", offset, " has no tensor header (magic 0x", std::hex,
                 entry.magic, std::dec, ")");
    return false;
  }
  const uint64_t known =
      kFlagRequiresGrad | kFlagUndefined | (lane != nullptr ? kFlagOnLane : uint64_t{0});
  if ((entry.flags & ~known) != 0) {
    why = concat("entry ", index, " has unknown flags 0x", std::hex, entry.flags, std::dec);
    return false;
  }
  if (entry.flags & kFlagUndefined) {
    return decode_undefined_entry(entry, index, left, out, offset, why);
  }
  return decode_tensor_entry(buffer, entry, index, left, out, offset, why, lane);
}

}  // namespace

bool decode_list(const Buffer& buffer, const WorkInfo& info, std::vector<at::Tensor>& out,
                 std::string& why, std::vector<LaneEntry>* lane) {
  const size_t size = buffer.size();
  ListHeader header;
  if (!check_list_header(buffer.data(), size, info.peer, header, why)) return false;
  out.clear();
  out.reserve(header.count);
  size_t offset = kListHeaderBytes;  // always a multiple of kBlock, and <= size
  for (uint32_t index = 0; index < header.count; ++index) {
    if (!decode_entry(buffer, index, out, offset, why, lane)) return false;
  }
  if (offset != size) {
    why = ::pipemat::detail::concat("its ", header.count, " entries end at byte ", offset,
                                    " but the message has ", size, " bytes");
    return false;
  }
  return true;
}

at::Tensor host_contiguous(const at::Tensor& tensor) {
  return tensor.device().is_cpu() ? tensor.contiguous() : tensor.to(at::kCPU).contiguous();
}

}  // namespace detail
}  // namespace pipemat::comm
