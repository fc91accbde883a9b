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
// Mismatches are errors showing both sides and both ranks, in the same words whichever receive
// detects them:
//   "tensor mismatch on tag 5: rank 0 sent float32 [4, 8], rank 1 expected float32 [4, 16]"
// Every receive checks the header it got like the list receive below does (known non-quantized
// dtype code, ndim in [0, 64], dims >= 0, no overflow, nbytes, sender, sizes adding up) before
// it compares it with the expectation or hands out any data; a bad header is a CommError naming
// both ranks and the tag: "rank 1 sent a corrupt tensor message on tag 7: the tensor has dtype
// code 99, which is not a dtype (received by rank 0, tcp). ..." (recv_tensor_into with a
// contiguous `out` receives in place, so after such an error `out` holds unspecified bytes.)
//
// Blocking: send_tensor/recv_tensor* return at once; TensorWork::wait blocks (bounded by the
// transport's timeout). Threading: thread-safe like Transport. Tensors: dense (strided) tensors
// of any dtype, on the CPU or a CUDA device: a device tensor travels from a host copy made at the
// send call (a blocking copy, which waits for the device work producing it), and received
// tensors are CPU tensors (recv_tensor_into copies into a device `out` at wait()). The send keeps
// its bytes alive until the message left; the receive owns its destination until wait()
// returned it.
// Errors: CommError (mismatch, peer failure), TimeoutError, ConfigError (e.g. a sparse tensor).
//
// Tensor lists (send_tensors / recv_tensors) carry several tensors, some possibly undefined, as
// ONE transport message whose shapes may change from message to message. Wire format (all
// integers little-endian as in memory; every block starts at a 64-byte offset, so with the
// transport's 64-byte aligned receive buffer every tensor's data is 64-byte aligned):
//   list header, 64 bytes:  u32 magic "PML1" (0x504d4c31), i32 sender rank, u32 count
//                           (<= kMaxListTensors), u32 reserved (0), u64 total message bytes,
//                           zero padding
//   then per entry:         the single-tensor header above (u32 magic "PMT1", i32 dtype code
//                           (at::ScalarType), i32 ndim, i32 sender, u64 nbytes, u64 flags
//                           (bit 0 requires_grad, bit 1 undefined entry), ndim x i64 dims;
//                           zero padded to a multiple of 64 bytes), then nbytes of contiguous
//                           data, zero padded to a multiple of 64 bytes. An undefined entry has
//                           dtype Undefined, ndim 0, nbytes 0 and no data.
// The receiver checks every field against the bytes that arrived (a hostile or buggy peer
// cannot make it crash, over-allocate or read out of bounds): magic, count, sender, known
// non-quantized dtype, ndim in [0, 64], dims >= 0, no int64 overflow in the shape's product or
// numel * element size, nbytes, flags (requires_grad only on floating/complex), and that the
// blocks add up to exactly the message size. Each failure is a CommError naming both ranks
// and the tag:
//   "rank 1 sent a corrupt tensor list on tag 7: entry 2 has dtype code 99, which is not a
//    dtype (received by rank 0, local). ..."

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
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

// Sends `tensor` (CPU or CUDA, any non-quantized dtype, any shape/strides) with its dtype and
// shape. ConfigError (at the call) for a non-strided or quantized tensor.
TensorWork send_tensor(Transport& transport, int peer, int tag, const at::Tensor& tensor);

// Receives a tensor of whatever dtype and shape the sender sent (a fresh CPU tensor that owns
// the received bytes).
TensorWork recv_tensor(Transport& transport, int peer, int tag);

// Receives into a fresh tensor of the expected dtype and shape; anything else is a CommError
// naming both metas and both ranks.
TensorWork recv_tensor(Transport& transport, int peer, int tag, const TensorMeta& expected);

// Receives into `out` (preallocated, CPU or CUDA; its dtype and shape are the expectation). A
// contiguous CPU `out` is written in place; otherwise via a contiguous host temporary copied in
// at wait(). Under MPI a receive that timed out after its message was matched may still land in
// a contiguous `out` later (Note [Work contract]); the storage stays alive, but do not reuse
// `out` then.
TensorWork recv_tensor_into(Transport& transport, int peer, int tag, const at::Tensor& out);

// ---- lists of tensors ----

// Most entries one tensor-list message may carry (more: ConfigError in send_tensors, CommError
// in recv_tensors).
constexpr size_t kMaxListTensors = 4096;

// Handle of a send or receive of a list of tensors (one transport message). Same contract as
// TensorWork; cheap to copy (shared state).
class TensorListWork {
 public:
  TensorListWork() = default;

  bool valid() const;
  bool is_completed() const;
  // Receive: the received tensors, in order. Send: the tensors sent (the caller's tensors, not
  // contiguous copies). CommError (corrupt or non-list message, peer failure) / TimeoutError
  // like TensorWork::wait. Every later call returns the same list or rethrows the same error.
  std::vector<at::Tensor> wait() const;
  std::vector<at::Tensor> wait(std::chrono::milliseconds timeout) const;
  void abort() const noexcept;
  // The byte-level handle (status, info).
  const WorkPtr& work() const;

  struct State;
  explicit TensorListWork(std::shared_ptr<State> state);

 private:
  std::shared_ptr<State> state_;
};

// Sends `tensors` (CPU or CUDA, any dtype/shape/strides; entries may be undefined) as one
// message: each entry's dtype, shape and requires_grad travel with its bytes. Non-contiguous and
// device entries are copied into contiguous host memory first; the work keeps the bytes alive
// until the message left. ConfigError (at the call) for more than kMaxListTensors entries, a
// non-strided tensor, a quantized dtype or more than 64 dimensions, naming the entry.
TensorListWork send_tensors(Transport& transport, int peer, int tag,
                            const std::vector<at::Tensor>& tensors);

// Receives a list sent by send_tensors. Each defined entry is a fresh CPU tensor (a leaf) with
// the sender's dtype and shape, and requires_grad set when the sent tensor required grad;
// undefined entries stay undefined. No copy beyond the transport buffer: the tensors wrap it
// (from_blob, 64-byte aligned data) and share ownership of it, so the buffer lives as long as
// any of them.
TensorListWork recv_tensors(Transport& transport, int peer, int tag);

}  // namespace pipemat::comm
