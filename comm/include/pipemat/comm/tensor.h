#pragma once
// The tensor layer of comm (target pipemat_comm_tensor): moves at::Tensor between ranks over any
// Transport, with its dtype and shape.
//
// Wire format: every tensor message is one transport message = a small header (magic, dtype,
// rank of the sender, shape; padded to 64 bytes) followed by the raw contiguous bytes. The
// metadata therefore travels with the data; there is no per-channel negotiation to get out of
// step. Receivers either know what to expect (a preallocated tensor or a TensorMeta) and then
// the bytes land directly in the destination tensor, or they accept anything and get a tensor
// that wraps the received buffer (no copy either way; the only copies are: non-contiguous sends
// are made contiguous first, and receives into non-contiguous tensors go through a contiguous
// temporary).
//
// Mismatches are errors showing both sides and both ranks (Note [Tensor mismatch message]):
//   "tensor mismatch on tag 5: rank 0 sent float32 [4, 8], rank 1 expected float32 [4, 16]"
//
// Blocking: send_tensor/recv_tensor* return at once; TensorWork::wait blocks (bounded by the
// transport's timeout). Threading: thread-safe like Transport. Tensors: CPU tensors of any
// dtype, any layout (strided); the send keeps its tensor alive until the message left; the
// receive owns its destination until wait() returned it.
// Errors: CommError (mismatch, peer failure), TimeoutError, ConfigError (e.g. non-CPU tensor).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"

namespace pipemat::comm {

struct TensorMeta {
  at::ScalarType dtype = at::ScalarType::Float;
  std::vector<int64_t> shape;

  static TensorMeta of(const at::Tensor& tensor);
  int64_t numel() const;
  size_t nbytes() const;
  // "float32 [4, 8]"; a scalar is "float32 []".
  std::string to_string() const;
  bool operator==(const TensorMeta& other) const {
    return dtype == other.dtype && shape == other.shape;
  }
  bool operator!=(const TensorMeta& other) const { return !(*this == other); }
};

// "float32", "bfloat16", "int64", ... (numpy/torch-python names).
std::string dtype_name(at::ScalarType dtype);

// Handle of one tensor send or receive; cheap to copy (shared state). Same contract as Work
// (Note [Work contract]); wait() additionally checks the metadata and returns the tensor.
class TensorWork {
 public:
  TensorWork() = default;

  bool valid() const { return state_ != nullptr; }
  bool is_completed() const;
  // Receive: the received tensor (the preallocated one for recv_tensor_into). Send: the tensor
  // that was sent. Throws CommError (mismatch: both metas and ranks; peer failure) or
  // TimeoutError. Every later call returns the same tensor or rethrows the same error.
  at::Tensor wait() const;
  at::Tensor wait(std::chrono::milliseconds timeout) const;
  void abort() const noexcept;
  // The byte-level handle (status, info).
  const WorkPtr& work() const;

  struct State;
  explicit TensorWork(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// Sends `tensor` (CPU, any dtype/shape/strides) with its dtype and shape.
TensorWork send_tensor(Transport& transport, int peer, int tag, const at::Tensor& tensor);

// Receives a tensor of whatever dtype and shape the sender sent (a fresh CPU tensor that owns
// the received bytes).
TensorWork recv_tensor(Transport& transport, int peer, int tag);

// Receives into a fresh tensor of the expected dtype and shape; anything else is a CommError
// naming both metas and both ranks.
TensorWork recv_tensor(Transport& transport, int peer, int tag, const TensorMeta& expected);

// Receives into `out` (preallocated, CPU; its dtype and shape are the expectation). Contiguous
// `out` is written in place; otherwise via a contiguous temporary copied in at wait().
TensorWork recv_tensor_into(Transport& transport, int peer, int tag, const at::Tensor& out);

}  // namespace pipemat::comm
