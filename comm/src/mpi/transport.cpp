// MPI backend (Open MPI).
//
// * MPI is initialized on first use at MPI_THREAD_MULTIPLE through a process-wide RAII object,
//   and finalized at exit only if pipemat initialized it (Note [MPI lifetime],
//   mpi/environment.h).
// * The transport works on its own duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so every
//   failure comes back as a code and becomes a Status with MPI_Error_string, the call and rank.
//   A group of its ranks (make_group, Note [Groups of ranks]) is a transport of the same kind on
//   a sub-communicator made with MPI_Comm_create_group, with its own MpiCore; its Works name job
//   ranks, which the core turns into the sub-communicator's.
// * Its operations run through an MpiCore (mpi/core.h): matched receives, progress on every
//   wait and on a progress thread (Note [MPI progress thread]).

#include "mpi/transport.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

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

// The tag of MPI_Comm_create_group; it never meets point-to-point tags.
constexpr int kCreateGroupTag = 0x504d47;  // "PMG"

class MpiTransport final : public SpanTransport<MpiTransport, MpiWork> {
 public:
  // The job's transport, on a duplicate of MPI_COMM_WORLD.
  MpiTransport(const TransportOptions& options, std::shared_ptr<MpiEnvironment> env, CommInfo world)
      : SpanTransport(TransportKind::kMpi, world.rank, world.world_size, options.timeout),
        env_(std::move(env)),
        options_(options),
        core_(std::make_shared<MpiCore>()) {
    const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &core_->comm);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Comm_dup failed on rank ", rank(), ": ",
                  mpi_error_string(rc));
    start();
  }

  // A group (Note [Groups of ranks]): `comm`, whose rank r is job rank job_ranks[r]; it shares
  // the job transport's `clocks` (Note [Liveness of a peer]: only the job's transport beats).
  MpiTransport(const TransportOptions& options, std::shared_ptr<MpiEnvironment> env, MPI_Comm comm,
               int rank, std::vector<int> job_ranks, std::shared_ptr<PeerClocks> clocks)
      : SpanTransport(TransportKind::kMpi, rank, static_cast<int>(job_ranks.size()),
                      options.timeout, job_ranks[static_cast<size_t>(rank)]),
        env_(std::move(env)),
        options_(options),
        core_(std::make_shared<MpiCore>()),
        job_ranks_(std::move(job_ranks)) {
    core_->comm = comm;
    core_->clocks = std::move(clocks);
    const int most = *std::max_element(job_ranks_.begin(), job_ranks_.end());
    core_->comm_rank_of_job.assign(static_cast<size_t>(most) + 1, -1);
    for (size_t r = 0; r < job_ranks_.size(); ++r)
      core_->comm_rank_of_job[static_cast<size_t>(job_ranks_[r])] = static_cast<int>(r);
    start();
  }

  // During an exception (a failed step) the peers are gone or stuck: no drain.
  ~MpiTransport() override {
    core_->shutdown(std::uncaught_exceptions() > 0 ? std::chrono::milliseconds(0)
                                                   : options_.shutdown_timeout);
  }

  int job_rank_of(int r) const override {
    Transport::job_rank_of(r);  // the bounds check
    return job_ranks_.empty() ? r : job_ranks_[static_cast<size_t>(r)];
  }
  // A group's lane is the job transport's (Note [Device lanes]), whose ranks job_rank_of gives.
  DeviceLane* device_lane() const override {
    return parent_ != nullptr ? parent_->device_lane() : Transport::device_lane();
  }

  // SpanTransport's post_send / post_recv hand their work to this.
  const std::shared_ptr<MpiCore>& core() const { return core_; }

 protected:
  // A group's Works name job ranks (the core maps them to the sub-communicator's).
  WorkPtr post_send(Request request) override {
    return SpanTransport::post_send(to_job(std::move(request)));
  }
  WorkPtr post_recv(Request request) override {
    return SpanTransport::post_recv(to_job(std::move(request)));
  }

  // Note [Groups of ranks]: a sub-communicator when MPI runs at MPI_THREAD_MULTIPLE (each core
  // makes MPI calls under its own mutex), else a view that shares this core's.
  std::unique_ptr<Transport> make_subgroup(const std::vector<int>& world_ranks) override {
    if (!env_->thread_multiple()) return nullptr;
    const std::string where =
        concat(" on rank ", job_rank(), " making a group of ranks ", join_ranks(world_ranks));
    MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    int rc = MPI_Comm_group(core_->comm, &parent_group);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Comm_group failed", where, ": ",
                  mpi_error_string(rc));
    rc = MPI_Group_incl(parent_group, static_cast<int>(world_ranks.size()), world_ranks.data(),
                        &group);
    MPI_Group_free(&parent_group);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Group_incl failed", where, ": ",
                  mpi_error_string(rc));
    MPI_Comm comm = MPI_COMM_NULL;
    rc = MPI_Comm_create_group(core_->comm, group, kCreateGroupTag, &comm);
    MPI_Group_free(&group);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Comm_create_group failed", where, ": ",
                  mpi_error_string(rc));
    int sub_rank = 0;
    MPI_Comm_rank(comm, &sub_rank);
    std::vector<int> job_ranks;
    for (int r : world_ranks) job_ranks.push_back(job_rank_of(r));
    auto sub = std::make_unique<MpiTransport>(options_, env_, comm, sub_rank, std::move(job_ranks),
                                              core_->clocks);
    sub->parent_ = this;
    return sub;
  }

 private:
  // MPI_ERRORS_RETURN, MPI_TAG_UB and the progress thread of a transport whose comm is set.
  void start() {
    const int rc = MPI_Comm_set_errhandler(core_->comm, MPI_ERRORS_RETURN);
    PIPEMAT_CHECK(rc == MPI_SUCCESS, CommError, "MPI_Comm_set_errhandler failed on rank ",
                  job_rank(), ": ", mpi_error_string(rc));
    void* value = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &flag);
    if (flag && value) core_->tag_upper_bound = *static_cast<int*>(value);
    if (!env_->thread_multiple()) return;
    std::optional<Clock::duration> beat;
    if (job_ranks_.empty() && options_.mpi_progress_interval.count() > 0 &&
        kHeartbeatTag <= core_->tag_upper_bound) {
      // The job's transport beats (Note [Liveness of a peer]); its groups share its clocks.
      beat = PeerClocks::beat_interval(options_);
      core_->clocks = std::make_shared<PeerClocks>(world_size());
    }
    core_->start_progress_thread(options_.mpi_progress_interval, beat);
  }

  Request to_job(Request request) const {
    request.info.rank = job_rank();
    request.info.peer = job_rank_of(request.info.peer);
    return request;
  }

  static std::string join_ranks(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  std::shared_ptr<MpiEnvironment> env_;
  const TransportOptions options_;
  std::shared_ptr<MpiCore> core_;
  // This transport's rank r is job rank job_ranks_[r]; empty: the job's own transport.
  const std::vector<int> job_ranks_;
  // A group: the transport it was made from, which outlives it (Note [Groups of ranks]).
  const Transport* parent_ = nullptr;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options) {
  auto env = MpiEnvironment::acquire();
  CommInfo world = world_info(env);
  return std::make_unique<MpiTransport>(options, std::move(env), world);
}

}  // namespace pipemat::comm::detail
