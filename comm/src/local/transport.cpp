// Local backend. One hub per group holds, for every (receiver, sender, tag), the receives posted
// and the sends not yet matched, under one mutex (it serves tests and the in-process bench; a
// single lock keeps the matching rules obviously correct). A matched message is copied once,
// straight from the sender's memory into the receiver's.

#include "local/transport.h"

#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>

#include "common.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail {
namespace {

class LocalHub;

class LocalWork final : public SpanWork {
 public:
  LocalWork(WorkInfo info, std::chrono::milliseconds timeout, std::weak_ptr<LocalHub> hub)
      : SpanWork(std::move(info), timeout), hub_(std::move(hub)) {}

  Buffer eager;  // a send copied at post time (small messages)

 protected:
  void abort_impl(const Status& reason) noexcept override;

 private:
  std::weak_ptr<LocalHub> hub_;
};

size_t total_size(const std::vector<ConstSpan>& spans) {
  size_t total = 0;
  for (const auto& s : spans) total += s.size;
  return total;
}

// Copies a gathered message into scattered destination spans of the same total size.
void scatter_copy(const std::vector<ConstSpan>& from, const std::vector<MutableSpan>& to) {
  size_t fi = 0, fo = 0, ti = 0, to_off = 0;
  while (fi < from.size() && ti < to.size()) {
    size_t n = std::min(from[fi].size - fo, to[ti].size - to_off);
    if (n > 0) {
      std::memcpy(static_cast<uint8_t*>(to[ti].data) + to_off,
                  static_cast<const uint8_t*>(from[fi].data) + fo, n);
    }
    fo += n;
    to_off += n;
    if (fo == from[fi].size) ++fi, fo = 0;
    if (to_off == to[ti].size) ++ti, to_off = 0;
  }
}

class LocalHub : public std::enable_shared_from_this<LocalHub> {
 public:
  local::RawPingPong raw;

  LocalHub(int world_size, size_t eager_limit)
      : closed_(static_cast<size_t>(world_size), false), eager_limit_(eager_limit) {}

  void post_send(const std::shared_ptr<LocalWork>& work) {
    const WorkInfo& info = work->info();
    std::unique_lock<std::mutex> lock(mutex_);
    if (closed_[static_cast<size_t>(info.peer)]) {
      lock.unlock();
      work->finish(Status{
          StatusCode::kCommError,
          concat("rank ", info.peer, " has shut down its transport; cannot ", info.describe())});
      return;
    }
    Channel& channel = channels_[Key{info.peer, info.rank, info.tag}];
    if (!channel.recvs.empty()) {
      auto recv = channel.recvs.front();
      channel.recvs.pop_front();
      deliver(work->send_spans, recv);
      lock.unlock();
      work->finish(Status{});
      return;
    }
    if (info.bytes <= eager_limit_) {
      // Eager: copy now, the sender's memory is free at once.
      work->eager = Buffer::allocate_for_tag(info.bytes, info.tag);
      size_t offset = 0;
      for (const auto& span : work->send_spans) {
        if (span.size) std::memcpy(work->eager.data() + offset, span.data, span.size);
        offset += span.size;
      }
      work->send_spans = {ConstSpan{work->eager.data(), info.bytes}};
      channel.sends.push_back(Pending{work, true});
      lock.unlock();
      work->finish(Status{});
      return;
    }
    channel.sends.push_back(Pending{work, false});
  }

  void post_recv(const std::shared_ptr<LocalWork>& work) {
    const WorkInfo& info = work->info();
    std::unique_lock<std::mutex> lock(mutex_);
    Channel& channel = channels_[Key{info.rank, info.peer, info.tag}];
    if (!channel.sends.empty()) {
      Pending pending = channel.sends.front();
      channel.sends.pop_front();
      deliver(pending.send->send_spans, work);
      if (!pending.eager) {
        lock.unlock();
        pending.send->finish(Status{});
      }
      return;
    }
    if (closed_[static_cast<size_t>(info.peer)]) {
      lock.unlock();
      work->finish(Status{
          StatusCode::kCommError,
          peer_failure_message(info, concat("rank ", info.peer, " shut down its transport"))});
      return;
    }
    channel.recvs.push_back(work);
  }

  void abort(LocalWork* work, const Status& reason) {
    std::unique_lock<std::mutex> lock(mutex_);
    const WorkInfo& info = work->info();
    if (info.op == OpKind::kRecv) {
      auto it = channels_.find(Key{info.rank, info.peer, info.tag});
      if (it != channels_.end()) {
        auto& q = it->second.recvs;
        for (auto i = q.begin(); i != q.end(); ++i) {
          if (i->get() == work) {
            q.erase(i);
            break;
          }
        }
      }
    } else {
      auto it = channels_.find(Key{info.peer, info.rank, info.tag});
      if (it != channels_.end()) {
        auto& q = it->second.sends;
        for (auto i = q.begin(); i != q.end(); ++i) {
          if (i->send.get() == work && !i->eager) {
            q.erase(i);
            break;
          }
        }
      }
    }
    // Under the lock: a concurrent match has either happened (finish already done) or cannot.
    work->finish(reason);
  }

  // Rank `rank` is going away: fail what waits on it, withdraw its unmatched rendezvous sends.
  void close(int rank) {
    std::vector<std::pair<std::shared_ptr<LocalWork>, Status>> to_finish;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_[static_cast<size_t>(rank)] = true;
      for (auto& [key, channel] : channels_) {
        if (key.receiver == rank) {
          for (auto& recv : channel.recvs) {
            to_finish.emplace_back(recv,
                                   Status{StatusCode::kAborted, shutdown_message(recv->info())});
          }
          channel.recvs.clear();
          for (auto& pending : channel.sends) {
            if (!pending.eager) {
              to_finish.emplace_back(
                  pending.send,
                  Status{StatusCode::kCommError,
                         peer_failure_message(pending.send->info(),
                                              concat("rank ", rank, " shut down its transport"))});
            }
          }
          channel.sends.clear();
        } else if (key.sender == rank) {
          for (auto& recv : channel.recvs) {
            to_finish.emplace_back(
                recv, Status{StatusCode::kCommError,
                             peer_failure_message(
                                 recv->info(), concat("rank ", rank, " shut down its transport"))});
          }
          channel.recvs.clear();
          std::deque<Pending> kept;
          for (auto& pending : channel.sends) {
            if (pending.eager) {
              kept.push_back(pending);
            } else {
              to_finish.emplace_back(pending.send, Status{StatusCode::kAborted,
                                                          shutdown_message(pending.send->info())});
            }
          }
          channel.sends.swap(kept);
        }
      }
    }
    for (auto& [work, status] : to_finish) work->finish(std::move(status));
  }

 private:
  struct Key {
    int receiver, sender, tag;
    bool operator<(const Key& o) const {
      return std::tie(receiver, sender, tag) < std::tie(o.receiver, o.sender, o.tag);
    }
  };
  struct Pending {
    std::shared_ptr<LocalWork> send;
    bool eager;
  };
  struct Channel {
    std::deque<std::shared_ptr<LocalWork>> recvs;
    std::deque<Pending> sends;
  };

  // Called under the lock; finishes the receive (its waiters only take the Work's own mutex).
  static void deliver(const std::vector<ConstSpan>& from, const std::shared_ptr<LocalWork>& recv) {
    const WorkInfo& info = recv->info();
    size_t size = total_size(from);
    if (info.any_size || size != info.bytes) {
      Buffer buffer = Buffer::allocate_for_tag(size, info.tag);
      scatter_copy(from, {MutableSpan{buffer.data(), size}});
      recv->set_received(size, buffer);
      recv->finish(info.any_size
                       ? Status{}
                       : Status{StatusCode::kSizeMismatch, size_mismatch_message(info, size)});
      return;
    }
    scatter_copy(from, recv->recv_spans);
    recv->set_received(size);
    recv->finish(Status{});
  }

  std::mutex mutex_;
  std::map<Key, Channel> channels_;
  std::vector<bool> closed_;
  const size_t eager_limit_;
};

void LocalWork::abort_impl(const Status& reason) noexcept {
  if (auto hub = hub_.lock()) {
    hub->abort(this, reason);
  } else {
    finish(reason);
  }
}

class LocalTransport final : public SpanTransport<LocalTransport, LocalWork> {
 public:
  LocalTransport(int rank, int world_size, const TransportOptions& options,
                 std::shared_ptr<LocalHub> hub)
      : SpanTransport(TransportKind::kLocal, rank, world_size, options.timeout),
        hub_(std::move(hub)) {}

  ~LocalTransport() override { hub_->close(rank()); }

  LocalHub& hub() { return *hub_; }

  // SpanTransport's post_send / post_recv hand their work to this.
  const std::shared_ptr<LocalHub>& core() const { return hub_; }

 private:
  std::shared_ptr<LocalHub> hub_;
};

}  // namespace

local::RawPingPong* local::raw_pingpong_mailbox(Transport& transport) {
  auto* local_transport = dynamic_cast<LocalTransport*>(&transport);
  return local_transport != nullptr ? &local_transport->hub().raw : nullptr;
}

std::vector<std::unique_ptr<Transport>> make_local_group(int world_size,
                                                         const TransportOptions& options) {
  auto hub = std::make_shared<LocalHub>(world_size, options.local_eager_limit);
  std::vector<std::unique_ptr<Transport>> group;
  group.reserve(static_cast<size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    group.push_back(std::make_unique<LocalTransport>(rank, world_size, options, hub));
  }
  return group;
}

}  // namespace pipemat::comm::detail
