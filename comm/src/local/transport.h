#pragma once
// In-process backend: ranks are threads of one process, connected through a shared hub.

#include <memory>
#include <vector>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::vector<std::unique_ptr<Transport>> make_local_group(int world_size,
                                                         const TransportOptions& options);

}  // namespace pipemat::comm::detail

namespace pipemat::comm::detail {

// The local baseline of raw_pingpong_seconds (see pipemat/comm/raw_bench.h).
double local_raw_pingpong(Transport& transport, int peer, size_t bytes, int iterations, int warmup);

}  // namespace pipemat::comm::detail
