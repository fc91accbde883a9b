#pragma once
// The request engine of the mpi backend (private): the Work of an MPI message and MpiCore, which
// posts, matches, drives and retires every MPI request of one transport.
//
// * Receives are matched with MPI_Improbe + MPI_Imrecv: the size is known before the bytes land,
//   so a size mismatch is reported (never truncated) and recv_any needs no extra round trip.
//   Only the oldest unmatched receive of each (peer, tag) probes, which keeps MPI's
//   non-overtaking order per (peer, tag).
// * Every is_completed()/wait() on any Work of the transport drives all its pending operations
//   (Note [Work contract]), and so does a progress thread while any is pending (Note [MPI
//   progress thread]); all MPI calls of a transport are serialized by one mutex.
//
// Note [MPI progress thread]
// Open MPI moves a message above its eager limit (4 KiB on the shared-memory BTL) in a
// rendezvous that advances only inside MPI calls. Without a progress thread a rank that posted
// a receive and went on computing left its peer's 256 KiB activation where it was until its
// next wait: on the bench config (docs/performance.md) a message took 14 ms median from the end
// of the producing action to the start of the consuming one, and the measured 1f1b bubble was
// 0.45 against 0.10 simulated. The thread wakes every TransportOptions::mpi_progress_interval
// while operations are pending, drives them under the transport mutex, and sleeps on a
// condition variable when nothing is pending.

// The C API only; the deprecated C++ bindings would add link dependencies for nothing.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "pipemat/comm/work.h"

namespace pipemat::comm::detail::mpi {

class MpiCore;

class MpiWork final : public SpanWork {
 public:
  MpiWork(WorkInfo info, std::chrono::milliseconds timeout, std::shared_ptr<MpiCore> core)
      : SpanWork(std::move(info), timeout), core_(std::move(core)) {}

  MPI_Request request = MPI_REQUEST_NULL;
  Buffer target;  // recv into transport memory (any size / size mismatch)
  size_t incoming = 0;

 protected:
  void progress() override;
  bool needs_progress() const override { return true; }
  bool progress_thread() const override;
  void abort_impl(const Status& reason) noexcept override;

 private:
  std::shared_ptr<MpiCore> core_;
};

class MpiCore {
 public:
  // Set once by the transport before the first post: its own communicator (MPI_ERRORS_RETURN)
  // and that communicator's MPI_TAG_UB. MPI_COMM_NULL after shutdown.
  MPI_Comm comm = MPI_COMM_NULL;
  long tag_upper_bound = 32767;

  // Post one operation; a failure (shut down, tag above MPI_TAG_UB, above 2 GiB, an MPI error)
  // finishes the Work with its Status instead of throwing.
  void post_send(const std::shared_ptr<MpiWork>& work);
  void post_recv(const std::shared_ptr<MpiWork>& work);

  ~MpiCore();

  bool has_progress_thread() const { return has_progress_thread_; }

  // Note [MPI progress thread]. Called once, after `comm` is set; none when `interval` is 0.
  void start_progress_thread(std::chrono::microseconds interval);
  void stop_progress_thread() noexcept;

  // Drives every pending operation once (Note [Work contract]).
  void progress();

  // Withdraws `work` where MPI lets it and finishes it with `reason`.
  void abort(MpiWork* work, const Status& reason);

  // Destructor path: drain sends (bounded), then fail and release everything. Never throws.
  void shutdown(std::chrono::milliseconds linger) noexcept;

  // Works whose requests MPI never released (kept until the process ends).
  static std::vector<std::shared_ptr<MpiWork>>& unreleased();

 private:
  bool check_usable(const std::shared_ptr<MpiWork>& work);
  void progress_locked();
  void start_matched_recv(const std::shared_ptr<MpiWork>& work, MPI_Message& message,
                          const MPI_Status& status);
  static void complete(const std::shared_ptr<MpiWork>& work);

  std::mutex mutex_;
  std::condition_variable pending_;  // signalled when an operation is posted or on stop
  bool stopping_ = false;
  std::atomic<bool> has_progress_thread_{false};
  std::thread progress_thread_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<MpiWork>>> unmatched_;
  std::vector<std::shared_ptr<MpiWork>> active_;
  std::vector<std::shared_ptr<MpiWork>> orphans_;
};

}  // namespace pipemat::comm::detail::mpi
