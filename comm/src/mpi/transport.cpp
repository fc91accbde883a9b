#include "mpi/transport.h"
#include "pipemat/core/error.h"
namespace pipemat::comm::detail {
std::unique_ptr<Transport> make_mpi_transport(const TransportOptions&) {
  PIPEMAT_THROW(ConfigError, "not built yet");
}
}  // namespace pipemat::comm::detail
