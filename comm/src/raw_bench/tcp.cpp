// The tcp baseline of raw_pingpong_seconds: a fresh blocking POSIX socket between rank 0 and
// its peer (TCP_NODELAY), set up along the endpoints of the tcp transport.

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pipemat/comm/raw_bench.h"
#include "pipemat/core/error.h"
#include "raw_bench/baselines.h"
#include "tcp/transport.h"

namespace pipemat::comm::detail {
namespace {

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
  const tcp::Endpoints* endpoints = tcp::endpoints_of(transport);
  PIPEMAT_INTERNAL_ASSERT(endpoints != nullptr, "tcp_raw_pingpong on a non-tcp transport");
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
    const auto& bound = endpoints->listen_address;
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
    int rc =
        ::getaddrinfo(endpoints->master_host.c_str(), std::to_string(port).c_str(), &hints, &found);
    PIPEMAT_CHECK(rc == 0 && found, CommError, "tcp raw ping-pong: cannot resolve ",
                  endpoints->master_host, ": ", ::gai_strerror(rc));
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

}  // namespace pipemat::comm::detail
