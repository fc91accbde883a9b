#include "pipemat/comm/tensor.h"

#include <ATen/ATen.h>

#include <cstring>
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
  uint64_t reserved = 0;
  // followed by ndim int64 dims
};
static_assert(sizeof(WireHeader) == 32, "tensor header layout");

size_t header_size(size_t ndim) {
  size_t raw = sizeof(WireHeader) + 8 * ndim;
  return (raw + 63) / 64 * 64;
}

std::vector<uint8_t> encode_header(const TensorMeta& meta, int sender) {
  std::vector<uint8_t> bytes(header_size(meta.shape.size()), 0);
  WireHeader header;
  header.dtype = static_cast<int32_t>(meta.dtype);
  header.ndim = static_cast<int32_t>(meta.shape.size());
  header.sender = sender;
  header.nbytes = meta.nbytes();
  std::memcpy(bytes.data(), &header, sizeof(header));
  if (!meta.shape.empty()) {
    std::memcpy(bytes.data() + sizeof(header), meta.shape.data(), 8 * meta.shape.size());
  }
  return bytes;
}

// Parses a header at the front of `data` (`size` bytes available). Returns false if malformed.
bool decode_header(const uint8_t* data, size_t size, TensorMeta& meta, size_t& header_bytes) {
  if (size < sizeof(WireHeader)) return false;
  WireHeader header;
  std::memcpy(&header, data, sizeof(header));
  if (header.magic != kTensorMagic || header.ndim < 0 || header.ndim > kMaxDims) return false;
  header_bytes = header_size(static_cast<size_t>(header.ndim));
  if (size < header_bytes) return false;
  meta.dtype = static_cast<at::ScalarType>(header.dtype);
  meta.shape.resize(static_cast<size_t>(header.ndim));
  if (header.ndim > 0) {
    std::memcpy(meta.shape.data(), data + sizeof(header), 8 * static_cast<size_t>(header.ndim));
  }
  return true;
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
  // Where the header is: our header target (exact-size path) or the transport buffer.
  Buffer buffer = s.work->buffer();
  const uint8_t* data = buffer.data() != nullptr ? buffer.data() : s.header->data();
  size_t size = buffer.data() != nullptr ? buffer.size() : s.header->size();
  TensorMeta sent;
  size_t header_bytes = 0;
  if (!decode_header(data, size, sent, header_bytes)) {
    s.error = ::pipemat::detail::concat(
        "rank ", info.peer, " sent a message with tag ", info.tag, " to rank ", info.rank,
        " that is not a pipemat tensor (", size,
        " bytes, no tensor header); a byte send and a tensor receive share this tag");
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
  // recv any: wrap the transport buffer without copying.
  if (size != header_bytes + sent.nbytes()) {
    s.error =
        ::pipemat::detail::concat("rank ", info.peer, " sent a corrupt tensor message on tag ",
                                  info.tag, ": header says ", sent.to_string(), " (", sent.nbytes(),
                                  " bytes) but ", size - header_bytes, " bytes followed");
    return;
  }
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

at::Tensor TensorWork::wait(std::chrono::milliseconds timeout) const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::wait on an empty handle");
  try {
    state_->work->wait(timeout);
  } catch (const CommError&) {
    // The status is stored; finalize() turns it into the right message (e.g. a size mismatch
    // into the tensor mismatch text).
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  finalize(*state_);
  if (!state_->error.empty()) {
    if (state_->timeout_error) throw TimeoutError(state_->error);
    throw CommError(state_->error);
  }
  return state_->result;
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

}  // namespace pipemat::comm
