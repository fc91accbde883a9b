#pragma once
// mpi backend (private). See pipemat/comm/transport.h for the contract.

#include <memory>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options);

}  // namespace pipemat::comm::detail

namespace pipemat::comm::detail {

// Plain MPI_Send/MPI_Recv ping-pong on MPI_COMM_WORLD (no pipemat transport involved); both
// ranks call it. Returns the mean round-trip time in seconds.
double mpi_raw_pingpong(int peer, size_t bytes, int iterations, int warmup);

}  // namespace pipemat::comm::detail
