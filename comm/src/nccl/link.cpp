// The NCCL link of device lanes (Note [Device lanes] in pipemat/comm/device_lane.h): a build
// with NCCL (PIPEMAT_NCCL) has the real one, others refuse to make one.

#include <ATen/ATen.h>

#include <string>

#include "pipemat/comm/device_lane.h"
#include "pipemat/core/error.h"

#ifdef PIPEMAT_NCCL
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>
#endif

namespace pipemat::comm {

#ifndef PIPEMAT_NCCL

bool nccl_compiled() { return false; }

std::unique_ptr<LaneLink> make_nccl_link(Transport& transport, int) {
  PIPEMAT_THROW(ConfigError, transport.describe(),
                ": this pipemat was built without NCCL (it needs the CUDA paths, "
                "-DPIPEMAT_CUDA=ON, and NCCL's header and library, which the torch wheel's "
                "nvidia/nccl holds); the device lane nccl is not there");
}

#else

bool nccl_compiled() { return true; }

namespace {

using ::pipemat::detail::concat;

// Note [One communicator per direction]
// NCCL matches the k-th send to a rank with the k-th receive from it, and a send holds its stream
// until the receive is posted. With one communicator and stream for a pair, rank 0 sending a
// list to rank 1 while rank 1 sends one to rank 0 can leave each send waiting behind the other's
// receive. Each ordered pair of ranks has its own two-rank communicator (rank 0 of it sends,
// rank 1 receives) and its own stream on each side, so the two directions never wait on each
// other, and a direction's order is the lane's order of control messages.
class NcclLink final : public LaneLink {
 public:
  NcclLink(Transport& transport, int device_index)
      : transport_(transport),
        device_(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index))) {
    const int visible = static_cast<int>(c10::cuda::device_count());
    PIPEMAT_CHECK(device_index >= 0 && device_index < visible, ConfigError, transport.describe(),
                  ": the nccl lane's device cuda:", device_index, " is not one of the ", visible,
                  " visible CUDA devices");
    c10::cuda::CUDAGuard guard(device_);
    const int world = transport.world_size();
    const int me = transport.rank();
    sends_.resize(static_cast<size_t>(world));
    recvs_.resize(static_cast<size_t>(world));
    // The ids of the pairs this rank sends on go to their receivers; theirs come back.
    std::vector<ncclUniqueId> mine(static_cast<size_t>(world));
    std::vector<WorkPtr> posted;
    for (int peer = 0; peer < world; ++peer) {
      if (peer == me) continue;
      check(ncclGetUniqueId(&mine[static_cast<size_t>(peer)]), "ncclGetUniqueId", peer);
      posted.push_back(
          send_reserved(transport_, peer, kLaneBootstrapTag,
                        {ConstSpan{&mine[static_cast<size_t>(peer)], sizeof(ncclUniqueId)}}));
    }
    std::vector<ncclUniqueId> theirs(static_cast<size_t>(world));
    for (int peer = 0; peer < world; ++peer) {
      if (peer == me) continue;
      WorkPtr work = recv_any_reserved(transport_, peer, kLaneBootstrapTag);
      work->wait();
      const Buffer id = work->buffer();
      PIPEMAT_CHECK(id.size() == sizeof(ncclUniqueId), CommError, "rank ", peer, " sent rank ", me,
                    " an NCCL id of ", id.size(), " bytes, not ", sizeof(ncclUniqueId),
                    "; both ranks must run the same pipemat build");
      std::memcpy(&theirs[static_cast<size_t>(peer)], id.data(), sizeof(ncclUniqueId));
    }
    for (auto& work : posted) work->wait();
    try {
      // All communicators at once: NCCL makes the ones of a group together, so no rank waits for
      // a pair whose other rank is still making another.
      check(ncclGroupStart(), "ncclGroupStart", -1);
      for (int peer = 0; peer < world; ++peer) {
        if (peer == me) continue;
        Pair& send = sends_[static_cast<size_t>(peer)];
        Pair& recv = recvs_[static_cast<size_t>(peer)];
        check(ncclCommInitRank(&send.comm, 2, mine[static_cast<size_t>(peer)], 0),
              "ncclCommInitRank (send side)", peer);
        check(ncclCommInitRank(&recv.comm, 2, theirs[static_cast<size_t>(peer)], 1),
              "ncclCommInitRank (receive side)", peer);
      }
      check(ncclGroupEnd(), "ncclGroupEnd (making the communicators)", -1);
      for (int peer = 0; peer < world; ++peer) {
        if (peer == me) continue;
        sends_[static_cast<size_t>(peer)].stream.emplace(
            c10::cuda::getStreamFromPool(false, device_.index()));
        recvs_[static_cast<size_t>(peer)].stream.emplace(
            c10::cuda::getStreamFromPool(false, device_.index()));
      }
      if (world > 1) connect_all();
    } catch (...) {
      release(/*abort=*/true);
      throw;
    }
  }

  // A pair whose stream still has a transfer queued (its peer failed, or a failed step dropped a
  // list) is aborted: destroying it would wait for a peer that may never post its side.
  ~NcclLink() override { release(std::uncaught_exceptions() > 0); }

  std::string name() const override { return "nccl"; }
  bool carries(const at::Tensor& tensor) const override { return tensor.device() == device_; }
  at::Tensor empty(const TensorMeta& meta) const override {
    return at::empty(meta.shape, at::TensorOptions().dtype(meta.dtype).device(device_));
  }

  Poll send(int peer, std::vector<at::Tensor> tensors) override {
    return post(sends_.at(static_cast<size_t>(peer)), peer, std::move(tensors), /*sending=*/true);
  }
  Poll recv(int peer, std::vector<at::Tensor> tensors) override {
    return post(recvs_.at(static_cast<size_t>(peer)), peer, std::move(tensors), /*sending=*/false);
  }

 private:
  struct Pair {
    ncclComm_t comm = nullptr;
    std::optional<c10::cuda::CUDAStream> stream;
  };

  // NCCL connects a pair at its first transfer, and a blocking communicator's first send waits
  // in ncclGroupEnd until the peer makes its first receive: a rank that sends before it receives
  // (two replicas exchanging gradients) would wait there for a peer doing the same. One byte each
  // way on every pair, in one group on every rank, connects them all while every rank is here.
  void connect_all() {
    const int world = transport_.world_size(), me = transport_.rank();
    const at::Tensor bytes =
        at::zeros({2 * world}, at::TensorOptions().dtype(at::kByte).device(device_));
    auto* data = static_cast<uint8_t*>(bytes.data_ptr());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    check(ncclGroupStart(), "ncclGroupStart", -1);
    for (int peer = 0; peer < world; ++peer) {
      if (peer == me) continue;
      const size_t at = 2 * static_cast<size_t>(peer);
      check(ncclSend(data + at, 1, ncclUint8, 1, sends_[static_cast<size_t>(peer)].comm, stream),
            "ncclSend (connecting)", peer);
      check(
          ncclRecv(data + at + 1, 1, ncclUint8, 0, recvs_[static_cast<size_t>(peer)].comm, stream),
          "ncclRecv (connecting)", peer);
    }
    check(ncclGroupEnd(), "ncclGroupEnd (connecting the pairs)", -1);
    PIPEMAT_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, CommError, transport_.describe(),
                  ": connecting the nccl lane's pairs on ", device_.str(), " failed");
  }

  void release(bool abort) noexcept {
    for (auto* pairs : {&sends_, &recvs_}) {
      for (Pair& pair : *pairs) {
        if (pair.comm == nullptr) continue;
        const bool idle = pair.stream.has_value() && pair.stream->query();
        if (abort || !idle) {
          ncclCommAbort(pair.comm);
        } else {
          ncclCommDestroy(pair.comm);
        }
        pair.comm = nullptr;
      }
    }
  }

  // The pair's stream first waits for the work queued on the current stream (what produced a
  // sent tensor; what last used a received tensor's memory), then moves the bytes; the poll is
  // done when its event has fired, and holds the tensors until then.
  Poll post(Pair& pair, int peer, std::vector<at::Tensor> tensors, bool sending) {
    PIPEMAT_CHECK(pair.comm != nullptr, ConfigError, transport_.describe(),
                  ": the nccl lane has no communicator with rank ", peer);
    c10::cuda::CUDAGuard guard(device_);
    at::cuda::CUDAEvent before;
    before.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    before.block(*pair.stream);
    const char* what = sending ? "ncclSend" : "ncclRecv";
    check(ncclGroupStart(), "ncclGroupStart", peer);
    for (const at::Tensor& tensor : tensors) {
      const size_t bytes = tensor.nbytes();
      if (bytes == 0) continue;
      // The caching allocator then keeps the block from other use until the pair's stream is
      // done with it, even when the list is dropped (a failed step) before the transfer ended.
      tensor.record_stream(*pair.stream);
      // The pair's other rank is rank 1 of a send pair, rank 0 of a receive pair.
      const ncclResult_t rc =
          sending
              ? ncclSend(tensor.data_ptr(), bytes, ncclUint8, 1, pair.comm, pair.stream->stream())
              : ncclRecv(tensor.data_ptr(), bytes, ncclUint8, 0, pair.comm, pair.stream->stream());
      if (rc != ncclSuccess) {
        ncclGroupEnd();
        check(rc, what, peer);
      }
    }
    check(ncclGroupEnd(), what, peer);
    auto after = std::make_shared<at::cuda::CUDAEvent>();
    after->record(*pair.stream);
    ncclComm_t comm = pair.comm;
    const std::string where = concat(what, " between rank ", transport_.rank(), " and rank ", peer,
                                     " on ", device_.str());
    return [after, comm, tensors = std::move(tensors), where]() -> std::optional<Status> {
      if (after->query()) return Status{};
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        return Status{StatusCode::kCommError, concat(where, " failed: ", ncclGetErrorString(async),
                                                     " (", ncclGetLastError(comm), ")")};
      }
      return std::nullopt;
    };
  }

  void check(ncclResult_t rc, const char* what, int peer) const {
    if (rc == ncclSuccess) return;
    PIPEMAT_THROW(
        CommError, transport_.describe(), ": ", what,
        peer >= 0 ? concat(" with rank ", peer) : std::string(), " on ", device_.str(),
        " failed: ", ncclGetErrorString(rc), " (", ncclGetLastError(nullptr), ")",
        rc == ncclInvalidUsage
            ? ". NCCL refuses two ranks of a communicator on one GPU: give each rank its own."
            : "");
  }

  Transport& transport_;
  const at::Device device_;
  std::vector<Pair> sends_;
  std::vector<Pair> recvs_;
};

}  // namespace

std::unique_ptr<LaneLink> make_nccl_link(Transport& transport, int device_index) {
  return std::make_unique<NcclLink>(transport, device_index);
}

#endif

}  // namespace pipemat::comm
