#pragma once
// The baseline of `pipemat bench p2p`: a plain ping-pong on the same medium as a transport,
// without the pipemat transport in the data path:
//   mpi    MPI_Send / MPI_Recv on MPI_COMM_WORLD
//   tcp    a fresh blocking POSIX socket between the two processes (TCP_NODELAY)
//   local  one memcpy per direction between the two threads, handed over by an atomic flag
// The transport itself is only used to exchange the socket port (tcp) and for barriers.

#include <cstddef>

#include "pipemat/comm/transport.h"

namespace pipemat::comm {

// Tag used by the tcp baseline to pass its port; do not use it for other traffic meanwhile.
inline constexpr int kRawBenchTag = kMaxUserTag;

// Both ranks call it with each other as `peer`. Runs `warmup` untimed and `iterations` timed
// round trips of `bytes` bytes; returns the mean round-trip time in seconds (measured on both
// ranks; the lower rank starts each round trip). Blocking; throws CommError on failures.
double raw_pingpong_seconds(Transport& transport, int peer, size_t bytes, int iterations,
                            int warmup);

}  // namespace pipemat::comm
