#pragma once
// mpi backend (private). See pipemat/comm/transport.h for the contract.

#include <memory>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options);

}  // namespace pipemat::comm::detail

namespace pipemat::comm::detail::mpi {

class MpiEnvironment;

// Initializes MPI on first use and keeps it initialized while the result lives (Note [MPI
// lifetime] in mpi/transport.cpp), for MPI calls outside a transport (raw_bench/mpi.cpp).
std::shared_ptr<MpiEnvironment> acquire_environment();

}  // namespace pipemat::comm::detail::mpi
