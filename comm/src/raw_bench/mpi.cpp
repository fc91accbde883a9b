// The mpi baseline of raw_pingpong_seconds: plain MPI_Send / MPI_Recv on MPI_COMM_WORLD, no
// pipemat transport involved.

// The C API only; the deprecated C++ bindings would add link dependencies for nothing.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mpi/environment.h"
#include "raw_bench/baselines.h"

namespace pipemat::comm::detail {

double mpi_raw_pingpong(int peer, size_t bytes, int iterations, int warmup) {
  auto env = mpi::acquire_environment();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<uint8_t> buffer(std::max<size_t>(bytes, 1));
  const int count = static_cast<int>(bytes);
  const bool initiator = rank < peer;
  constexpr int kTag = 4242;
  double start = 0;
  for (int i = 0; i < warmup + iterations; ++i) {
    if (i == warmup) start = MPI_Wtime();
    if (initiator) {
      MPI_Send(buffer.data(), count, MPI_BYTE, peer, kTag, MPI_COMM_WORLD);
      MPI_Recv(buffer.data(), count, MPI_BYTE, peer, kTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      MPI_Recv(buffer.data(), count, MPI_BYTE, peer, kTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(buffer.data(), count, MPI_BYTE, peer, kTag, MPI_COMM_WORLD);
    }
  }
  return (MPI_Wtime() - start) / iterations;
}

}  // namespace pipemat::comm::detail
