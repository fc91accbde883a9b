#pragma once
// In-process backend: ranks are threads of one process, connected through a shared hub.

#include <atomic>
#include <memory>
#include <vector>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::vector<std::unique_ptr<Transport>> make_local_group(int world_size,
                                                         const TransportOptions& options);

}  // namespace pipemat::comm::detail

namespace pipemat::comm::detail::local {

// Shared state of the local raw ping-pong baseline (bench only; raw_bench/local.cpp), one per
// group: the two ranks' buffers and whose turn it is.
struct RawPingPong {
  void* buffers[2] = {nullptr, nullptr};
  std::atomic<long> turn{0};
};

// The raw ping-pong state of `transport`'s group, or null when it is not a local transport.
RawPingPong* raw_pingpong_mailbox(Transport& transport);

}  // namespace pipemat::comm::detail::local
