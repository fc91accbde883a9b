#pragma once
// The I/O core of the tcp backend (private): the Work of a tcp message, the state of one peer
// connection, and TcpCore, which runs every connection of a transport on one Asio I/O thread.
//
// Data path (one I/O thread): every message is a 16-byte frame header (magic, tag, size) plus the
// payload. Each peer connection has a FIFO of sends (one async_write at a time, header and payload
// gathered) and a read loop. A header is matched against the receives posted for its tag: a
// match with the right size is read straight into the caller's memory; otherwise the payload goes
// into a Buffer (unexpected message, any-size receive or size mismatch). All peer state is touched
// only on the I/O thread; handlers carry error codes as values and the Work turns them into
// exceptions at wait() (Note [Work contract]). The I/O thread also sends each idle connection a
// heartbeat frame (magic "PMB1", no payload) every TransportOptions::heartbeat_interval, and the
// read loop notes when any frame of a peer arrived (Note [Liveness of a peer]).
//
// TcpCore's members live in three files: tcp/core.cpp (the I/O thread, aborts, failing and
// shutting down peers), tcp/core_send.cpp (the send path) and tcp/core_recv.cpp (the read loop).

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "pipemat/comm/transport.h"
#include "pipemat/comm/work.h"
#include "tcp/asio.h"
#include "tcp/wire.h"

namespace pipemat::comm::detail::tcp {

class TcpCore;

class TcpWork final : public SpanWork {
 public:
  TcpWork(WorkInfo info, std::chrono::milliseconds timeout, std::weak_ptr<TcpCore> core)
      : SpanWork(std::move(info), timeout), core_(std::move(core)) {}

  FrameHeader header;

 protected:
  void abort_impl(const Status& reason) noexcept override;
  // Note [Liveness of a peer]: from TcpCore::clocks.
  std::optional<Clock::duration> peer_silence() const override;

 private:
  std::weak_ptr<TcpCore> core_;
};

struct Peer {
  explicit Peer(int peer_rank, tcp::socket peer_socket)
      : rank(peer_rank), socket(std::move(peer_socket)) {}
  int rank;
  tcp::socket socket;
  bool broken = false;
  std::string broken_reason;
  // The failure was this side refusing what the peer sent (not the peer going away): receives
  // then report it as such instead of suggesting that the peer crashed.
  bool refused = false;
  bool eof = false;
  // A direct send (write_now, on a user thread) found the connection reset. The kernel reports
  // a reset to the first call that asks: when a direct send took it, the I/O thread's read then
  // sees only the end of the stream, and the reset must not be reported as an orderly close.
  std::atomic<bool> direct_send_reset{false};
  // Send side, shared by user threads (direct write) and the I/O thread; guarded by send_mutex.
  // Invariant: `sends` is non-empty exactly when `writing` (the I/O thread owns the stream).
  std::mutex send_mutex;
  bool send_closed = false;  // broken or shut down: no more sends
  std::string send_closed_reason;
  bool send_shut = false;
  std::deque<std::shared_ptr<TcpWork>> sends;
  bool writing = false;
  size_t front_offset = 0;  // bytes of sends.front() already written directly
  // receive side
  FrameHeader in_header;
  std::map<int, std::deque<std::shared_ptr<TcpWork>>> posted;
  std::map<int, std::deque<Buffer>> unexpected;
  bool payload_in_flight = false;
  std::shared_ptr<TcpWork> reading;  // the receive the payload in flight belongs to, if any
  Buffer reading_buffer;             // where the payload goes unless straight into `reading`
};

// The error of a receive from `peer` whose connection failed with `what`: the peer failure
// message, or "<info> failed: <what>" when this side refused what the peer sent.
std::string recv_failure_message(const Peer& peer, const WorkInfo& info, const std::string& what);

class TcpCore : public std::enable_shared_from_this<TcpCore> {
 public:
  TcpCore(int rank, int world_size, size_t max_message_bytes, Clock::duration beat_interval)
      : clocks(world_size),
        rank_(rank),
        max_message_bytes_(max_message_bytes),
        beat_interval_(beat_interval),
        beat_timer_(io) {
    peers.resize(static_cast<size_t>(world_size));
  }

  asio::io_context io;
  // Note [Liveness of a peer] (pipemat/comm/work.h): when a frame (a message or a heartbeat) from
  // each peer last began or ended; the connection's start counts. Written by the I/O thread,
  // read by waits.
  PeerClocks clocks;
  std::vector<std::unique_ptr<Peer>> peers;  // peers[rank]; null for self

  // ---- called from user threads ----
  // Note [Direct send]
  // When nothing is queued for the peer, the caller's thread writes the frame itself with a
  // non-blocking sendmsg (one thread hop less for small messages); what does not fit into the
  // socket buffer is finished by the I/O thread. The stream is written by at most one party at a
  // time (send_mutex + the `writing` invariant).
  void post_send(const std::shared_ptr<TcpWork>& work);
  void post_recv(std::shared_ptr<TcpWork> work);

  // Runs `fn` on the I/O thread and waits for it; runs nothing once the thread has stopped.
  // An exception of `fn` is rethrown here, on the caller's thread (the caller must not wait
  // forever for a promise the I/O thread abandoned).
  bool run_on_io(std::function<void()> fn);

  void abort(TcpWork* work, const Status& reason);

  void start();

  // Clean shutdown: drain sends, half-close, wait (bounded) for the peers to close, then stop.
  void shutdown(std::chrono::milliseconds linger) noexcept;

 private:
  // The frame of `work` from byte `offset` on, as iovecs / asio buffers.
  template <typename Buffers, typename Make>
  static void frame_buffers(TcpWork& work, size_t offset, Buffers& out, Make make);

  // Non-blocking write attempt under send_mutex; returns the bytes written (0 on EAGAIN or on
  // an error, which the I/O thread's write then reports).
  static size_t write_now(Peer& peer, TcpWork& work, size_t offset);

  // Note [Liveness of a peer]: every beat_interval_, a heartbeat frame to each peer whose send
  // queue is empty (the queued messages' frames tell the peer as much). The peer notes a frame
  // where it begins and ends: one frame that takes longer than the timeout to arrive (a slow
  // link, a huge message) counts as silence meanwhile.
  void schedule_beat();
  void beat();

  void write_next(Peer& peer);
  void on_write(Peer& peer, const error_code& ec);
  void shut_send_locked(Peer& peer);

  // Runs a handler of `peer`'s connection. An exception fails that peer (its pending and later
  // operations get the error) instead of vanishing in the I/O loop and leaving them to time out.
  // `doing()` describes the handler for the message (built only on failure: hot path).
  template <typename Doing, typename Fn>
  void guard_peer(Peer& peer, Doing&& doing, Fn&& fn);

  // Fails `peer` because of what it sent or what handling it caused (not because it went away).
  void refuse_peer(Peer& peer, const std::string& what);

  std::string frame_what(const Peer& peer) const;

  void do_recv(const std::shared_ptr<TcpWork>& work);
  void do_abort(TcpWork* work, const Status& reason);
  void read_header(Peer& peer);
  void on_header(Peer& peer, const error_code& ec);
  void on_payload(Peer& peer, const error_code& ec);
  void on_read_error(Peer& peer, const error_code& ec);

  // Marks the connection dead and fails everything queued on it. With `shutdown` (our own
  // transport is closing) pending work gets the shutdown message instead.
  void fail_peer(Peer& peer, StatusCode code, const std::string& what, bool shutdown = false);

  const int rank_;  // this rank
  const size_t max_message_bytes_;
  const Clock::duration beat_interval_;
  asio::steady_timer beat_timer_;  // I/O thread only
  bool closing_ = false;           // I/O thread only
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard_;
  std::thread thread_;
  std::mutex state_mutex_;
  std::condition_variable state_cv_;
  bool running_ = false;
  bool all_closed_ = false;
};

// Defined here: handlers of the send path and of the read loop both run under it.
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

}  // namespace pipemat::comm::detail::tcp
