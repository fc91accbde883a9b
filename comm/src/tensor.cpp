// The single tensors of tensor.h (send_tensor / recv_tensor / recv_tensor_into); the wire format
// and its checks are in tensor_wire.h, TensorMeta in tensor_wire.cpp.

#include "pipemat/comm/tensor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "pipemat/core/error.h"
#include "tensor_wire.h"
#include "tensor_work.h"

namespace pipemat::comm {

using detail::decode_tensor;
using detail::Decoded;
using detail::encode_header;
using detail::has_tensor_magic;
using detail::header_size;
using detail::is_tensor_list;
using detail::kMaxDims;
using detail::Mode;
using detail::wait_result;
using detail::WireHeader;

namespace {

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

void check_dense(const at::Tensor& tensor, const char* what, int peer, int tag) {
  PIPEMAT_CHECK(tensor.defined(), ConfigError, what, " to/from rank ", peer, " with tag ", tag,
                ": the tensor is undefined");
  PIPEMAT_CHECK(tensor.layout() == at::kStrided, ConfigError, what, " to/from rank ", peer,
                " with tag ", tag, ": only strided (dense) tensors are supported");
}

}  // namespace

struct TensorWork::State {
  Mode mode = Mode::kSend;
  WorkPtr work;
  TensorMeta expected;
  std::shared_ptr<std::vector<uint8_t>> header;  // send header / expected-recv header target
  at::Tensor tensor;  // send: the tensor; recv: the destination (contiguous)
  at::Tensor out;     // recv_tensor_into with a strided or device out: copy target
  std::mutex mutex;
  bool finalized = false;
  at::Tensor result;
  std::string error;  // set when finalize failed
  bool timeout_error = false;
};

namespace detail {

namespace {

// A send: the tensor that was sent, or the error.
void finalize_send(TensorWork::State& s, const Status& status) {
  if (!status.ok()) {
    s.error = status.message;
    s.timeout_error = status.code == StatusCode::kTimeout;
  } else {
    s.result = s.tensor;
  }
}

// A receive that landed in place: a sender's header with more dimensions than ours runs on
// into the destination's bytes, so its header is gathered into `gathered` and `head` points
// there.
void gather_header(const TensorWork::State& s, size_t size, const uint8_t*& head, size_t& head_size,
                   std::vector<uint8_t>& gathered) {
  if (!has_tensor_magic(head, head_size)) return;
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

// Decodes the header of a received message of `size` bytes; false (with s.error) when it is no
// single tensor of this peer.
bool decode_received(TensorWork::State& s, const WorkInfo& info, const uint8_t* head,
                     size_t head_size, size_t size, TensorMeta& sent, size_t& header_bytes) {
  std::string why;
  switch (decode_tensor(head, head_size, size, info.peer, sent, header_bytes, why)) {
    case Decoded::kOk:
      return true;
    case Decoded::kNotATensor:
      if (is_tensor_list(head, head_size)) {
        s.error = ::pipemat::detail::concat(
            "rank ", info.peer, " sent a tensor list (send_tensors) with tag ", info.tag,
            " to rank ", info.rank,
            ", which posted a single-tensor receive; use recv_tensors on this tag, or "
            "send_tensor on the sender");
        return false;
      }
      s.error = ::pipemat::detail::concat(
          "rank ", info.peer, " sent a message with tag ", info.tag, " to rank ", info.rank,
          " that is not a pipemat tensor (", size,
          " bytes, no tensor header); a byte send and a tensor receive share this tag");
      return false;
    case Decoded::kCorrupt:
      s.error = ::pipemat::detail::concat(
          "rank ", info.peer, " sent a corrupt tensor message on tag ", info.tag, ": ", why,
          " (received by rank ", info.rank, ", ", info.transport,
          "). Both ranks must run the same pipemat build, and nothing else may send on this "
          "tag.");
      return false;
  }
  return true;
}

// The result of a receive whose header decoded to `sent`.
void deliver_received(TensorWork::State& s, const WorkInfo& info, const Status& status,
                      const Buffer& buffer, const TensorMeta& sent, size_t header_bytes) {
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

// Turns the completed byte work into the tensor result (once).
void finalize(TensorWork::State& s) {
  if (s.finalized) return;
  s.finalized = true;
  const WorkInfo& info = s.work->info();
  Status status = s.work->status();
  if (s.mode == Mode::kSend) {
    finalize_send(s, status);
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
  if (!in_buffer) gather_header(s, size, head, head_size, gathered);
  TensorMeta sent;
  size_t header_bytes = 0;
  if (!decode_received(s, info, head, head_size, size, sent, header_bytes)) return;
  deliver_received(s, info, status, buffer, sent, header_bytes);
}

}  // namespace detail

bool TensorWork::is_completed() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::is_completed on an empty handle");
  return state_->work->is_completed();
}

at::Tensor TensorWork::wait() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorWork::wait on an empty handle");
  return wait_result(*state_, std::nullopt);  // Note [Liveness of a peer]
}

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
  check_dense(tensor, "send_tensor", peer, tag);
  PIPEMAT_CHECK(detail::wire_dtype_code(tensor.scalar_type()).has_value(), ConfigError,
                "send_tensor to rank ", peer, " with tag ", tag, ": the tensor has dtype ",
                dtype_name(tensor.scalar_type()), "; tensor messages carry ",
                detail::carried_dtypes(),
                " (a quantized tensor: send int_repr() and the scale instead)");
  auto state = std::make_shared<TensorWork::State>();
  state->mode = Mode::kSend;
  state->tensor = tensor;
  at::Tensor contiguous = detail::host_contiguous(tensor);
  TensorMeta meta = TensorMeta::of(contiguous);
  state->header = std::make_shared<std::vector<uint8_t>>(encode_header(meta, transport.job_rank()));
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
  check_dense(out, "recv_tensor_into", peer, tag);
  TensorMeta expected = TensorMeta::of(out);
  if (out.is_contiguous() && out.device().is_cpu()) {
    return recv_expected(transport, peer, tag, expected, out, at::Tensor());
  }
  // A strided or device `out`: the message lands in host memory and is copied into it.
  at::Tensor staging = at::empty(
      expected.shape, out.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous));
  return recv_expected(transport, peer, tag, expected, staging, out);
}

}  // namespace pipemat::comm
