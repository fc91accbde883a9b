#include "pipemat/comm/tensor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>

#include "pipemat/core/error.h"

namespace pipemat::comm {
namespace {

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

size_t header_size(size_t ndim) {
  size_t raw = sizeof(WireHeader) + 8 * ndim;
  return (raw + 63) / 64 * 64;
}

// Writes a header into `out`, which holds header_size(shape.size()) zeroed bytes.
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
  write_header(bytes.data(), static_cast<int32_t>(meta.dtype), meta.shape, sender, meta.nbytes(),
               0);
  return bytes;
}

// True when `data` starts like a single-tensor message (magic and room for the fixed header).
bool has_tensor_magic(const uint8_t* data, size_t size) {
  uint32_t magic = 0;
  if (size < sizeof(WireHeader)) return false;
  std::memcpy(&magic, data, sizeof(magic));
  return magic == kTensorMagic;
}

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

bool is_tensor_list(const uint8_t* data, size_t size) {
  uint32_t magic = 0;
  if (size < sizeof(magic)) return false;
  std::memcpy(&magic, data, sizeof(magic));
  return magic == kListMagic;
}

// Note [Tensor mismatch message]
// Horovod-style: both sides, both ranks, the tag, and what to check. Used by every receive
// flavour so the text is identical whatever path detected it.
std::string mismatch_message(const WorkInfo& info, const TensorMeta& sent,
                             const TensorMeta& expected) {
  return ::pipemat::detail::concat(
      "tensor mismatch on tag ", info.tag, ": rank ", info.peer, " sent ", sent.to_string(),
      ", rank ", info.rank, " expected ", expected.to_string(), " (", info.transport,
      "). The two stages disagree on this activation/gradient; check the sending stage's output "
      "shape and dtype and the micro-batch size on both ranks.");
}

void check_cpu(const at::Tensor& tensor, const char* what, int peer, int tag) {
  PIPEMAT_CHECK(tensor.defined(), ConfigError, what, " to/from rank ", peer, " with tag ", tag,
                ": the tensor is undefined");
  PIPEMAT_CHECK(tensor.device().is_cpu(), ConfigError, what, " to/from rank ", peer, " with tag ",
                tag, ": only CPU tensors are supported, got a tensor on ", tensor.device().str());
  PIPEMAT_CHECK(tensor.layout() == at::kStrided, ConfigError, what, " to/from rank ", peer,
                " with tag ", tag, ": only strided (dense) tensors are supported");
}

// What a defined tensor (single or list entry) may be: a known, non-quantized ScalarType. `code` is
// the raw wire integer, checked against the enum's range before any cast (the enum is 8 bits wide,
// so a cast of e.g. 262 would wrap around to a valid code).
enum class DtypeCheck { kOk, kNotADtype, kUndefined, kQuantized };
DtypeCheck check_dtype_code(int32_t code) {
  if (code < 0 || code >= static_cast<int32_t>(at::ScalarType::NumOptions)) {
    return DtypeCheck::kNotADtype;
  }
  const auto dtype = static_cast<at::ScalarType>(code);
  if (dtype == at::ScalarType::Undefined) return DtypeCheck::kUndefined;
  if (c10::isQIntType(dtype)) return DtypeCheck::kQuantized;
  return DtypeCheck::kOk;
}

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
  switch (check_dtype_code(header.dtype)) {
    case DtypeCheck::kOk:
      break;
    case DtypeCheck::kNotADtype:
      why = concat(subject, " has dtype code ", header.dtype, ", which is not a dtype");
      return false;
    case DtypeCheck::kUndefined:
      why = concat(subject, " has dtype code ", header.dtype,
                   " (Undefined) but is not marked as an undefined entry");
      return false;
    case DtypeCheck::kQuantized:
      why = concat(subject, " has dtype code ", header.dtype, " (",
                   c10::toString(static_cast<at::ScalarType>(header.dtype)),
                   "), a quantized dtype, which pipemat tensor messages do not carry");
      return false;
  }
  meta.dtype = static_cast<at::ScalarType>(header.dtype);
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

enum class Decoded { kOk, kNotATensor, kCorrupt };

// Parses and checks a single-tensor message of `message_size` bytes sent by rank `sender`,
// whose first `head_size` bytes (at least min(message_size, header_size(kMaxDims))) are at
// `head`. kOk: `meta` and `header_bytes` describe it and the sizes add up.
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

enum class Mode { kSend, kRecvAny, kRecvExpected };

}  // namespace

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

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::ScalarType::Float:
      return "float32";
    case at::ScalarType::Double:
      return "float64";
    case at::ScalarType::Half:
      return "float16";
    case at::ScalarType::BFloat16:
      return "bfloat16";
    case at::ScalarType::Long:
      return "int64";
    case at::ScalarType::Int:
      return "int32";
    case at::ScalarType::Short:
      return "int16";
    case at::ScalarType::Char:
      return "int8";
    case at::ScalarType::Byte:
      return "uint8";
    case at::ScalarType::Bool:
      return "bool";
    case at::ScalarType::ComplexFloat:
      return "complex64";
    case at::ScalarType::ComplexDouble:
      return "complex128";
    default:
      return c10::toString(dtype);
  }
}

std::string TensorMeta::to_string() const {
  std::string out = dtype_name(dtype) + " [";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

struct TensorWork::State {
  Mode mode = Mode::kSend;
  WorkPtr work;
  TensorMeta expected;
  std::shared_ptr<std::vector<uint8_t>> header;  // send header / expected-recv header target
  at::Tensor tensor;  // send: the tensor; recv: the destination (contiguous)
  at::Tensor out;     // recv_tensor_into with non-contiguous out: copy target
  std::mutex mutex;
  bool finalized = false;
  at::Tensor result;
  std::string error;  // set when finalize failed
  bool timeout_error = false;
};

namespace {

// Turns the completed byte work into the tensor result (once).
void finalize(TensorWork::State& s) {
  if (s.finalized) return;
  s.finalized = true;
  const WorkInfo& info = s.work->info();
  Status status = s.work->status();
  if (s.mode == Mode::kSend) {
    if (!status.ok()) {
      s.error = status.message;
      s.timeout_error = status.code == StatusCode::kTimeout;
    } else {
      s.result = s.tensor;
    }
    return;
  }
  if (!status.ok() && status.code != StatusCode::kSizeMismatch) {
    s.error = status.message;
    s.timeout_error = status.code == StatusCode::kTimeout;
    return;
  }
  // Where the message is: the transport buffer (any size, or a size mismatch), or our header
  // target followed by the destination tensor (exact size: the bytes landed in place, and
  // nothing of them is handed out before the header passed the checks below).
  Buffer buffer = s.work->buffer();
  const bool in_buffer = buffer.data() != nullptr;
  const size_t size = in_buffer ? buffer.size() : s.header->size() + s.expected.nbytes();
  const uint8_t* head = in_buffer ? buffer.data() : s.header->data();
  size_t head_size = in_buffer ? buffer.size() : s.header->size();
  std::vector<uint8_t> gathered;
  if (!in_buffer && has_tensor_magic(head, head_size)) {
    // A sender's header with more dimensions than ours runs on into the destination's bytes.
    WireHeader peek;
    std::memcpy(&peek, head, sizeof(peek));
    if (peek.ndim >= 0 && peek.ndim <= kMaxDims) {
      const size_t need = std::min(size, header_size(static_cast<size_t>(peek.ndim)));
      if (need > head_size) {
        gathered.assign(s.header->begin(), s.header->end());
        const auto* rest = static_cast<const uint8_t*>(s.tensor.data_ptr());
        gathered.insert(gathered.end(), rest, rest + (need - head_size));
        head = gathered.data();
        head_size = gathered.size();
      }
    }
  }
  TensorMeta sent;
  size_t header_bytes = 0;
  std::string why;
  switch (decode_tensor(head, head_size, size, info.peer, sent, header_bytes, why)) {
    case Decoded::kOk:
      break;
    case Decoded::kNotATensor:
      if (is_tensor_list(head, head_size)) {
        s.error = ::pipemat::detail::concat(
            "rank ", info.peer, " sent a tensor list (send_tensors) with tag ", info.tag,
            " to rank ", info.rank,
            ", which posted a single-tensor receive; use recv_tensors on this tag, or "
            "send_tensor on the sender");
        return;
      }
      s.error = ::pipemat::detail::concat(
          "rank ", info.peer, " sent a message with tag ", info.tag, " to rank ", info.rank,
          " that is not a pipemat tensor (", size,
          " bytes, no tensor header); a byte send and a tensor receive share this tag");
      return;
    case Decoded::kCorrupt:
      s.error = ::pipemat::detail::concat(
          "rank ", info.peer, " sent a corrupt tensor message on tag ", info.tag, ": ", why,
          " (received by rank ", info.rank, ", ", info.transport,
          "). Both ranks must run the same pipemat build, and nothing else may send on this "
          "tag.");
      return;
  }
  if (s.mode == Mode::kRecvExpected) {
    if (sent != s.expected || !status.ok()) {
      s.error = mismatch_message(info, sent, s.expected);
      return;
    }
    if (s.out.defined()) {
      s.out.copy_(s.tensor);
      s.result = s.out;
    } else {
      s.result = s.tensor;
    }
    return;
  }
  // recv any: wrap the transport buffer without copying (decode_tensor checked the sizes).
  auto storage = buffer.storage();
  s.result = at::from_blob(
      buffer.data() + header_bytes, sent.shape, [storage](void*) mutable { storage.reset(); },
      at::TensorOptions().dtype(sent.dtype).device(at::kCPU));
}

}  // namespace

bool TensorWork::is_completed() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::is_completed on an empty handle");
  return state_->work->is_completed();
}

at::Tensor TensorWork::wait() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::wait on an empty handle");
  return wait(state_->work->default_timeout());
}

namespace {

void finalize(TensorListWork::State& s);  // defined with the list messages below

// Waits for the byte work, turns it into the result once (finalize) and returns it or throws
// the stored error. Shared by TensorWork and TensorListWork.
template <typename State>
const auto& wait_result(State& state, std::chrono::milliseconds timeout) {
  try {
    state.work->wait(timeout);
  } catch (const CommError&) {
    // The status is stored; finalize() turns it into the right message (e.g. a size mismatch
    // into the tensor mismatch text).
  }
  std::lock_guard<std::mutex> lock(state.mutex);
  finalize(state);
  if (!state.error.empty()) {
    if (state.timeout_error) throw TimeoutError(state.error);
    throw CommError(state.error);
  }
  return state.result;
}

}  // namespace

at::Tensor TensorWork::wait(std::chrono::milliseconds timeout) const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::wait on an empty handle");
  return wait_result(*state_, timeout);
}

void TensorWork::abort() const noexcept {
  if (state_) state_->work->abort();
}

const WorkPtr& TensorWork::work() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::work on an empty handle");
  return state_->work;
}

TensorWork send_tensor(Transport& transport, int peer, int tag, const at::Tensor& tensor) {
  check_cpu(tensor, "send_tensor", peer, tag);
  PIPEMAT_CHECK(!c10::isQIntType(tensor.scalar_type()), ConfigError, "send_tensor to rank ", peer,
                " with tag ", tag, ": the tensor has dtype ", dtype_name(tensor.scalar_type()),
                "; quantized tensors are not supported (send int_repr() and the scale instead)");
  auto state = std::make_shared<TensorWork::State>();
  state->mode = Mode::kSend;
  state->tensor = tensor;
  at::Tensor contiguous = tensor.contiguous();
  TensorMeta meta = TensorMeta::of(contiguous);
  state->header = std::make_shared<std::vector<uint8_t>>(encode_header(meta, transport.rank()));
  // The keep-alive owns both the header and the contiguous bytes until the message left.
  struct Owned {
    std::shared_ptr<std::vector<uint8_t>> header;
    at::Tensor data;
  };
  auto owned = std::make_shared<Owned>(Owned{state->header, contiguous});
  std::vector<ConstSpan> spans{ConstSpan{state->header->data(), state->header->size()},
                               ConstSpan{contiguous.data_ptr(), meta.nbytes()}};
  state->work = transport.send(peer, tag, std::move(spans), owned);
  return TensorWork(std::move(state));
}

TensorWork recv_tensor(Transport& transport, int peer, int tag) {
  auto state = std::make_shared<TensorWork::State>();
  state->mode = Mode::kRecvAny;
  state->header = std::make_shared<std::vector<uint8_t>>();
  state->work = transport.recv_any(peer, tag);
  return TensorWork(std::move(state));
}

namespace {

TensorWork recv_expected(Transport& transport, int peer, int tag, const TensorMeta& expected,
                         const at::Tensor& destination, at::Tensor out) {
  auto state = std::make_shared<TensorWork::State>();
  state->mode = Mode::kRecvExpected;
  state->expected = expected;
  state->tensor = destination;
  state->out = std::move(out);
  state->header = std::make_shared<std::vector<uint8_t>>(header_size(expected.shape.size()), 0);
  struct Owned {
    std::shared_ptr<std::vector<uint8_t>> header;
    at::Tensor data;
  };
  auto owned = std::make_shared<Owned>(Owned{state->header, destination});
  std::vector<MutableSpan> spans{MutableSpan{state->header->data(), state->header->size()},
                                 MutableSpan{destination.data_ptr(), expected.nbytes()}};
  state->work = transport.recv(peer, tag, std::move(spans), owned);
  return TensorWork(std::move(state));
}

}  // namespace

TensorWork recv_tensor(Transport& transport, int peer, int tag, const TensorMeta& expected) {
  PIPEMAT_CHECK(static_cast<int>(expected.shape.size()) <= kMaxDims, ConfigError,
                "recv_tensor from rank ", peer, " with tag ", tag, ": ", expected.shape.size(),
                " dimensions exceed the limit of ", kMaxDims);
  at::Tensor destination =
      at::empty(expected.shape, at::TensorOptions().dtype(expected.dtype).device(at::kCPU));
  return recv_expected(transport, peer, tag, expected, destination, at::Tensor());
}

TensorWork recv_tensor_into(Transport& transport, int peer, int tag, const at::Tensor& out) {
  check_cpu(out, "recv_tensor_into", peer, tag);
  TensorMeta expected = TensorMeta::of(out);
  if (out.is_contiguous()) {
    return recv_expected(transport, peer, tag, expected, out, at::Tensor());
  }
  at::Tensor staging =
      at::empty(expected.shape, out.options().memory_format(at::MemoryFormat::Contiguous));
  return recv_expected(transport, peer, tag, expected, staging, out);
}

// ---- lists of tensors ----

struct TensorListWork::State {
  Mode mode = Mode::kSend;
  WorkPtr work;
  std::vector<at::Tensor> tensors;  // send: the caller's tensors
  std::mutex mutex;
  bool finalized = false;
  std::vector<at::Tensor> result;
  std::string error;  // set when finalize failed
  bool timeout_error = false;
};

namespace {

constexpr size_t kBlock = 64;

// The padding after each data block points here (a pad is at most kBlock - 1 bytes).
alignas(kBlock) constexpr uint8_t kZeros[kBlock] = {};

size_t pad_bytes(size_t n) { return (kBlock - n % kBlock) % kBlock; }

void check_list_entry(const at::Tensor& tensor, size_t index, int peer, int tag) {
  if (!tensor.defined()) return;
  PIPEMAT_CHECK(tensor.device().is_cpu(), ConfigError, "send_tensors to rank ", peer, " with tag ",
                tag, ": entry ", index, " is on ", tensor.device().str(),
                "; only CPU tensors are supported (move it with .cpu() first)");
  PIPEMAT_CHECK(tensor.layout() == at::kStrided, ConfigError, "send_tensors to rank ", peer,
                " with tag ", tag, ": entry ", index,
                " is not a strided (dense) tensor; convert it with .to_dense() first");
  PIPEMAT_CHECK(check_dtype_code(static_cast<int32_t>(tensor.scalar_type())) == DtypeCheck::kOk,
                ConfigError, "send_tensors to rank ", peer, " with tag ", tag, ": entry ", index,
                " has dtype ", dtype_name(tensor.scalar_type()),
                "; quantized tensors are not supported (send int_repr() and the scale instead)");
  PIPEMAT_CHECK(tensor.dim() <= kMaxDims, ConfigError, "send_tensors to rank ", peer, " with tag ",
                tag, ": entry ", index, " has ", tensor.dim(),
                " dimensions, more than the limit of ", kMaxDims);
}

// Parses a received tensor-list message. Every read is bounds-checked against `size`; on failure
// returns false with `why` describing the first problem.
bool decode_list(const Buffer& buffer, const WorkInfo& info, std::vector<at::Tensor>& out,
                 std::string& why) {
  using ::pipemat::detail::concat;
  const uint8_t* data = buffer.data();
  const size_t size = buffer.size();
  if (size < kListHeaderBytes) {
    why = concat("the message has ", size, " bytes, less than the ", kListHeaderBytes,
                 "-byte list header");
    return false;
  }
  ListHeader header;
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
  if (header.sender != info.peer) {
    why = concat("the header says it was sent by rank ", header.sender);
    return false;
  }
  out.clear();
  out.reserve(header.count);
  size_t offset = kListHeaderBytes;  // always a multiple of kBlock, and <= size
  for (uint32_t index = 0; index < header.count; ++index) {
    const size_t left = size - offset;
    if (left < sizeof(WireHeader)) {
      why = concat("entry ", index, " is cut off: its header starts at byte ", offset,
                   " but the message ends at byte ", size);
      return false;
    }
    WireHeader entry;
    std::memcpy(&entry, data + offset, sizeof(entry));
    if (entry.magic != kTensorMagic) {
      why = concat("entry ", index, " at byte ", offset, " has no tensor header (magic 0x",
                   std::hex, entry.magic, std::dec, ")");
      return false;
    }
    if ((entry.flags & ~(kFlagRequiresGrad | kFlagUndefined)) != 0) {
      why = concat("entry ", index, " has unknown flags 0x", std::hex, entry.flags, std::dec);
      return false;
    }
    if (entry.flags & kFlagUndefined) {
      if (entry.flags != kFlagUndefined || entry.ndim != 0 || entry.nbytes != 0 ||
          entry.dtype != static_cast<int32_t>(at::ScalarType::Undefined)) {
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
      continue;
    }
    const std::string subject = concat("entry ", index);
    if (!check_ndim(entry, subject, why)) return false;
    const size_t entry_header = header_size(static_cast<size_t>(entry.ndim));
    if (left < entry_header) {
      why = concat("entry ", index, " is cut off: its header with ", entry.ndim,
                   " dimensions needs ", entry_header, " bytes but only ", left, " are left");
      return false;
    }
    TensorMeta meta;
    int64_t nbytes = 0;
    if (!check_meta(entry, data + offset + sizeof(WireHeader), subject, meta, nbytes, why)) {
      return false;
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
    if (entry.flags & kFlagRequiresGrad) {
      if (!can_require_grad(meta.dtype)) {
        why = concat("entry ", index, " is ", meta.to_string(),
                     " and marked requires_grad, which only floating point and complex tensors "
                     "can be");
        return false;
      }
      tensor.set_requires_grad(true);
    }
    out.push_back(std::move(tensor));
    offset = data_offset + static_cast<size_t>(nbytes) + pad_bytes(static_cast<size_t>(nbytes));
  }
  if (offset != size) {
    why = concat("its ", header.count, " entries end at byte ", offset, " but the message has ",
                 size, " bytes");
    return false;
  }
  return true;
}

void finalize(TensorListWork::State& s) {
  if (s.finalized) return;
  s.finalized = true;
  const WorkInfo& info = s.work->info();
  Status status = s.work->status();
  if (!status.ok()) {
    s.error = status.message;
    s.timeout_error = status.code == StatusCode::kTimeout;
    return;
  }
  if (s.mode == Mode::kSend) {
    s.result = s.tensors;
    return;
  }
  Buffer buffer = s.work->buffer();
  if (!is_tensor_list(buffer.data(), buffer.size())) {
    const bool is_single = has_tensor_magic(buffer.data(), buffer.size());
    s.error = is_single
                  ? ::pipemat::detail::concat(
                        "rank ", info.peer, " sent a single tensor (send_tensor) with tag ",
                        info.tag, " to rank ", info.rank,
                        ", which posted a tensor-list receive; use recv_tensor on this tag, or "
                        "send_tensors on the sender")
                  : ::pipemat::detail::concat(
                        "rank ", info.peer, " sent a message with tag ", info.tag, " to rank ",
                        info.rank, " that is not a pipemat tensor list (", buffer.size(),
                        " bytes, no list header); a byte send and a tensor-list receive share "
                        "this tag");
    return;
  }
  std::string why;
  if (!decode_list(buffer, info, s.result, why)) {
    s.result.clear();
    s.error = ::pipemat::detail::concat(
        "rank ", info.peer, " sent a corrupt tensor list on tag ", info.tag, ": ", why,
        " (received by rank ", info.rank, ", ", info.transport,
        "). Both ranks must run the same pipemat build, and nothing else may send on this tag.");
  }
}

}  // namespace

TensorListWork::TensorListWork(std::shared_ptr<State> state) : state_(std::move(state)) {}

bool TensorListWork::valid() const { return state_ != nullptr; }

bool TensorListWork::is_completed() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorListWork::is_completed on an empty handle");
  return state_->work->is_completed();
}

std::vector<at::Tensor> TensorListWork::wait() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorListWork::wait on an empty handle");
  return wait(state_->work->default_timeout());
}

std::vector<at::Tensor> TensorListWork::wait(std::chrono::milliseconds timeout) const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorListWork::wait on an empty handle");
  return wait_result(*state_, timeout);
}

void TensorListWork::abort() const noexcept {
  if (state_) state_->work->abort();
}

const WorkPtr& TensorListWork::work() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorListWork::work on an empty handle");
  return state_->work;
}

TensorListWork send_tensors(Transport& transport, int peer, int tag,
                            const std::vector<at::Tensor>& tensors) {
  PIPEMAT_CHECK(tensors.size() <= kMaxListTensors, ConfigError, "send_tensors to rank ", peer,
                " with tag ", tag, ": ", tensors.size(), " tensors exceed the limit of ",
                kMaxListTensors, " (kMaxListTensors) per message; split the list");
  for (size_t i = 0; i < tensors.size(); ++i) check_list_entry(tensors[i], i, peer, tag);
  // All headers live in one buffer; the data spans point into the (contiguous) tensors and the
  // padding spans at kZeros. The keep-alive owns both until the message left.
  struct Owned {
    std::vector<uint8_t> headers;
    std::vector<at::Tensor> data;
  };
  auto owned = std::make_shared<Owned>();
  owned->data.reserve(tensors.size());
  std::vector<size_t> header_offsets;
  header_offsets.reserve(tensors.size());
  size_t headers_bytes = kListHeaderBytes;
  for (const at::Tensor& tensor : tensors) {
    owned->data.push_back(tensor.defined() ? tensor.contiguous() : at::Tensor());
    header_offsets.push_back(headers_bytes);
    headers_bytes += header_size(tensor.defined() ? static_cast<size_t>(tensor.dim()) : 0);
  }
  owned->headers.assign(headers_bytes, 0);
  const int sender = transport.rank();
  std::vector<ConstSpan> spans;
  spans.reserve(1 + 3 * tensors.size());
  spans.push_back(ConstSpan{owned->headers.data(), kListHeaderBytes});
  uint64_t total = kListHeaderBytes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& data = owned->data[i];
    uint8_t* header = owned->headers.data() + header_offsets[i];
    if (!data.defined()) {
      write_header(header, static_cast<int32_t>(at::ScalarType::Undefined), {}, sender, 0,
                   kFlagUndefined);
      spans.push_back(ConstSpan{header, header_size(0)});
      total += header_size(0);
      continue;
    }
    const TensorMeta meta = TensorMeta::of(data);
    const size_t nbytes = meta.nbytes();
    write_header(header, static_cast<int32_t>(meta.dtype), meta.shape, sender, nbytes,
                 tensors[i].requires_grad() ? kFlagRequiresGrad : 0);
    spans.push_back(ConstSpan{header, header_size(meta.shape.size())});
    if (nbytes > 0) spans.push_back(ConstSpan{data.data_ptr(), nbytes});
    if (pad_bytes(nbytes) > 0) spans.push_back(ConstSpan{kZeros, pad_bytes(nbytes)});
    total += header_size(meta.shape.size()) + nbytes + pad_bytes(nbytes);
  }
  ListHeader list;
  list.sender = sender;
  list.count = static_cast<uint32_t>(tensors.size());
  list.total_bytes = total;
  std::memcpy(owned->headers.data(), &list, sizeof(list));

  auto state = std::make_shared<TensorListWork::State>();
  state->mode = Mode::kSend;
  state->tensors = tensors;
  state->work = transport.send(peer, tag, std::move(spans), owned);
  return TensorListWork(std::move(state));
}

TensorListWork recv_tensors(Transport& transport, int peer, int tag) {
  auto state = std::make_shared<TensorListWork::State>();
  state->mode = Mode::kRecvAny;
  state->work = transport.recv_any(peer, tag);
  return TensorListWork(std::move(state));
}

}  // namespace pipemat::comm
