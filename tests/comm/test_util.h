#pragma once
// Helpers of the comm tests: N ranks as N threads over the local or tcp transport.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <vector>

#include "pipemat/comm/rank_threads.h"
#include "pipemat/comm/transport.h"

namespace pipemat::comm::testing {

// A socket bound to 127.0.0.1 at a port the kernel picks, listening with `backlog` unless it is
// 0. fd -1 when a call failed.
struct LoopbackSocket {
  int fd = -1;
  int port = 0;
};
inline LoopbackSocket bind_loopback(int backlog) {
  LoopbackSocket out;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      (backlog > 0 && ::listen(fd, backlog) != 0) ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return out;
  }
  out.fd = fd;
  out.port = ntohs(addr.sin_port);
  return out;
}

// A port that was free a moment ago (the kernel picks it).
inline int free_port() {
  const LoopbackSocket s = bind_loopback(0);
  if (s.fd >= 0) ::close(s.fd);
  return s.port;
}

using Group = std::vector<std::unique_ptr<Transport>>;

// Runs fn(rank) on one thread per rank and rethrows the root cause (rank_threads.h).
inline void run_threads(int world_size, const std::function<void(int)>& fn) {
  run_rank_threads(world_size, fn);
}

// `per_rank(rank, options)` may change one rank's options (tcp).
inline Group make_group(TransportKind kind, int world_size, TransportOptions options = {},
                        const std::function<void(int, TransportOptions&)>& per_rank = {}) {
  if (kind == TransportKind::kLocal) return make_local_transports(world_size, options);
  Group group(static_cast<size_t>(world_size));
  options.kind = kind;
  options.connect_retry_interval = std::chrono::milliseconds(20);
  options.connect_retries = 500;  // up to 10 s for a slow-starting rank 0 on a loaded machine
  options.world_size = world_size;
  options.master = "127.0.0.1:" + std::to_string(free_port());
  run_threads(world_size, [&](int rank) {
    TransportOptions mine = options;
    mine.rank = rank;
    if (per_rank) per_rank(rank, mine);
    group[static_cast<size_t>(rank)] = make_transport(mine);
  });
  return group;
}

// Runs fn(transport) for every rank on its own thread; the transports stay open.
inline void run_ranks(Group& group, const std::function<void(Transport&)>& fn) {
  run_rank_threads(group, fn);
}

// Parameter of the tests that run over transport x world size.
struct TransportParam {
  TransportKind kind;
  int world_size;
};

inline std::string param_name(const ::testing::TestParamInfo<TransportParam>& info) {
  return to_string(info.param.kind) + std::to_string(info.param.world_size);
}

}  // namespace pipemat::comm::testing
