// The tensor lists of tensor.h (send_tensors / recv_tensors): one transport message carrying
// several tensors; the wire format and its checks are in tensor_wire.h.

#include <ATen/ATen.h>

#include <cstring>
#include <functional>
#include <mutex>

#include "device_lane_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "tensor_wire.h"
#include "tensor_work.h"

namespace pipemat::comm {

using detail::carried_dtypes;
using detail::decode_list;
using detail::has_tensor_magic;
using detail::header_size;
using detail::host_contiguous;
using detail::is_tensor_list;
using detail::kBlock;
using detail::kFlagRequiresGrad;
using detail::kFlagUndefined;
using detail::kListHeaderBytes;
using detail::kMaxDims;
using detail::kUndefinedDtypeCode;
using detail::ListHeader;
using detail::Mode;
using detail::pad_bytes;
using detail::wait_result;
using detail::wire_dtype_code;
using detail::write_header;

namespace {

// The padding after each data block points here (a pad is at most kBlock - 1 bytes).
alignas(kBlock) constexpr uint8_t kZeros[kBlock] = {};

void check_list_entry(const at::Tensor& tensor, size_t index, int peer, int tag) {
  if (!tensor.defined()) return;
  PIPEMAT_CHECK(tensor.layout() == at::kStrided, ConfigError, "send_tensors to rank ", peer,
                " with tag ", tag, ": entry ", index,
                " is not a strided (dense) tensor; convert it with .to_dense() first");
  PIPEMAT_CHECK(wire_dtype_code(tensor.scalar_type()).has_value(), ConfigError,
                "send_tensors to rank ", peer, " with tag ", tag, ": entry ", index, " has dtype ",
                dtype_name(tensor.scalar_type()), "; tensor messages carry ", carried_dtypes(),
                " (a quantized tensor: send int_repr() and the scale instead)");
  PIPEMAT_CHECK(tensor.dim() <= kMaxDims, ConfigError, "send_tensors to rank ", peer, " with tag ",
                tag, ": entry ", index, " has ", tensor.dim(),
                " dimensions, more than the limit of ", kMaxDims);
}

}  // namespace

namespace detail {

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
  if (s.take) {  // a device lane's list (Note [Device lanes])
    s.result = s.take();
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

}  // namespace detail

TensorListWork::TensorListWork(std::shared_ptr<State> state) : state_(std::move(state)) {}

bool TensorListWork::valid() const { return state_ != nullptr; }

bool TensorListWork::is_completed() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorListWork::is_completed on an empty handle");
  return state_->work->is_completed();
}

std::vector<at::Tensor> TensorListWork::wait() const {
  PIPEMAT_CHECK(state_, ConfigError, "TensorListWork::wait on an empty handle");
  return wait_result(*state_, std::nullopt);  // Note [Liveness of a peer]
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

namespace detail {

ListMessage encode_list(const std::vector<at::Tensor>& tensors, int sender, int peer, int tag,
                        const LaneLink* link) {
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
  ListMessage message;
  owned->data.reserve(tensors.size());
  std::vector<size_t> header_offsets;
  header_offsets.reserve(tensors.size());
  std::vector<bool> on_lane(tensors.size(), false);
  size_t headers_bytes = kListHeaderBytes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& tensor = tensors[i];
    on_lane[i] = tensor.defined() && link != nullptr && link->carries(tensor);
    if (on_lane[i]) {
      message.carried.push_back(tensor.contiguous());
      owned->data.emplace_back();
    } else {
      owned->data.push_back(tensor.defined() ? host_contiguous(tensor) : at::Tensor());
    }
    header_offsets.push_back(headers_bytes);
    headers_bytes += header_size(tensor.defined() ? static_cast<size_t>(tensor.dim()) : 0);
  }
  owned->headers.assign(headers_bytes, 0);
  std::vector<ConstSpan>& spans = message.spans;
  spans.reserve(1 + 3 * tensors.size());
  spans.push_back(ConstSpan{owned->headers.data(), kListHeaderBytes});
  uint64_t total = kListHeaderBytes;
  size_t carried = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& data = on_lane[i] ? message.carried[carried++] : owned->data[i];
    uint8_t* header = owned->headers.data() + header_offsets[i];
    if (!data.defined()) {
      write_header(header, kUndefinedDtypeCode, {}, sender, 0, kFlagUndefined);
      spans.push_back(ConstSpan{header, header_size(0)});
      total += header_size(0);
      continue;
    }
    const TensorMeta meta = TensorMeta::of(data);
    const size_t nbytes = meta.nbytes();
    const uint64_t flags =
        (tensors[i].requires_grad() ? kFlagRequiresGrad : 0) | (on_lane[i] ? kFlagOnLane : 0);
    write_header(header, wire_dtype_code(meta.dtype).value(), meta.shape, sender, nbytes, flags);
    spans.push_back(ConstSpan{header, header_size(meta.shape.size())});
    total += header_size(meta.shape.size());
    if (on_lane[i]) continue;  // its bytes go over the link
    if (nbytes > 0) spans.push_back(ConstSpan{data.data_ptr(), nbytes});
    if (pad_bytes(nbytes) > 0) spans.push_back(ConstSpan{kZeros, pad_bytes(nbytes)});
    total += nbytes + pad_bytes(nbytes);
  }
  ListHeader list;
  if (link != nullptr) {
    list.magic = kLaneListMagic;
    list.reserved = static_cast<uint32_t>(tag);
  }
  list.sender = sender;
  list.count = static_cast<uint32_t>(tensors.size());
  list.total_bytes = total;
  std::memcpy(owned->headers.data(), &list, sizeof(list));
  message.total = total;
  message.owned = owned;
  return message;
}

}  // namespace detail

TensorListWork send_tensors(Transport& transport, int peer, int tag,
                            const std::vector<at::Tensor>& tensors) {
  if (DeviceLane* lane = transport.device_lane()) {
    return detail::lane_send(*lane, transport, peer, tag, tensors);
  }
  // receivers check the sender against their Work's peer
  detail::ListMessage message =
      detail::encode_list(tensors, transport.job_rank(), peer, tag, nullptr);
  auto state = std::make_shared<TensorListWork::State>();
  state->mode = Mode::kSend;
  state->tensors = tensors;
  state->work = transport.send(peer, tag, std::move(message.spans), std::move(message.owned));
  return TensorListWork(std::move(state));
}

TensorListWork recv_tensors(Transport& transport, int peer, int tag) {
  if (DeviceLane* lane = transport.device_lane()) {
    return detail::lane_recv(*lane, transport, peer, tag);
  }
  auto state = std::make_shared<TensorListWork::State>();
  state->mode = Mode::kRecvAny;
  state->work = transport.recv_any(peer, tag);
  return TensorListWork(std::move(state));
}

}  // namespace pipemat::comm
