// The send path of the tcp backend's I/O core: a frame written straight from the caller's
// thread (Note [Direct send]) or queued and written by the I/O thread, and the half-close of a
// connection's send side.

#include "tcp/core.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>

#include "common.h"

namespace pipemat::comm::detail::tcp {

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
  if (n < 0 && errno == ECONNRESET) peer.direct_send_reset = true;
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

}  // namespace pipemat::comm::detail::tcp
