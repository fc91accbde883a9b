#pragma once
// mpi backend (private). See pipemat/comm/transport.h for the contract.

#include <memory>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options);

}  // namespace pipemat::comm::detail
