// The MPI environment (Note [MPI lifetime]) and abort_job.

#include "mpi/environment.h"

// The C API only; the deprecated C++ bindings would add link dependencies for nothing.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <mutex>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail::mpi {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<size_t>(length));
}

std::shared_ptr<MpiEnvironment> MpiEnvironment::acquire() {
  static std::mutex mutex;
  static std::shared_ptr<MpiEnvironment> instance;
  std::lock_guard<std::mutex> lock(mutex);
  if (!instance) instance = std::shared_ptr<MpiEnvironment>(new MpiEnvironment());
  return instance;
}

MpiEnvironment::~MpiEnvironment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

MpiEnvironment::MpiEnvironment() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  PIPEMAT_CHECK(!finalized, CommError,
                "mpi transport: MPI was already finalized in this process; create the "
                "transport before MPI_Finalize");
  int provided = 0;
  if (!initialized) {
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Init_thread failed: ", mpi_error_string(rc));
    owns_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  // pipemat serializes its own MPI calls, so SERIALIZED is the minimum it needs.
  PIPEMAT_CHECK(provided >= MPI_THREAD_SERIALIZED, CommError,
                "mpi transport: MPI provides thread level ", provided,
                " but pipemat needs at least MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED,
                "); initialize MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE) or let pipemat "
                "initialize it");
  thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
}

std::shared_ptr<MpiEnvironment> acquire_environment() { return MpiEnvironment::acquire(); }

}  // namespace pipemat::comm::detail::mpi

namespace pipemat::comm {

void abort_job(int exit_code) noexcept {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

}  // namespace pipemat::comm
