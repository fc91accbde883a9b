// raw_pingpong_seconds: the baseline of the transport's backend (raw_bench/<backend>.cpp).

#include "pipemat/comm/raw_bench.h"

#include "pipemat/core/error.h"
#include "raw_bench/baselines.h"

namespace pipemat::comm {

double raw_pingpong_seconds(Transport& transport, int peer, size_t bytes, int iterations,
                            int warmup) {
  PIPEMAT_CHECK(iterations >= 1, ConfigError, "raw ping-pong needs at least 1 iteration");
  switch (transport.kind()) {
    case TransportKind::kMpi:
#ifdef PIPEMAT_MPI
      transport.barrier();
      return detail::mpi_raw_pingpong(peer, bytes, iterations, warmup);
#else
      break;  // no MPI transport exists in a build without MPI
#endif
    case TransportKind::kTcp:
      return detail::tcp_raw_pingpong(transport, peer, bytes, iterations, warmup);
    case TransportKind::kLocal:
      return detail::local_raw_pingpong(transport, peer, bytes, iterations, warmup);
    case TransportKind::kAuto:
      break;
  }
  PIPEMAT_THROW(ConfigError, "raw ping-pong: unknown transport kind");
}

}  // namespace pipemat::comm
