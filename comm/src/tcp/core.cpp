// The Asio I/O core of the tcp backend: sends (Note [Direct send]), the read loop that matches
// frames to receives, aborts, and the failure and shutdown of peer connections.

#include "tcp/core.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <future>
#include <new>

#include "common.h"

namespace pipemat::comm::detail::tcp {
namespace {

void scatter(const Buffer& from, const std::vector<MutableSpan>& to) {
  size_t offset = 0;
  for (const auto& span : to) {
    if (span.size) std::memcpy(span.data, from.data() + offset, span.size);
    offset += span.size;
  }
}

// The error of a receive from a peer whose connection failed.
std::string recv_failure_message(const Peer& peer, const WorkInfo& info, const std::string& what) {
  if (peer.refused) return concat(info.describe(), " failed: ", what);
  return peer_failure_message(info, what);
}

// Finishes a receive whose bytes are in `buffer` (size `size`).
void complete_from_buffer(const std::shared_ptr<TcpWork>& work, Buffer buffer, size_t size) {
  const WorkInfo& info = work->info();
  if (info.any_size) {
    work->set_received(size, std::move(buffer));
    work->finish(Status{});
  } else if (size != info.bytes) {
    work->set_received(size, std::move(buffer));
    work->finish(Status{StatusCode::kSizeMismatch, size_mismatch_message(info, size)});
  } else {
    scatter(buffer, work->recv_spans);
    work->set_received(size);
    work->finish(Status{});
  }
}

}  // namespace

template <typename Buffers, typename Make>
void TcpCore::frame_buffers(TcpWork& work, size_t offset, Buffers& out, Make make) {
  auto add = [&](const void* data, size_t size) {
    if (offset >= size) {
      offset -= size;
      return;
    }
    out.push_back(make(static_cast<const uint8_t*>(data) + offset, size - offset));
    offset = 0;
  };
  add(&work.header, sizeof(FrameHeader));
  for (const auto& span : work.send_spans) {
    if (span.size) add(span.data, span.size);
  }
}

template <typename Doing, typename Fn>
void TcpCore::guard_peer(Peer& peer, Doing&& doing, Fn&& fn) {
  try {
    fn();
  } catch (const std::bad_alloc&) {
    refuse_peer(peer,
                concat("rank ", rank_, " ran out of memory ", doing(), " (std::bad_alloc); rank ",
                       rank_, " closed the connection to rank ", peer.rank,
                       ". Lower TransportOptions::max_message_bytes (now ", max_message_bytes_,
                       " bytes) to refuse such messages up front, or send smaller ones"));
  } catch (const std::exception& e) {
    refuse_peer(peer, concat("rank ", rank_, " failed ", doing(), " (", e.what(), "); rank ", rank_,
                             " closed the connection to rank ", peer.rank));
  }
}

void TcpCore::post_send(const std::shared_ptr<TcpWork>& work) {
  const WorkInfo& info = work->info();
  Peer& peer = *peers[static_cast<size_t>(info.peer)];
  work->header.tag = info.tag;
  work->header.size = info.bytes;
  bool kick = false;
  {
    std::unique_lock<std::mutex> lock(peer.send_mutex);
    if (peer.send_closed) {
      std::string reason = peer.send_closed_reason;
      lock.unlock();
      work->finish(
          Status{StatusCode::kCommError, concat("cannot ", info.describe(), ": ", reason)});
      return;
    }
    if (peer.sends.empty()) {
      const size_t total = sizeof(FrameHeader) + info.bytes;
      const size_t written = write_now(peer, *work, 0);
      if (written == total) {
        lock.unlock();
        work->finish(Status{});
        return;
      }
      peer.front_offset = written;
      peer.writing = true;
      kick = true;
    }
    peer.sends.push_back(work);
  }
  if (kick) {
    asio::post(io, [self = shared_from_this(), p = &peer] { self->write_next(*p); });
  }
}

void TcpCore::post_recv(std::shared_ptr<TcpWork> work) {
  asio::post(io, [self = shared_from_this(), work = std::move(work)] {
    try {
      self->do_recv(work);
    } catch (const std::exception& e) {
      work->finish(
          Status{StatusCode::kCommError, concat(work->info().describe(), " failed: ", e.what())});
    }
  });
}

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
    read_header(*peer);
  }
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

size_t TcpCore::write_now(Peer& peer, TcpWork& work, size_t offset) {
  std::vector<iovec> iov;
  frame_buffers(work, offset, iov, [](const uint8_t* p, size_t n) {
    return iovec{const_cast<uint8_t*>(p), n};
  });
  if (iov.size() > 64) return 0;  // leave exotic gathers to asio
  msghdr message{};
  message.msg_iov = iov.data();
  message.msg_iovlen = iov.size();
  ssize_t n;
  do {
    n = ::sendmsg(peer.socket.native_handle(), &message, MSG_DONTWAIT | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n > 0 ? static_cast<size_t>(n) : 0;
}

void TcpCore::write_next(Peer& peer) {
  std::vector<asio::const_buffer> buffers;
  {
    std::lock_guard<std::mutex> lock(peer.send_mutex);
    if (peer.sends.empty() || peer.send_closed) return;
    frame_buffers(*peer.sends.front(), peer.front_offset, buffers,
                  [](const uint8_t* p, size_t n) { return asio::const_buffer(p, n); });
  }
  asio::async_write(peer.socket, buffers,
                    [self = shared_from_this(), p = &peer](const error_code& ec, size_t) {
                      self->guard_peer(
                          *p, [&] { return concat("sending to rank ", p->rank); },
                          [&] { self->on_write(*p, ec); });
                    });
}

void TcpCore::on_write(Peer& peer, const error_code& ec) {
  if (peer.broken) return;  // already failed (and the queue emptied) by fail_peer
  if (ec) {
    fail_peer(peer, StatusCode::kCommError,
              concat("sending to rank ", peer.rank, " failed (", ec.message(), ")"));
    return;
  }
  std::shared_ptr<TcpWork> done;
  bool more = false;
  {
    std::lock_guard<std::mutex> lock(peer.send_mutex);
    done = std::move(peer.sends.front());
    peer.sends.pop_front();
    peer.front_offset = 0;
    more = !peer.sends.empty();
    peer.writing = more;
    if (!more && closing_) shut_send_locked(peer);
  }
  done->finish(Status{});
  if (more) write_next(peer);
}

void TcpCore::shut_send_locked(Peer& peer) {
  if (peer.send_shut) return;
  peer.send_shut = true;
  if (!peer.send_closed) {
    peer.send_closed = true;
    peer.send_closed_reason = "the transport is shutting down";
  }
  error_code ignored;
  peer.socket.shutdown(tcp::socket::shutdown_send, ignored);
}

void TcpCore::refuse_peer(Peer& peer, const std::string& what) {
  if (!peer.broken) peer.refused = true;
  fail_peer(peer, StatusCode::kCommError, what);
}

std::string TcpCore::frame_what(const Peer& peer) const {
  return concat("receiving a frame of ", peer.in_header.size, " bytes with tag ",
                peer.in_header.tag, " from rank ", peer.rank);
}

void TcpCore::do_recv(const std::shared_ptr<TcpWork>& work) {
  const WorkInfo& info = work->info();
  Peer& peer = *peers[static_cast<size_t>(info.peer)];
  auto unexpected = peer.unexpected.find(info.tag);
  if (unexpected != peer.unexpected.end() && !unexpected->second.empty()) {
    Buffer buffer = std::move(unexpected->second.front());
    unexpected->second.pop_front();
    complete_from_buffer(work, buffer, buffer.size());
    return;
  }
  if (peer.payload_in_flight && !peer.reading && peer.in_header.tag == info.tag) {
    // The next message for this tag is arriving right now into a Buffer: it is ours.
    peer.reading = work;
    return;
  }
  if (peer.broken || peer.eof) {
    work->finish(
        Status{StatusCode::kCommError, recv_failure_message(peer, info, peer.broken_reason)});
    return;
  }
  peer.posted[info.tag].push_back(work);
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

void TcpCore::read_header(Peer& peer) {
  asio::async_read(peer.socket, asio::buffer(&peer.in_header, sizeof(FrameHeader)),
                   [self = shared_from_this(), p = &peer](const error_code& ec, size_t) {
                     self->guard_peer(
                         *p, [&] { return self->frame_what(*p); },
                         [&] { self->on_header(*p, ec); });
                   });
}

void TcpCore::on_header(Peer& peer, const error_code& ec) {
  if (ec) return on_read_error(peer, ec);
  if (peer.in_header.magic != kFrameMagic) {
    refuse_peer(peer, concat("corrupt stream from rank ", peer.rank,
                             " (bad frame header); is another program connected to this port?"));
    return;
  }
  const int tag = peer.in_header.tag;
  // Checked before anything is allocated or read: the size is whatever the peer wrote.
  if (peer.in_header.size > max_message_bytes_) {
    refuse_peer(peer,
                concat("rank ", peer.rank, " sent a frame of ", peer.in_header.size,
                       " bytes with tag ", tag, " to rank ", rank_, ", more than the limit of ",
                       max_message_bytes_, " bytes (TransportOptions::max_message_bytes); rank ",
                       rank_, " closed the connection to rank ", peer.rank,
                       ". Either the stream is corrupt or a program other than pipemat is "
                       "connected; if the message is genuine, raise max_message_bytes on the "
                       "receiving rank"));
    return;
  }
  const size_t size = static_cast<size_t>(peer.in_header.size);
  std::vector<asio::mutable_buffer> buffers;
  auto& queue = peer.posted[tag];
  peer.reading = nullptr;
  peer.reading_buffer = Buffer();
  if (!queue.empty()) {
    peer.reading = std::move(queue.front());
    queue.pop_front();
    const WorkInfo& info = peer.reading->info();
    if (info.any_size || info.bytes != size) {
      peer.reading_buffer = Buffer::allocate(size);
      buffers.emplace_back(peer.reading_buffer.data(), size);
    } else {
      for (const auto& span : peer.reading->recv_spans) {
        if (span.size) buffers.emplace_back(span.data, span.size);
      }
    }
  } else {
    peer.reading_buffer = Buffer::allocate(size);
    buffers.emplace_back(peer.reading_buffer.data(), size);
  }
  if (size == 0) return on_payload(peer, error_code());
  peer.payload_in_flight = true;
  asio::async_read(peer.socket, buffers,
                   [self = shared_from_this(), p = &peer](const error_code& payload_ec, size_t) {
                     self->guard_peer(
                         *p, [&] { return self->frame_what(*p); },
                         [&] { self->on_payload(*p, payload_ec); });
                   });
}

void TcpCore::on_payload(Peer& peer, const error_code& ec) {
  peer.payload_in_flight = false;
  if (ec) return on_read_error(peer, ec);
  const size_t size = peer.in_header.size;
  auto work = std::move(peer.reading);
  Buffer buffer = std::move(peer.reading_buffer);
  peer.reading = nullptr;
  peer.reading_buffer = Buffer();
  if (work) {
    if (buffer.data() != nullptr) {
      complete_from_buffer(work, buffer, size);
    } else {
      work->set_received(size);
      work->finish(Status{});
    }
  } else {
    peer.unexpected[peer.in_header.tag].push_back(std::move(buffer));
  }
  read_header(peer);
}

void TcpCore::on_read_error(Peer& peer, const error_code& ec) {
  if (peer.broken) return;
  if (ec == asio::error::eof) {
    peer.eof = true;
    fail_peer(peer, StatusCode::kCommError,
              concat("rank ", peer.rank,
                     " closed the connection (its transport was destroyed or its process "
                     "exited)"),
              closing_);
    return;
  }
  fail_peer(peer, StatusCode::kCommError,
            concat("the connection to rank ", peer.rank, " failed (", ec.message(), ")"), closing_);
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
