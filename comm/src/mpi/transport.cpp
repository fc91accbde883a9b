// MPI backend (Open MPI).
//
// * MPI is initialized on first use at MPI_THREAD_MULTIPLE through a process-wide RAII object,
//   and finalized at exit only if pipemat initialized it (Note [MPI lifetime],
//   mpi/environment.h).
// * The transport works on its own duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so every
//   failure comes back as a code and becomes a Status with MPI_Error_string, the call and rank.
// * Its operations run through an MpiCore (mpi/core.h): matched receives, progress on every
//   wait and on a progress thread (Note [MPI progress thread]).

#include "mpi/transport.h"

#include <chrono>
#include <exception>
#include <memory>

#include "common.h"
#include "mpi/core.h"
#include "mpi/environment.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail {
namespace {

using mpi::mpi_error_string;
using mpi::MpiCore;
using mpi::MpiEnvironment;
using mpi::MpiWork;

struct CommInfo {
  int rank = 0;
  int world_size = 1;
};

CommInfo world_info(const std::shared_ptr<MpiEnvironment>&) {
  CommInfo info;
  MPI_Comm_rank(MPI_COMM_WORLD, &info.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &info.world_size);
  return info;
}

class MpiTransport final : public SpanTransport<MpiTransport, MpiWork> {
 public:
  MpiTransport(const TransportOptions& options, std::shared_ptr<MpiEnvironment> env, CommInfo world)
      : SpanTransport(TransportKind::kMpi, world.rank, world.world_size, options.timeout),
        env_(std::move(env)),
        shutdown_timeout_(options.shutdown_timeout),
        core_(std::make_shared<MpiCore>()) {
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &core_->comm);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Comm_dup failed on rank ", rank(), ": ",
                  mpi_error_string(rc));
    rc = MPI_Comm_set_errhandler(core_->comm, MPI_ERRORS_RETURN);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Comm_set_errhandler failed on rank ", rank(),
                  ": ", mpi_error_string(rc));
    void* value = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &flag);
    if (flag && value) core_->tag_upper_bound = *static_cast<int*>(value);
    if (env_->thread_multiple()) core_->start_progress_thread(options.mpi_progress_interval);
  }

  // During an exception (a failed step) the peers are gone or stuck: no drain.
  ~MpiTransport() override {
    core_->shutdown(std::uncaught_exceptions() > 0 ? std::chrono::milliseconds(0)
                                                   : shutdown_timeout_);
  }

  // SpanTransport's post_send / post_recv hand their work to this.
  const std::shared_ptr<MpiCore>& core() const { return core_; }

 private:
  std::shared_ptr<MpiEnvironment> env_;
  const std::chrono::milliseconds shutdown_timeout_;
  std::shared_ptr<MpiCore> core_;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options) {
  auto env = MpiEnvironment::acquire();
  CommInfo world = world_info(env);
  return std::make_unique<MpiTransport>(options, std::move(env), world);
}

}  // namespace pipemat::comm::detail
