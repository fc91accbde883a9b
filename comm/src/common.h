#pragma once
// What the backends share (private): the wording of the comm error messages, so every backend
// says the same thing, and the span-carrying Work each backend builds from a Transport::Request.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/comm/work.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail {

using ::pipemat::detail::concat;

// Note [Tags on the wire]
// The tags a pipemat rank may send: the user's (0..kMaxUserTag; Transport checks every send and
// receive) and those comm reserves for itself above them (transport.h), each sent only by its own
// code through Transport's internal path: the barrier's and the device lanes' three. mpi's
// heartbeats (kHeartbeatTag) go straight to MPI from its progress thread; tcp's are frames of
// their own ("PMB1"). A message from the network with any other tag (a negative one, one above
// the reserved ones, the heartbeat tag in a tcp data frame) was sent by no pipemat rank: the tcp
// read loop refuses it as a corrupt stream, failing that peer, instead of keeping it as an
// unexpected message. The local transport's messages come through Transport only, and mpi
// matches only the tags of posted receives (MPI_Improbe per tag), so neither can take in
// another tag.
inline bool is_transport_tag(int tag) {
  return (tag >= 0 && tag <= kMaxUserTag) || tag == kBarrierTag ||
         (tag >= kLaneControlTag && tag <= kLaneBootstrapTag);
}

// "rank 1 sent 4160 bytes with tag 3, but rank 0 posted a recv of 4096 bytes (tcp); ..."
std::string size_mismatch_message(const WorkInfo& info, size_t sent_bytes);

// "<what happened> while rank 0 was waiting for <info.describe()>"
std::string peer_failure_message(const WorkInfo& info, const std::string& what_happened);

// Work finished because the transport was destroyed first.
std::string shutdown_message(const WorkInfo& info);

// Note [Liveness of a peer] (pipemat/comm/work.h): when anything last arrived from each job rank,
// and how often a backend beats. Written by a backend's I/O or progress thread, read by waits.
class PeerClocks {
 public:
  explicit PeerClocks(int world_size)
      : size_(static_cast<size_t>(world_size)),
        heard_ns_(std::make_unique<std::atomic<int64_t>[]>(size_)) {
    const int64_t now = Clock::now().time_since_epoch().count();
    for (size_t r = 0; r < size_; ++r) heard_ns_[r].store(now, std::memory_order_relaxed);
  }
  void heard(int rank) {
    if (rank >= 0 && static_cast<size_t>(rank) < size_) {
      heard_ns_[static_cast<size_t>(rank)].store(Clock::now().time_since_epoch().count(),
                                                 std::memory_order_relaxed);
    }
  }
  Clock::duration silence(int rank) const {
    if (rank < 0 || static_cast<size_t>(rank) >= size_) return Clock::duration::zero();
    const int64_t heard = heard_ns_[static_cast<size_t>(rank)].load(std::memory_order_relaxed);
    return Clock::now() - Clock::time_point(Clock::duration(heard));
  }
  // TransportOptions::heartbeat_interval (at most a day), or a quarter of the timeout, between
  // 20 ms and 1 s.
  static Clock::duration beat_interval(const TransportOptions& options) {
    if (options.heartbeat_interval.count() > 0) {
      return std::min<Clock::duration>(options.heartbeat_interval, std::chrono::hours(24));
    }
    return std::clamp<Clock::duration>(options.timeout / 4, std::chrono::milliseconds(20),
                                       std::chrono::seconds(1));
  }

 private:
  size_t size_;
  std::unique_ptr<std::atomic<int64_t>[]> heard_ns_;
};

// What every backend's Work carries from its Transport::Request: the caller's buffers of a send
// or of an exact-size receive (a recv_any has none). The backends add their own state.
class SpanWork : public Work {
 public:
  using Work::Work;
  // The backend's side of Work (protected there: users cannot complete a Work).
  using Work::finish;
  using Work::set_received;
  std::vector<ConstSpan> send_spans;
  std::vector<MutableSpan> recv_spans;
};

// The post_send / post_recv every backend has: build BackendWork(request.info, timeout, core)
// holding request.keep_alive and owning the request's spans (a send's or a receive's; the other
// list is empty), then hand it to core->post_send / post_recv. Derived::core() returns the
// backend's shared core (the hub of the local backend); it stays a member of Derived so the
// backend keeps its own construction and destruction order.
template <typename Derived, typename BackendWork>
class SpanTransport : public Transport {
 protected:
  using Transport::Transport;

  WorkPtr post_send(Request request) override {
    const auto& core = static_cast<Derived&>(*this).core();
    auto work = make_work(std::move(request), core);
    core->post_send(work);
    return work;
  }

  WorkPtr post_recv(Request request) override {
    const auto& core = static_cast<Derived&>(*this).core();
    auto work = make_work(std::move(request), core);
    core->post_recv(work);
    return work;
  }

 private:
  template <typename Core>
  std::shared_ptr<BackendWork> make_work(Request request, const Core& core) {
    auto work = std::make_shared<BackendWork>(request.info, timeout(), core);
    work->hold(std::move(request.keep_alive));
    work->send_spans = std::move(request.send_spans);
    work->recv_spans = std::move(request.recv_spans);
    return work;
  }
};

}  // namespace pipemat::comm::detail
