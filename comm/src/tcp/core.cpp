// The lifecycle of the tcp backend's I/O core: the I/O thread, running work on it, aborts, and the
// failure and shutdown of peer connections. The send path is in tcp/core_send.cpp, the read loop
// in tcp/core_recv.cpp.

#include "tcp/core.h"

#include <exception>
#include <future>
#include <optional>

#include "common.h"
#include "pipemat/core/format.h"

namespace pipemat::comm::detail::tcp {

bool TcpCore::run_on_io(std::function<void()> fn) {
  std::promise<void> done;
  auto future = done.get_future();
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (!running_) return false;
    asio::post(io, [&fn, &done] {
      try {
        fn();
        done.set_value();
      } catch (...) {
        done.set_exception(std::current_exception());
      }
    });
  }
  future.get();
  return true;
}

void TcpCore::abort(TcpWork* work, const Status& reason) {
  bool ran = run_on_io([&] { do_abort(work, reason); });
  if (!ran) work->finish(reason);
}

void TcpCore::start() {
  io.restart();  // the rendezvous may have run the context out of work
  guard_.emplace(asio::make_work_guard(io));
  for (auto& peer : peers) {
    if (!peer) continue;
    // Large kernel buffers: fewer reactor wake-ups per MiB-sized activation.
    error_code ignored;
    peer->socket.set_option(asio::socket_base::send_buffer_size(4 << 20), ignored);
    peer->socket.set_option(asio::socket_base::receive_buffer_size(4 << 20), ignored);
    clocks.heard(peer->rank);  // the connection's start
    read_header(*peer);
  }
  schedule_beat();
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    running_ = true;
  }
  thread_ = std::thread([this] {
    for (;;) {
      try {
        // Poll for a short while after each burst of activity before sleeping in the
        // reactor: a pipeline exchange is a burst of messages, and a sleeping I/O thread adds
        // a wake-up to every one of them.
        while (!io.stopped()) {
          if (io.poll() > 0) continue;
          bool busy = false;
          const auto until = Clock::now() + std::chrono::microseconds(50);
          while (Clock::now() < until) {
            if (io.poll() > 0) {
              busy = true;
              break;
            }
            std::this_thread::yield();
          }
          if (!busy) io.run_one();
        }
        return;
      } catch (...) {
        // Every handler that serves a peer fails that peer on an exception (guard_peer) and
        // user requests carry theirs back (run_on_io, do_recv). What still gets here escaped
        // that error handling itself (out of memory while failing a peer): keep serving the
        // other peers rather than kill the process from a background thread.
      }
    }
  });
}

void TcpCore::shutdown(std::chrono::milliseconds linger) noexcept {
  if (!thread_.joinable()) return;
  try {
    run_on_io([this] {
      closing_ = true;
      beat_timer_.cancel();
      for (auto& peer : peers) {
        if (!peer || peer->broken) continue;
        std::lock_guard<std::mutex> lock(peer->send_mutex);
        if (peer->sends.empty()) shut_send_locked(*peer);
      }
    });
    {
      std::unique_lock<std::mutex> lock(state_mutex_);
      state_cv_.wait_for(lock, linger, [&] { return all_closed_; });
    }
    run_on_io([this] {
      for (auto& peer : peers) {
        if (!peer) continue;
        fail_peer(*peer, StatusCode::kAborted, "", /*shutdown=*/true);
      }
    });
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      running_ = false;
    }
    guard_.reset();
    thread_.join();
  } catch (...) {
    // Destructors never throw; a failure here leaves the sockets to the OS.
    if (thread_.joinable()) {
      io.stop();
      thread_.join();
    }
  }
}

void TcpCore::schedule_beat() {
  beat_timer_.expires_after(beat_interval_);
  // A weak reference: a pending timer never keeps the core (which owns the io_context) alive.
  beat_timer_.async_wait([weak = weak_from_this()](const error_code& ec) {
    const auto self = weak.lock();
    if (ec || !self || self->closing_) return;
    self->beat();
    self->schedule_beat();
  });
}

void TcpCore::beat() {
  for (auto& peer : peers) {
    if (!peer || peer->broken) continue;
    {
      std::lock_guard<std::mutex> lock(peer->send_mutex);
      if (peer->send_closed || !peer->sends.empty()) continue;
    }
    WorkInfo info;
    info.op = OpKind::kSend;
    info.rank = rank_;
    info.peer = peer->rank;
    info.tag = 0;
    info.transport = "tcp";
    auto work =
        std::make_shared<TcpWork>(std::move(info), std::chrono::milliseconds(0), weak_from_this());
    work->header.magic = kBeatMagic;
    post_send(work);  // a failure is the connection's, which its read loop reports
  }
}

void TcpCore::refuse_peer(Peer& peer, const std::string& what) {
  if (!peer.broken) peer.refused = true;
  fail_peer(peer, StatusCode::kCommError, what);
}

void TcpCore::do_abort(TcpWork* work, const Status& reason) {
  const WorkInfo& info = work->info();
  Peer& peer = *peers[static_cast<size_t>(info.peer)];
  if (info.op == OpKind::kRecv) {
    if (peer.reading.get() == work && peer.reading_buffer.data() != nullptr) {
      // Arriving into a transport Buffer: detach; the message becomes unexpected.
      peer.reading = nullptr;
    } else if (peer.reading.get() == work) {
      // Mid-transfer: the stream cannot be resynchronised (Note [Abort after timeout]).
      work->finish(reason);
      fail_peer(peer, StatusCode::kCommError,
                concat("the connection to rank ", peer.rank, " was closed because a ",
                       "transfer from it was aborted mid-way (", info.describe(), ")"));
      return;
    }
    auto it = peer.posted.find(info.tag);
    if (it != peer.posted.end()) {
      auto& queue = it->second;
      for (auto i = queue.begin(); i != queue.end(); ++i) {
        if (i->get() == work) {
          queue.erase(i);
          break;
        }
      }
    }
  } else {
    bool mid_transfer = false;
    {
      std::lock_guard<std::mutex> lock(peer.send_mutex);
      if (!peer.sends.empty() && peer.sends.front().get() == work) {
        mid_transfer = true;  // the front is being written (Note [Direct send])
      } else {
        for (auto i = peer.sends.begin(); i != peer.sends.end(); ++i) {
          if (i->get() == work) {
            peer.sends.erase(i);
            break;
          }
        }
      }
    }
    if (mid_transfer) {
      work->finish(reason);
      fail_peer(peer, StatusCode::kCommError,
                concat("the connection to rank ", peer.rank, " was closed because a ",
                       "transfer to it was aborted mid-way (", info.describe(), ")"));
      return;
    }
  }
  work->finish(reason);
}

void TcpCore::fail_peer(Peer& peer, StatusCode code, const std::string& what, bool shutdown) {
  std::deque<std::shared_ptr<TcpWork>> sends;
  {
    // Under send_mutex: no user thread writes to the descriptor while it is closed.
    std::lock_guard<std::mutex> lock(peer.send_mutex);
    if (!peer.broken) {
      peer.broken = true;
      peer.broken_reason = what;
      error_code ignored;
      peer.socket.close(ignored);
    }
    peer.send_closed = true;
    peer.send_closed_reason = peer.broken_reason;
    sends.swap(peer.sends);
    peer.writing = false;
    peer.front_offset = 0;
  }
  auto status_for = [&](const std::shared_ptr<TcpWork>& work) {
    if (shutdown) return Status{StatusCode::kAborted, shutdown_message(work->info())};
    if (work->info().op == OpKind::kRecv) {
      return Status{code, recv_failure_message(peer, work->info(), what)};
    }
    return Status{code, concat(what, "; could not complete ", work->info().describe())};
  };
  if (peer.reading) {
    peer.reading->finish(status_for(peer.reading));
    peer.reading = nullptr;
  }
  for (auto& [tag, queue] : peer.posted) {
    for (auto& work : queue) work->finish(status_for(work));
    queue.clear();
  }
  for (auto& work : sends) work->finish(status_for(work));
  bool all = true;
  for (auto& p : peers) {
    if (p && !p->broken) all = false;
  }
  if (all) {
    std::lock_guard<std::mutex> lock(state_mutex_);
    all_closed_ = true;
    state_cv_.notify_all();
  }
}

std::optional<Clock::duration> TcpWork::peer_silence() const {
  const auto core = core_.lock();
  const int peer = info().peer;
  if (!core || peer < 0 || peer >= static_cast<int>(core->peers.size()) ||
      !core->peers[static_cast<size_t>(peer)]) {
    return std::nullopt;
  }
  return core->clocks.silence(peer);
}

void TcpWork::abort_impl(const Status& reason) noexcept {
  auto core = core_.lock();
  if (!core) {
    finish(reason);
    return;
  }
  try {
    core->abort(this, reason);
  } catch (...) {
    finish(reason);
  }
}

}  // namespace pipemat::comm::detail::tcp
