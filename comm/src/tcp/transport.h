#pragma once
// tcp backend (private). See pipemat/comm/transport.h for the contract.

#include <memory>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::unique_ptr<Transport> make_tcp_transport(const TransportOptions& options);

}  // namespace pipemat::comm::detail

namespace pipemat::comm::detail {

// The tcp baseline of raw_pingpong_seconds (see pipemat/comm/raw_bench.h). One of the two
// ranks must be rank 0 (the peer connects to the master host).
double tcp_raw_pingpong(Transport& transport, int peer, size_t bytes, int iterations, int warmup);

}  // namespace pipemat::comm::detail
