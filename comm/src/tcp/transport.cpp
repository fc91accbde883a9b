// TCP backend on Boost.Asio.
//
// Rendezvous (constructor, on the calling thread): rank 0 listens on the master host:port (that
// address only); every other rank connects to the master, opens its own listener on the local
// address of that connection and says hello (rank, world size, listen port); rank 0 answers with
// the table of all listeners. Then rank r connects to every rank 0 < s < r and accepts from
// every rank above it: exactly one connection per pair. Every connection starts with the
// authenticated handshake of Note [Rendezvous handshake].
//
// Data path (one I/O thread): every message is a 16-byte frame header (magic, tag, size) plus the
// payload. Each peer connection has a FIFO of sends (one async_write at a time, header and payload
// gathered) and a read loop. A header is matched against the receives posted for its tag: a
// match with the right size is read straight into the caller's memory; otherwise the payload goes
// into a Buffer (unexpected message, any-size receive or size mismatch). All peer state is touched
// only on the I/O thread; handlers carry error codes as values and the Work turns them into
// exceptions at wait() (Note [Work contract]).

#include "tcp/transport.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common.h"
#include "pipemat/comm/raw_bench.h"
#include "pipemat/core/error.h"
#include "tcp/hmac.h"

namespace pipemat::comm::detail {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

constexpr uint32_t kFrameMagic = 0x504d4331;      // "PMC1"
constexpr uint32_t kHelloMagicV1 = 0x504d4831;    // "PMH1": the unauthenticated hello before v2
constexpr uint32_t kHelloMagic = 0x504d4832;      // "PMH2"
constexpr uint32_t kChallengeMagic = 0x504d4e31;  // "PMN1"
constexpr uint32_t kAckMagic = 0x504d4131;        // "PMA1"
constexpr uint32_t kProtocolVersion = 2;
constexpr uint32_t kHasSecret = 1;  // flag: the sender has a job secret
constexpr size_t kNonceBytes = 32;

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  int32_t tag = 0;
  uint64_t size = 0;
};
static_assert(sizeof(FrameHeader) == 16, "frame header layout");

// Note [Rendezvous handshake]: every rendezvous connection (to the master and between ranks)
// is a challenge-response keyed with the job secret (TransportOptions::secret):
//   acceptor  -> Challenge {fresh random nonce N_a}
//   connector -> Hello {rank, world size, listen port, nonce N_c,
//                       mac = HMAC-SHA256(secret, "pipemat hello" || N_a || hello fields)}
//   acceptor  -> Ack {status, mac = HMAC-SHA256(secret, "pipemat ack" || N_c || N_a || rank ||
//                                               status)}
// The acceptor's fresh nonce makes a recorded hello useless later; the connector's nonce makes
// the acceptor prove the secret too, so a process squatting on the master port cannot pose as
// rank 0. The secret itself never goes over the wire. Without a secret the key is empty: the
// same exchange, checking nothing but the protocol (any local process may join; documented).
// The acceptor handles each connection on its own with a short deadline: a connection that is
// silent, sends garbage or fails a check is closed and reported on stderr, and the rendezvous
// goes on, except for an authenticated rank with another world size (a real misconfiguration).
struct Challenge {
  uint32_t magic = kChallengeMagic;
  uint32_t version = kProtocolVersion;
  uint32_t flags = 0;
  uint32_t reserved = 0;
  uint8_t nonce[kNonceBytes] = {};
};
static_assert(sizeof(Challenge) == 48, "challenge layout");

struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t version = kProtocolVersion;
  int32_t rank = -1;
  int32_t world_size = -1;
  uint32_t listen_port = 0;
  uint32_t flags = 0;
  uint8_t nonce[kNonceBytes] = {};
  uint8_t mac[32] = {};  // last: the mac covers everything before it
};
static_assert(sizeof(Hello) == 88 && offsetof(Hello, mac) == 56, "hello layout");

enum class AckStatus : uint32_t {
  kOk = 0,
  kWrongSecret = 1,
  kWorldSize = 2,
  kBadRank = 3,
  kDuplicateRank = 4,
  kBadProtocol = 5,
};

struct Ack {
  uint32_t magic = kAckMagic;
  uint32_t status = 0;
  uint8_t mac[32] = {};
};
static_assert(sizeof(Ack) == 40, "ack layout");

Digest hello_mac(const std::string& secret, const Challenge& challenge, const Hello& hello) {
  HmacSha256 mac(secret);
  mac.update("pipemat hello", 13);
  mac.update(challenge.nonce, kNonceBytes);
  mac.update(&hello, offsetof(Hello, mac));
  return mac.finish();
}

Digest ack_mac(const std::string& secret, const Challenge& challenge, const Hello& hello,
               uint32_t status) {
  HmacSha256 mac(secret);
  mac.update("pipemat ack", 11);
  mac.update(hello.nonce, kNonceBytes);
  mac.update(challenge.nonce, kNonceBytes);
  mac.update(&hello.rank, sizeof(hello.rank));
  mac.update(&status, sizeof(status));
  return mac.finish();
}

void fill_nonce(uint8_t* out) {
  size_t filled = 0;
  while (filled < kNonceBytes) {
    const ssize_t n = ::getrandom(out + filled, kNonceBytes - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    PIPEMAT_CHECK(n > 0, CommError, "tcp rendezvous: getrandom() failed (", std::strerror(errno),
                  "); cannot make a handshake nonce");
    filled += static_cast<size_t>(n);
  }
}

std::string secret_state(bool has_secret) { return has_secret ? "a job secret" : "no job secret"; }

struct TableEntry {
  uint32_t port = 0;
  char host[60] = {};
};
static_assert(sizeof(TableEntry) == 64, "table entry layout");

std::pair<std::string, uint16_t> parse_master(const std::string& master) {
  auto colon = master.rfind(':');
  PIPEMAT_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < master.size(), ConfigError,
                "tcp transport: master address '", master,
                "' is not host:port (e.g. 127.0.0.1:29500); set --master or PIPEMAT_MASTER");
  std::string host = master.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::string port_text = master.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  PIPEMAT_CHECK(*end == '\0' && port > 0 && port < 65536, ConfigError, "tcp transport: port '",
                port_text, "' in master address '", master, "' is not a port number 1..65535");
  return {host, static_cast<uint16_t>(port)};
}

class TcpCore;

class TcpWork final : public Work {
 public:
  TcpWork(WorkInfo info, std::chrono::milliseconds timeout, std::weak_ptr<TcpCore> core)
      : Work(std::move(info), timeout), core_(std::move(core)) {}

  std::vector<ConstSpan> send_spans;
  std::vector<MutableSpan> recv_spans;
  FrameHeader header;

 protected:
  void abort_impl(const Status& reason) noexcept override;

 private:
  std::weak_ptr<TcpCore> core_;
};

struct Peer {
  explicit Peer(int rank, tcp::socket socket) : rank(rank), socket(std::move(socket)) {}
  int rank;
  tcp::socket socket;
  bool broken = false;
  std::string broken_reason;
  // The failure was this side refusing what the peer sent (not the peer going away): receives
  // then report it as such instead of suggesting that the peer crashed.
  bool refused = false;
  bool eof = false;
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

class TcpCore : public std::enable_shared_from_this<TcpCore> {
 public:
  TcpCore(int rank, int world_size, size_t max_message_bytes)
      : rank_(rank), max_message_bytes_(max_message_bytes) {
    peers.resize(static_cast<size_t>(world_size));
  }

  asio::io_context io;
  std::vector<std::unique_ptr<Peer>> peers;  // peers[rank]; null for self

  // ---- called from user threads ----
  // Note [Direct send]: when nothing is queued for the peer, the caller's thread writes the
  // frame itself with a non-blocking sendmsg (one thread hop less for small messages); what
  // does not fit into the socket buffer is finished by the I/O thread. The stream is written by
  // at most one party at a time (send_mutex + the `writing` invariant).
  void post_send(const std::shared_ptr<TcpWork>& work) {
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
  void post_recv(std::shared_ptr<TcpWork> work) {
    asio::post(io, [self = shared_from_this(), work = std::move(work)] {
      try {
        self->do_recv(work);
      } catch (const std::exception& e) {
        work->finish(
            Status{StatusCode::kCommError, concat(work->info().describe(), " failed: ", e.what())});
      }
    });
  }

  // Runs `fn` on the I/O thread and waits for it; runs nothing once the thread has stopped.
  // An exception of `fn` is rethrown here, on the caller's thread (the caller must not wait
  // forever for a promise the I/O thread abandoned).
  bool run_on_io(std::function<void()> fn) {
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

  void abort(TcpWork* work, const Status& reason) {
    bool ran = run_on_io([&] { do_abort(work, reason); });
    if (!ran) work->finish(reason);
  }

  void start() {
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

  // Clean shutdown: drain sends, half-close, wait (bounded) for the peers to close, then stop.
  void shutdown(std::chrono::milliseconds linger) noexcept {
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

 private:
  // The frame of `work` from byte `offset` on, as iovecs / asio buffers.
  template <typename Buffers, typename Make>
  static void frame_buffers(TcpWork& work, size_t offset, Buffers& out, Make make) {
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

  // Non-blocking write attempt under send_mutex; returns the bytes written (0 on EAGAIN or on
  // an error, which the I/O thread's write then reports).
  static size_t write_now(Peer& peer, TcpWork& work, size_t offset) {
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

  void write_next(Peer& peer) {
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

  void on_write(Peer& peer, const error_code& ec) {
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

  void shut_send(Peer& peer) {
    std::lock_guard<std::mutex> lock(peer.send_mutex);
    shut_send_locked(peer);
  }

  void shut_send_locked(Peer& peer) {
    if (peer.send_shut) return;
    peer.send_shut = true;
    if (!peer.send_closed) {
      peer.send_closed = true;
      peer.send_closed_reason = "the transport is shutting down";
    }
    error_code ignored;
    peer.socket.shutdown(tcp::socket::shutdown_send, ignored);
  }

  // Runs a handler of `peer`'s connection. An exception fails that peer (its pending and later
  // operations get the error) instead of vanishing in the I/O loop and leaving them to time out.
  // `doing()` describes the handler for the message (built only on failure: hot path).
  template <typename Doing, typename Fn>
  void guard_peer(Peer& peer, Doing&& doing, Fn&& fn) {
    try {
      fn();
    } catch (const std::bad_alloc&) {
      refuse_peer(peer,
                  concat("rank ", rank_, " ran out of memory ", doing(), " (std::bad_alloc); rank ",
                         rank_, " closed the connection to rank ", peer.rank,
                         ". Lower TransportOptions::max_message_bytes (now ", max_message_bytes_,
                         " bytes) to refuse such messages up front, or send smaller ones"));
    } catch (const std::exception& e) {
      refuse_peer(peer, concat("rank ", rank_, " failed ", doing(), " (", e.what(), "); rank ",
                               rank_, " closed the connection to rank ", peer.rank));
    }
  }

  // Fails `peer` because of what it sent or what handling it caused (not because it went away).
  void refuse_peer(Peer& peer, const std::string& what) {
    if (!peer.broken) peer.refused = true;
    fail_peer(peer, StatusCode::kCommError, what);
  }

  std::string frame_what(const Peer& peer) const {
    return concat("receiving a frame of ", peer.in_header.size, " bytes with tag ",
                  peer.in_header.tag, " from rank ", peer.rank);
  }

  void do_recv(const std::shared_ptr<TcpWork>& work) {
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

  void do_abort(TcpWork* work, const Status& reason) {
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

  void read_header(Peer& peer) {
    asio::async_read(peer.socket, asio::buffer(&peer.in_header, sizeof(FrameHeader)),
                     [self = shared_from_this(), p = &peer](const error_code& ec, size_t) {
                       self->guard_peer(
                           *p, [&] { return self->frame_what(*p); },
                           [&] { self->on_header(*p, ec); });
                     });
  }

  void on_header(Peer& peer, const error_code& ec) {
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
    asio::async_read(
        peer.socket, buffers, [self = shared_from_this(), p = &peer](const error_code& ec, size_t) {
          self->guard_peer(
              *p, [&] { return self->frame_what(*p); }, [&] { self->on_payload(*p, ec); });
        });
  }

  void on_payload(Peer& peer, const error_code& ec) {
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

  void on_read_error(Peer& peer, const error_code& ec) {
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
              concat("the connection to rank ", peer.rank, " failed (", ec.message(), ")"),
              closing_);
  }

  // Marks the connection dead and fails everything queued on it. With `shutdown` (our own
  // transport is closing) pending work gets the shutdown message instead.
  void fail_peer(Peer& peer, StatusCode code, const std::string& what, bool shutdown = false) {
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

  const int rank_;  // this rank
  const size_t max_message_bytes_;
  bool closing_ = false;  // I/O thread only
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard_;
  std::thread thread_;
  std::mutex state_mutex_;
  std::condition_variable state_cv_;
  bool running_ = false;
  bool all_closed_ = false;
};

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

// Blocking rendezvous steps on the io_context of the core, each bounded by one deadline.
class Rendezvous {
 public:
  Rendezvous(asio::io_context& io, const TransportOptions& options)
      : io_(io), options_(options), deadline_(Clock::now() + options.timeout) {}

  // Runs an async operation to completion; throws TimeoutError at the deadline.
  template <typename Start, typename Cancel>
  error_code await(Start&& start, Cancel&& cancel, const std::string& what,
                   Clock::time_point deadline) {
    bool done = false;
    error_code result;
    start([&](const error_code& ec, auto&&...) {
      result = ec;
      done = true;
    });
    io_.restart();
    while (!done) {
      io_.run_one_until(deadline);
      if (!done && Clock::now() >= deadline) {
        cancel();
        io_.restart();
        while (!done) io_.run_one();  // NOLINT(bugprone-infinite-loop): set by the handler
        if (result == asio::error::operation_aborted) result = asio::error::timed_out;
        return result;
      }
    }
    return result;
  }

  template <typename Start, typename Cancel>
  error_code await(Start&& start, Cancel&& cancel, const std::string& what) {
    return await(std::forward<Start>(start), std::forward<Cancel>(cancel), what, deadline_);
  }

  [[noreturn]] void fail(const std::string& what, const error_code& ec) const {
    if (ec == asio::error::timed_out || Clock::now() >= deadline_) {
      PIPEMAT_THROW(TimeoutError, "tcp rendezvous of rank ", options_.rank, " (world size ",
                    options_.world_size, ", master ", options_.master, ") timed out after ",
                    options_.timeout.count(), " ms ", what,
                    ". Start every rank with the same PIPEMAT_WORLD_SIZE, PIPEMAT_MASTER and "
                    "PIPEMAT_JOB_SECRET, or raise the timeout (PIPEMAT_COMM_TIMEOUT).");
    }
    PIPEMAT_THROW(CommError, "tcp rendezvous of rank ", options_.rank, " failed ", what, ": ",
                  ec.message());
  }

  tcp::socket connect(const std::string& host, uint16_t port, const std::string& whom) {
    error_code last;
    const auto start = Clock::now();
    int attempt = 0;
    for (attempt = 1; attempt <= options_.connect_retries; ++attempt) {
      tcp::resolver resolver(io_);
      error_code ec;
      auto endpoints = resolver.resolve(host, std::to_string(port), ec);
      if (!ec) {
        for (const auto& entry : endpoints) {
          tcp::socket socket(io_);
          ec = await([&](auto handler) { socket.async_connect(entry.endpoint(), handler); },
                     [&] {
                       error_code ignored;
                       socket.close(ignored);
                     },
                     "connecting");
          if (!ec) {
            socket.set_option(tcp::no_delay(true));
            return socket;
          }
          if (Clock::now() >= deadline_) break;
        }
      }
      last = ec;
      if (attempt == options_.connect_retries ||
          Clock::now() + options_.connect_retry_interval >= deadline_) {
        break;
      }
      std::this_thread::sleep_for(options_.connect_retry_interval);
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    PIPEMAT_THROW(CommError, "tcp transport: rank ", options_.rank, " could not connect to ", whom,
                  " at ", host, ":", port, " after ", std::min(attempt, options_.connect_retries),
                  " attempts over ", static_cast<int>(seconds * 10) / 10.0,
                  " s (last error: ", last.message(),
                  "). Check that rank 0 is running, that --master / PIPEMAT_MASTER names its "
                  "host:port, and that the port is reachable.");
  }

  void write(tcp::socket& socket, const void* data, size_t size, const std::string& what) {
    auto ec =
        await([&](auto handler) { asio::async_write(socket, asio::buffer(data, size), handler); },
              [&] {
                error_code ignored;
                socket.close(ignored);
              },
              what);
    if (ec) fail(what, ec);
  }

  void read(tcp::socket& socket, void* data, size_t size, const std::string& what) {
    auto ec =
        await([&](auto handler) { asio::async_read(socket, asio::buffer(data, size), handler); },
              [&] {
                error_code ignored;
                socket.close(ignored);
              },
              what);
    if (ec) fail(what, ec);
  }

  tcp::socket accept(tcp::acceptor& acceptor, const std::string& what) {
    tcp::socket socket(io_);
    auto ec = await([&](auto handler) { acceptor.async_accept(socket, handler); },
                    [&] {
                      error_code ignored;
                      acceptor.close(ignored);
                    },
                    what);
    if (ec) fail(what, ec);
    socket.set_option(tcp::no_delay(true));
    return socket;
  }

  // A rank that completed the handshake on an acceptor.
  struct Joined {
    Hello hello;
    tcp::socket socket;
    std::string address;  // the address its connection comes from (no port)
  };

  // Accepts on `acceptor` until every rank lo..hi completed the handshake (Note [Rendezvous
  // handshake]); each connection is handled on its own with the handshake deadline, and one that
  // fails is dropped and reported on stderr. Throws TimeoutError at the rendezvous deadline
  // (naming the missing ranks and the last dropped connection), CommError for an authenticated
  // rank with another world size or a failing acceptor.
  std::vector<Joined> accept_ranks(tcp::acceptor& acceptor, int lo, int hi,
                                   const std::string& to_where) {
    struct Incoming {
      explicit Incoming(asio::io_context& io) : socket(io), timer(io) {}
      tcp::socket socket;
      asio::steady_timer timer;
      std::string from = "an unknown address";
      std::string address;  // `from` without the port
      Challenge challenge;
      Hello hello;
      Ack ack;
      int claimed = -1;       // the rank it holds while its ack is being written
      bool finished = false;  // joined or dropped
    };
    const int count = hi - lo + 1;
    const bool has_secret = !options_.secret.empty();
    const auto handshake_timeout = std::min(options_.handshake_timeout, options_.timeout);
    std::vector<Joined> joined;
    std::vector<bool> claimed(static_cast<size_t>(options_.world_size), false);
    std::vector<std::shared_ptr<Incoming>> incoming;
    std::string fatal;
    error_code accept_error;
    int dropped = 0;
    std::string last_drop;

    auto drop = [&](Incoming& in, const std::string& reason) {
      if (in.finished) return;
      in.finished = true;
      if (in.claimed >= 0) claimed[static_cast<size_t>(in.claimed)] = false;
      in.timer.cancel();
      ++dropped;
      last_drop = concat("from ", in.from, ": ", reason);
      std::fprintf(stderr,
                   "pipemat tcp: rank %d dropped a connection from %s during rendezvous: %s\n",
                   options_.rank, in.from.c_str(), reason.c_str());
    };
    auto close = [](Incoming& in) {
      error_code ignored;
      in.socket.close(ignored);
    };

    auto judge = [&](const std::shared_ptr<Incoming>& in) {
      const Hello& h = in->hello;
      AckStatus status = AckStatus::kOk;
      std::string reason;
      if (h.magic == kHelloMagicV1) {
        status = AckStatus::kBadProtocol;
        reason =
            "it speaks the unauthenticated rendezvous of an older pipemat (hello version 1); "
            "start every rank from the same pipemat build";
      } else if (h.magic != kHelloMagic) {
        status = AckStatus::kBadProtocol;
        reason = "not a pipemat hello (bad magic); is another program connecting to this port?";
      } else if (h.version != kProtocolVersion) {
        status = AckStatus::kBadProtocol;
        reason = concat("rendezvous protocol version ", h.version, ", expected ", kProtocolVersion,
                        "; start every rank from the same pipemat build");
      } else if (const Digest mac = hello_mac(options_.secret, in->challenge, h);
                 !equal_digest(mac.data(), h.mac, mac.size())) {
        status = AckStatus::kWrongSecret;
        reason = "wrong job secret";
        if (((h.flags & kHasSecret) != 0) != has_secret) {
          reason += concat(" (it has ", secret_state((h.flags & kHasSecret) != 0), ", rank ",
                           options_.rank, " has ", secret_state(has_secret), ")");
        }
      } else if (h.world_size != options_.world_size) {
        status = AckStatus::kWorldSize;
        reason = concat("rank ", h.rank, " was started with world size ", h.world_size);
        fatal =
            concat("tcp rendezvous: rank ", h.rank, " was started with world size ", h.world_size,
                   " but rank ", options_.rank, " with world size ", options_.world_size,
                   "; start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");
      } else if (h.rank < lo || h.rank > hi) {
        status = AckStatus::kBadRank;
        reason = concat("it announced rank ", h.rank, ", but rank ", options_.rank,
                        " accepts only ranks ", lo, "..", hi, " here");
      } else if (claimed[static_cast<size_t>(h.rank)]) {
        status = AckStatus::kDuplicateRank;
        reason = concat("it claims rank ", h.rank,
                        ", which another process already holds; give every process a distinct "
                        "PIPEMAT_RANK / --rank");
      }
      in->ack.status = static_cast<uint32_t>(status);
      if (status != AckStatus::kOk) {
        // The refusal tells a misconfigured rank why at once; it reveals nothing of the secret.
        drop(*in, reason);
        asio::async_write(in->socket, asio::buffer(&in->ack, sizeof(Ack)),
                          [in, close](const error_code&, size_t) { close(*in); });
        return;
      }
      in->claimed = h.rank;
      claimed[static_cast<size_t>(h.rank)] = true;
      const Digest mac = ack_mac(options_.secret, in->challenge, h, in->ack.status);
      std::memcpy(in->ack.mac, mac.data(), mac.size());
      asio::async_write(in->socket, asio::buffer(&in->ack, sizeof(Ack)),
                        [&, in](const error_code& ec, size_t) {
                          if (in->finished) return;
                          if (ec) {
                            drop(*in, concat("sending the ack failed (", ec.message(), ")"));
                            close(*in);
                            return;
                          }
                          in->finished = true;
                          in->timer.cancel();
                          joined.push_back(Joined{in->hello, std::move(in->socket), in->address});
                        });
    };

    auto handshake = [&](const std::shared_ptr<Incoming>& in) {
      incoming.push_back(in);
      error_code ec;
      const auto remote = in->socket.remote_endpoint(ec);
      if (!ec) {
        in->address = remote.address().to_string();
        in->from = concat(in->address, ":", remote.port());
      }
      in->socket.set_option(tcp::no_delay(true), ec);
      in->challenge.flags = has_secret ? kHasSecret : 0;
      fill_nonce(in->challenge.nonce);
      in->timer.expires_after(handshake_timeout);
      in->timer.async_wait([&, in](const error_code& ec) {
        if (ec || in->finished) return;
        drop(*in, concat("no complete hello within ", handshake_timeout.count(), " ms"));
        close(*in);
      });
      asio::async_write(
          in->socket, asio::buffer(&in->challenge, sizeof(Challenge)),
          [&, in](const error_code& ec, size_t) {
            if (in->finished) return;
            if (ec) {
              drop(*in, concat("sending the challenge failed (", ec.message(), ")"));
              close(*in);
              return;
            }
            asio::async_read(
                in->socket, asio::buffer(&in->hello, sizeof(Hello)),
                [&, in](const error_code& ec, size_t n) {
                  if (in->finished) return;
                  if (ec) {
                    drop(*in, ec == asio::error::eof
                                  ? concat("it closed the connection after ", n, " of the ",
                                           sizeof(Hello), " bytes of a hello")
                                  : concat("reading its hello failed (", ec.message(), ")"));
                    close(*in);
                    return;
                  }
                  judge(in);
                });
          });
    };

    std::function<void()> start_accept = [&] {
      auto in = std::make_shared<Incoming>(io_);
      acceptor.async_accept(in->socket, [&, in](const error_code& ec) {
        if (ec == asio::error::operation_aborted) return;
        if (ec && ec != asio::error::connection_aborted) {
          accept_error = ec;
          return;
        }
        start_accept();
        if (!ec) handshake(in);
      });
    };

    start_accept();
    io_.restart();
    while (static_cast<int>(joined.size()) < count && fatal.empty() && !accept_error &&
           Clock::now() < deadline_) {
      io_.run_one_until(deadline_);
    }
    // Stop what is still in flight and let its handlers run out before the locals they use go.
    error_code ignored;
    acceptor.close(ignored);
    for (auto& in : incoming) {
      if (!in->finished) {
        drop(*in, "the rendezvous ended before it completed its hello");
        close(*in);
      }
      in->timer.cancel();
    }
    io_.restart();
    io_.run();

    if (!fatal.empty()) PIPEMAT_THROW(CommError, fatal);
    if (accept_error) fail(concat("accepting connections", to_where), accept_error);
    if (static_cast<int>(joined.size()) < count) {
      std::string missing;
      for (int r = lo; r <= hi; ++r) {
        if (!claimed[static_cast<size_t>(r)]) missing += (missing.empty() ? "" : ", ") + concat(r);
      }
      std::string what = concat("waiting for ranks ", missing, to_where);
      if (dropped > 0) {
        what += concat(" (dropped ", dropped, dropped == 1 ? " connection" : " connections",
                       " meanwhile, the last ", last_drop, ")");
      }
      fail(what, asio::error::timed_out);
    }
    return joined;
  }

  // The connecting side of Note [Rendezvous handshake] on a fresh connection to `whom` at
  // `address`. Throws CommError when the acceptor refuses the hello or cannot prove the secret.
  void authenticate(tcp::socket& socket, Hello hello, const std::string& whom,
                    const std::string& address) {
    const bool has_secret = !options_.secret.empty();
    Challenge challenge;
    read(socket, &challenge, sizeof(challenge), concat("waiting for the challenge of ", whom));
    PIPEMAT_CHECK(challenge.magic == kChallengeMagic && challenge.version == kProtocolVersion,
                  CommError, "tcp rendezvous: rank ", options_.rank, " connected to ", whom, " at ",
                  address, ", which does not speak the pipemat rendezvous protocol ",
                  kProtocolVersion, "; is another program or an older pipemat listening there?");
    hello.flags = has_secret ? kHasSecret : 0;
    fill_nonce(hello.nonce);
    const Digest mac = hello_mac(options_.secret, challenge, hello);
    std::memcpy(hello.mac, mac.data(), mac.size());
    write(socket, &hello, sizeof(hello), concat("sending a hello to ", whom));
    Ack ack;
    read(socket, &ack, sizeof(ack), concat("waiting for ", whom, " to accept the hello"));
    const std::string prefix =
        concat("tcp rendezvous: ", whom, " at ", address, " refused rank ", options_.rank, ": ");
    PIPEMAT_CHECK(ack.magic == kAckMagic, CommError, prefix,
                  "its answer is not a pipemat ack; is another program listening there?");
    switch (static_cast<AckStatus>(ack.status)) {
      case AckStatus::kOk:
        break;
      case AckStatus::kWrongSecret:
        PIPEMAT_THROW(CommError, prefix, "wrong job secret (this rank has ",
                      secret_state(has_secret), ", there ", secret_state(challenge.flags & 1),
                      "). Start every rank of a job with the same PIPEMAT_JOB_SECRET "
                      "(pipemat-run --tcp sets one per job) or all without one.");
      case AckStatus::kWorldSize:
        PIPEMAT_THROW(CommError, prefix, "it runs a different world size than this rank's ",
                      options_.world_size,
                      "; start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");
      case AckStatus::kBadRank:
        PIPEMAT_THROW(CommError, prefix, "rank ", options_.rank,
                      " is not expected to connect there (check PIPEMAT_RANK / --rank)");
      case AckStatus::kDuplicateRank:
        PIPEMAT_THROW(CommError, prefix, "another process already joined as rank ", options_.rank,
                      "; give every process a distinct PIPEMAT_RANK / --rank");
      default:
        PIPEMAT_THROW(CommError, prefix, "protocol mismatch (status ", ack.status,
                      "); start every rank from the same pipemat build");
    }
    const Digest proof = ack_mac(options_.secret, challenge, hello, ack.status);
    PIPEMAT_CHECK(equal_digest(proof.data(), ack.mac, proof.size()), CommError,
                  "tcp rendezvous: ", whom, " at ", address, " accepted rank ", options_.rank,
                  " but could not prove the job secret: it has a different PIPEMAT_JOB_SECRET, or "
                  "another program is listening on that port");
  }

 private:
  asio::io_context& io_;
  const TransportOptions& options_;
  const Clock::time_point deadline_;
};

// Listens on exactly the configured master host (every address it resolves to that is local).
tcp::acceptor listen_on_master(asio::io_context& io, const std::string& host, uint16_t port,
                               const std::string& master) {
  tcp::resolver resolver(io);
  error_code ec;
  auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  PIPEMAT_CHECK(!ec && !endpoints.empty(), ConfigError, "tcp transport: rank 0 cannot resolve ",
                "the host '", host, "' of master address '", master, "' (", ec.message(),
                "); set --master / PIPEMAT_MASTER to host:port of this machine");
  std::string addresses;
  error_code last;
  bool only_not_local = true;
  for (const auto& entry : endpoints) {
    addresses += (addresses.empty() ? "" : ", ") + entry.endpoint().address().to_string();
    tcp::acceptor acceptor(io);
    acceptor.open(entry.endpoint().protocol(), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(entry.endpoint(), ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (!ec) return acceptor;
    last = ec;
    if (ec != boost::system::errc::address_not_available) only_not_local = false;
  }
  PIPEMAT_CHECK(!only_not_local, ConfigError, "tcp transport: the master host '", host, "' (",
                addresses, ") of master address '", master,
                "' is not an address of this machine, so rank 0 cannot listen there; run rank 0 "
                "on that host or set --master / PIPEMAT_MASTER to one of its addresses "
                "(127.0.0.1:port for a single machine)");
  PIPEMAT_THROW(CommError, "tcp transport: rank 0 could not listen on port ", port, " of master ",
                master, " (", last.message(), "); choose a free port in --master / PIPEMAT_MASTER");
}

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportOptions& options)
      : Transport(TransportKind::kTcp, options.rank, options.world_size, options.timeout),
        shutdown_timeout_(options.shutdown_timeout),
        core_(std::make_shared<TcpCore>(options.rank, options.world_size,
                                        options.max_message_bytes)) {
    rendezvous(options);
    core_->start();
  }

  // During an exception (a failed step) the peers are gone or stuck: no drain.
  ~TcpTransport() override {
    core_->shutdown(std::uncaught_exceptions() > 0 ? std::chrono::milliseconds(0)
                                                   : shutdown_timeout_);
  }

  const std::string& master_host() const { return master_host_; }
  const asio::ip::address& listen_address() const { return listen_address_; }

 protected:
  WorkPtr post_send(Request request) override {
    auto work = std::make_shared<TcpWork>(request.info, timeout(), core_);
    work->hold(std::move(request.keep_alive));
    work->send_spans = std::move(request.send_spans);
    core_->post_send(work);
    return work;
  }

  WorkPtr post_recv(Request request) override {
    auto work = std::make_shared<TcpWork>(request.info, timeout(), core_);
    work->hold(std::move(request.keep_alive));
    work->recv_spans = std::move(request.recv_spans);
    core_->post_recv(work);
    return work;
  }

 private:
  void rendezvous(const TransportOptions& options) {
    if (options.world_size == 1) return;
    auto [host, port] = parse_master(options.master);
    master_host_ = host;
    auto& io = core_->io;
    auto& peers = core_->peers;
    Rendezvous rv(io, options);
    const int world = options.world_size;
    const int me = options.rank;
    if (me == 0) {
      tcp::acceptor acceptor = listen_on_master(io, host, port, options.master);
      error_code ec;
      listen_address_ = acceptor.local_endpoint(ec).address();
      auto joined = rv.accept_ranks(acceptor, 1, world - 1, concat(" to connect to port ", port));
      std::vector<TableEntry> table(static_cast<size_t>(world));
      for (auto& j : joined) {
        auto& entry = table[static_cast<size_t>(j.hello.rank)];
        entry.port = j.hello.listen_port;
        // The address the master sees the rank at, which is the one its listener is bound to.
        std::strncpy(entry.host, j.address.c_str(), sizeof(entry.host) - 1);
        peers[static_cast<size_t>(j.hello.rank)] =
            std::make_unique<Peer>(j.hello.rank, std::move(j.socket));
      }
      for (int r = 1; r < world; ++r) {
        rv.write(peers[static_cast<size_t>(r)]->socket, table.data(),
                 table.size() * sizeof(TableEntry), "sending the rank table");
      }
      return;
    }
    tcp::socket master = rv.connect(host, port, "the master (rank 0)");
    // Own listener before the hello, so lower ranks' table entries are connectable at once; bound
    // to the address this rank reaches the master from (the one the table announces), not to
    // every interface.
    tcp::acceptor listener(io);
    {
      error_code ec;
      const tcp::endpoint local(master.local_endpoint(ec).address(), 0);
      if (!ec) listener.open(local.protocol(), ec);
      if (!ec) listener.bind(local, ec);
      if (!ec) listener.listen(asio::socket_base::max_listen_connections, ec);
      PIPEMAT_CHECK(!ec, CommError, "tcp transport: rank ", me,
                    " could not open its listener for the other ranks (", ec.message(), ")");
    }
    Hello hello;
    hello.rank = me;
    hello.world_size = world;
    hello.listen_port = listener.local_endpoint().port();
    rv.authenticate(master, hello, "the master (rank 0)", options.master);
    std::vector<TableEntry> table(static_cast<size_t>(world));
    rv.read(master, table.data(), table.size() * sizeof(TableEntry),
            "waiting for the rank table from the master (are all ranks started?)");
    peers[0] = std::make_unique<Peer>(0, std::move(master));
    for (int s = 1; s < me; ++s) {
      const auto& entry = table[static_cast<size_t>(s)];
      const std::string entry_host(entry.host, strnlen(entry.host, sizeof(entry.host)));
      tcp::socket socket =
          rv.connect(entry_host, static_cast<uint16_t>(entry.port), concat("rank ", s));
      rv.authenticate(socket, hello, concat("rank ", s), concat(entry_host, ":", entry.port));
      peers[static_cast<size_t>(s)] = std::make_unique<Peer>(s, std::move(socket));
    }
    if (me + 1 < world) {
      auto joined =
          rv.accept_ranks(listener, me + 1, world - 1, concat(" to connect to rank ", me));
      for (auto& j : joined) {
        peers[static_cast<size_t>(j.hello.rank)] =
            std::make_unique<Peer>(j.hello.rank, std::move(j.socket));
      }
    }
  }

  const std::chrono::milliseconds shutdown_timeout_;
  std::shared_ptr<TcpCore> core_;
  std::string master_host_;
  asio::ip::address listen_address_;  // rank 0: the address its master listener was bound to
};

// RAII file descriptor of the raw baseline.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

void raw_check(bool ok, const char* call, int peer) {
  PIPEMAT_CHECK(ok, CommError, "tcp raw ping-pong with rank ", peer, ": ", call,
                " failed: ", std::strerror(errno));
}

void write_all(int fd, const uint8_t* data, size_t size, int peer) {
  while (size > 0) {
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    raw_check(n > 0, "send", peer);
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void read_all(int fd, uint8_t* data, size_t size, int peer) {
  while (size > 0) {
    ssize_t n = ::recv(fd, data, size, 0);
    if (n < 0 && errno == EINTR) continue;
    PIPEMAT_CHECK(n != 0, CommError, "tcp raw ping-pong: rank ", peer, " closed the socket");
    raw_check(n > 0, "recv", peer);
    data += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

double tcp_raw_pingpong(Transport& transport, int peer, size_t bytes, int iterations, int warmup) {
  auto* tcp_transport = dynamic_cast<TcpTransport*>(&transport);
  PIPEMAT_INTERNAL_ASSERT(tcp_transport != nullptr, "tcp_raw_pingpong on a non-tcp transport");
  const bool lower = transport.rank() < peer;
  PIPEMAT_CHECK(std::min(transport.rank(), peer) == 0, ConfigError,
                "tcp raw ping-pong runs between rank 0 and another rank, not ", transport.rank(),
                " and ", peer);
  Fd connection;
  const int timeout_ms =
      static_cast<int>(std::min<long long>(transport.timeout().count(), 1 << 30));
  if (lower) {
    Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
    raw_check(listener.get() >= 0, "socket", peer);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    // The address of the master listener, not every interface (the peer connects to it).
    const auto& bound = tcp_transport->listen_address();
    addr.sin_addr.s_addr = bound.is_v4() ? htonl(bound.to_v4().to_uint()) : htonl(INADDR_ANY);
    raw_check(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "bind",
              peer);
    raw_check(::listen(listener.get(), 1) == 0, "listen", peer);
    socklen_t len = sizeof(addr);
    ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    uint32_t port = ntohs(addr.sin_port);
    transport.send(peer, kRawBenchTag, &port, sizeof(port))->wait();
    pollfd pfd{listener.get(), POLLIN, 0};
    int ready = ::poll(&pfd, 1, timeout_ms);
    PIPEMAT_CHECK(ready == 1, TimeoutError, "tcp raw ping-pong: rank ", peer,
                  " did not connect within ", timeout_ms, " ms");
    connection.reset(::accept(listener.get(), nullptr, nullptr));
    raw_check(connection.get() >= 0, "accept", peer);
  } else {
    uint32_t port = 0;
    transport.recv(peer, kRawBenchTag, &port, sizeof(port))->wait();
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    int rc = ::getaddrinfo(tcp_transport->master_host().c_str(), std::to_string(port).c_str(),
                           &hints, &found);
    PIPEMAT_CHECK(rc == 0 && found, CommError, "tcp raw ping-pong: cannot resolve ",
                  tcp_transport->master_host(), ": ", ::gai_strerror(rc));
    connection.reset(::socket(AF_INET, SOCK_STREAM, 0));
    rc = ::connect(connection.get(), found->ai_addr, found->ai_addrlen);
    ::freeaddrinfo(found);
    raw_check(rc == 0, "connect", peer);
  }
  int one = 1;
  ::setsockopt(connection.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<uint8_t> buffer(std::max<size_t>(bytes, 1), 1);
  Clock::time_point start;
  for (int i = 0; i < warmup + iterations; ++i) {
    if (i == warmup) start = Clock::now();
    if (lower) {
      write_all(connection.get(), buffer.data(), bytes, peer);
      read_all(connection.get(), buffer.data(), bytes, peer);
    } else {
      read_all(connection.get(), buffer.data(), bytes, peer);
      write_all(connection.get(), buffer.data(), bytes, peer);
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / iterations;
}

std::unique_ptr<Transport> make_tcp_transport(const TransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace pipemat::comm::detail
