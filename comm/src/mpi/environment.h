#pragma once
// The process's MPI environment (private to the mpi backend): MPI initialized once per process
// and finalized at exit only if pipemat initialized it, and the text of MPI error codes.

#include <memory>
#include <string>

namespace pipemat::comm::detail::mpi {

// Note [MPI lifetime]
// MPI can be initialized once per process and never again after MPI_Finalize. So the
// environment is one process-wide RAII object, created on first use and kept alive by every
// transport and by a static reference until static destruction at exit; only then, and only if
// pipemat was the one to call MPI_Init_thread, is MPI finalized. A program that initializes MPI
// itself keeps full control: pipemat never finalizes it.
class MpiEnvironment {
 public:
  // The process's environment, MPI initialized at MPI_THREAD_MULTIPLE on the first call.
  // CommError when MPI was already finalized, MPI_Init_thread fails, or MPI was initialized
  // below MPI_THREAD_SERIALIZED. Thread-safe.
  static std::shared_ptr<MpiEnvironment> acquire();

  ~MpiEnvironment();

  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  // The progress thread calls MPI while the program may too (its own MPI calls, the raw
  // baseline of bench p2p): it runs only at MPI_THREAD_MULTIPLE.
  bool thread_multiple() const { return thread_multiple_; }

 private:
  MpiEnvironment();

  bool owns_ = false;
  bool thread_multiple_ = false;
};

// Initializes MPI on first use and keeps it initialized while the result lives (Note [MPI
// lifetime]), for MPI calls outside a transport (raw_bench/mpi.cpp).
std::shared_ptr<MpiEnvironment> acquire_environment();

// MPI_Error_string of `code`, or "unknown MPI error".
std::string mpi_error_string(int code);

}  // namespace pipemat::comm::detail::mpi
