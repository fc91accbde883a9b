#pragma once
// The raw ping-pong baselines of raw_pingpong_seconds (pipemat/comm/raw_bench.h), one per
// backend in raw_bench/<backend>.cpp (private); raw_bench.cpp picks one by transport kind.

#include <cstddef>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

// The local baseline of raw_pingpong_seconds (see pipemat/comm/raw_bench.h).
double local_raw_pingpong(Transport& transport, int peer, size_t bytes, int iterations, int warmup);

// Plain MPI_Send/MPI_Recv ping-pong on MPI_COMM_WORLD (no pipemat transport involved); both
// ranks call it. Returns the mean round-trip time in seconds.
double mpi_raw_pingpong(int peer, size_t bytes, int iterations, int warmup);

// The tcp baseline of raw_pingpong_seconds (see pipemat/comm/raw_bench.h). One of the two
// ranks must be rank 0 (the peer connects to the master host).
double tcp_raw_pingpong(Transport& transport, int peer, size_t bytes, int iterations, int warmup);

}  // namespace pipemat::comm::detail
