#pragma once
// The request engine of the mpi backend (private): the Work of an MPI message and MpiCore, which
// posts, matches, drives and retires every MPI request of one transport.
//
// * Receives are matched with MPI_Improbe + MPI_Imrecv: the size is known before the bytes land,
//   so a size mismatch is reported (never truncated) and recv_any needs no extra round trip.
//   Only the oldest unmatched receive of each (peer, tag) probes, which keeps MPI's
//   non-overtaking order per (peer, tag).
// * Every is_completed() drives all pending operations of the transport once (Note [Work
//   contract]). A wait() drives its own operation until it finished, and a progress thread
//   drives the rest while any is pending (Note [MPI progress thread]); all MPI calls of a
//   transport are serialized by one mutex.
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
//
// Who drives a message somebody waits for. The thread's first version left that to itself too:
// a waiter drove the transfer for 200 us and then slept until its Work finished, and
// `pipemat bench p2p --transport mpi` fell to 2.7-4.7 Gbit/s at 4 and 16 MiB (0.06-0.3 of raw
// MPI_Send/MPI_Recv). A tensor message is two spans (header and data), an hindexed MPI datatype
// that Open MPI's ob1 does not move with one CMA copy: it copies it through 32 KiB shared-memory
// fragments, at most 3 in flight (pml_ob1_send_pipeline_depth), and each batch needs an MPI
// call on the sending side after the receiver returned the last one. 16 MiB is 512 fragments,
// about 170 such rounds; at one round per wake-up of the thread (100 us plus the wake-up) a
// 16 MiB message took 35-50 ms one way. PIPEMAT_MPI_PROGRESS_US=1000 made it 205 ms (the rounds,
// not the copies, were the cost), `--mca pml_ob1_send_pipeline_depth 48` 7 ms, and
// `--mca btl_vader_single_copy_mechanism none` 36 ms (no change).
//
// Now a waiter drives its own operation itself (MpiCore::wait): once the operation is in MPI
// (a send, or a receive whose message was matched) it calls MPI_Test on it, and MPI_Improbe for
// receives posted meanwhile, in a loop, releasing the mutex between calls. It spins without
// yielding for 20 ms: under the kernel's EEVDF scheduler a sched_yield hands the core to any
// other busy process for a whole slice (with a CPU hog on core 0, yielding after every test
// moved 3.3 Gbit/s at 16 MiB, spinning 10-13). It does let in a thread that announced it waits
// for the mutex (a post, an abort, the progress thread, another waiter; mpirun binds all
// threads of a rank to one core). After 20 ms it yields between tests, after 100 ms it tests
// once per progress interval. The progress thread pauses its rounds while a waiter drives (the
// waiter's MPI_Test calls advance every transfer), so it costs a computing rank nothing more
// than before. A receive whose message has not arrived has nothing to drive: its waiter runs
// progress rounds for 200 us and then sleeps until a progress round matches it (woken at once,
// at most 1 ms between rounds of its own), as before.
//
// Measured with two scratch drivers that differ only in linking the comm library of the
// commit before or of this change, interleaved, 3 runs each, load ~1.5 on the 2 cores, medians
// at 256 KiB / 1 / 4 / 16 MiB: before 43.0 / 19.7 / 4.7 / 3.9 Gbit/s (ratio to raw 4.61 / 0.29 /
// 0.07 / 0.11), after 38.4 / 41.0 / 45.7 / 41.7 Gbit/s (1.28 / 1.28 / 1.15 / 1.72); docs/comm.md
// has the `pipemat bench p2p` table. The ratio still depends on the machine: when it was
// quieter, raw MPI_Send/MPI_Recv of one contiguous buffer (a single CMA copy) reached
// 53-93 Gbit/s at 1-4 MiB and the tensor path's two copies through fragments 0.5-0.75 of that
// (one contiguous span through this transport, measured the same way: 47-65 Gbit/s at 1 MiB).
// At 16 MiB, where raw falls to 18-36 Gbit/s, the median ratio of this change was 0.85-2.34
// over three sets. comm_mpi_driven_np2 holds the change: with a progress interval of an hour,
// 16 MiB exchanges complete only because their waiters drive them.

// Note [Idle progress rounds]
// While every pending operation is a receive whose message has not arrived and no thread waits
// for one, a round only asks MPI_Improbe whether a message came: the rank computes, and each
// wake-up takes its core from the computing thread (mpirun binds a rank's threads to one core).
// A rank of a real-size model computes for hundreds of milliseconds per action with its next
// receive posted, which is thousands of wake-ups a step at a 100 us interval. Then the thread
// sleeps a sixteenth of the time the oldest such receive has been waiting, between the interval
// and kMaxIdleRound (2 ms): a message is found at most 1/16 of its wait later, or 2 ms, and a
// 300 ms wait costs about a hundred rounds instead of three thousand. A started operation (a
// send, a matched receive: the fragments of a large message need a round each) or a thread
// asleep on an unmatched receive (MpiCore::wait; it wakes the thread) brings back the interval.

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
#include <optional>
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
  // Under MpiCore's mutex: true once `request` is an MPI request (an MPI_Isend, or a receive
  // matched by MPI_Improbe and started with MPI_Imrecv); false while a receive is unmatched.
  bool started = false;
  Clock::time_point posted{};  // when post_recv queued it (Note [Idle progress rounds])

  using Work::done;

 protected:
  void progress() override;
  bool needs_progress() const override { return true; }
  bool drive_until(Clock::time_point deadline) override;
  void abort_impl(const Status& reason) noexcept override;
  std::optional<Clock::duration> peer_silence() const override;

 private:
  std::shared_ptr<MpiCore> core_;
};

class MpiCore {
 public:
  // Set once by the transport before the first post: its own communicator (MPI_ERRORS_RETURN)
  // and that communicator's MPI_TAG_UB. MPI_COMM_NULL after shutdown.
  MPI_Comm comm = MPI_COMM_NULL;
  long tag_upper_bound = 32767;
  // A group's sub-communicator (Note [Groups of ranks]): Works name job ranks, so a peer's rank
  // in `comm` is comm_rank_of_job[job rank]. Empty: they are the same (the job's transport).
  std::vector<int> comm_rank_of_job;
  // Note [Liveness of a peer]: when each job rank was last heard from. Set (before the first
  // post) on the job's transport that beats and shared with its groups; null: no liveness.
  std::shared_ptr<PeerClocks> clocks;

  // Post one operation; a failure (shut down, tag above MPI_TAG_UB, above 2 GiB, an MPI error)
  // finishes the Work with its Status instead of throwing.
  void post_send(const std::shared_ptr<MpiWork>& work);
  void post_recv(const std::shared_ptr<MpiWork>& work);

  ~MpiCore();

  bool has_progress_thread() const { return has_progress_thread_; }

  // Heartbeats (the job's transport only) go on kHeartbeatTag; none where MPI_TAG_UB is below it
  // (no liveness then). The progress thread's shortest sleep between heartbeat wake-ups.
  static constexpr auto kMinBeatSleep = std::chrono::microseconds(100);

  // Note [MPI progress thread]. Called once, after `comm` is set; none when `interval` is 0.
  // With a `beat` interval and `clocks` (the job's transport, where MPI_TAG_UB admits
  // kHeartbeatTag) the thread also sends every peer of `comm` a heartbeat that often and notes
  // theirs in `clocks` (Note [Liveness of a peer]).
  void start_progress_thread(std::chrono::microseconds interval,
                             std::optional<Clock::duration> beat = std::nullopt);
  void stop_progress_thread() noexcept;

  // Drives every pending operation once (Note [Work contract]).
  void progress();

  // Work::wait() with a progress thread (Note [MPI progress thread]): the waiting thread drives
  // `work` itself until it finished or `deadline` passed; true when finished.
  bool wait(MpiWork& work, Clock::time_point deadline);

  // Withdraws `work` where MPI lets it and finishes it with `reason`.
  void abort(MpiWork* work, const Status& reason);

  // Destructor path: drain sends (bounded), then fail and release everything. Never throws.
  void shutdown(std::chrono::milliseconds linger) noexcept;

  // Works whose requests MPI never released (kept until the process ends).
  static std::vector<std::shared_ptr<MpiWork>>& unreleased();

 private:
  bool check_usable(const std::shared_ptr<MpiWork>& work);
  int comm_rank(int job_rank) const {
    return comm_rank_of_job.empty() ? job_rank : comm_rank_of_job[static_cast<size_t>(job_rank)];
  }
  void progress_locked();
  // Note [Liveness of a peer]: notes the heartbeats that arrived and, when one is due, sends the
  // next to every peer whose last one left. Nothing without beats.
  void beat_locked();
  // The heartbeats' requests are released (shutdown); true when a send MPI has not finished is
  // left to it (the communicator must then stay).
  bool stop_beats_locked() noexcept;
  // The MPI_Improbe part of progress_locked(): starts the receives whose messages arrived.
  void match_locked();
  // One MPI_Test of a started `work`; retires it from active_ when it finished.
  void test_locked(MpiWork& work);
  void start_matched_recv(const std::shared_ptr<MpiWork>& work, MPI_Message& message,
                          const MPI_Status& status);
  void complete(MpiWork& work);

  // Note [Idle progress rounds]: the progress thread's sleep after a round, under the mutex.
  Clock::duration next_round_locked(Clock::duration interval) const;

  // Locks mutex_, counted in wanted_ while it waits (a driving waiter lets it in).
  std::unique_lock<std::mutex> acquire();
  void lock_counted(std::unique_lock<std::mutex>& lock);  // the same for a lock of mutex_

  std::mutex mutex_;
  std::atomic<int> wanted_{0};         // threads waiting for mutex_ (acquire(), a waiter)
  std::atomic<int> drivers_{0};        // waiters driving a started operation (MpiCore::wait)
  std::atomic<int> match_waiters_{0};  // waiters asleep until their receive is matched
  std::condition_variable pending_;    // signalled when an operation is posted or on stop
  std::condition_variable matched_;    // signalled when unmatched receives started or finished
  std::chrono::microseconds interval_{0};
  bool stopping_ = false;
  std::mutex stop_mutex_;  // the progress thread's sleep between rounds
  std::condition_variable stop_;
  bool stop_requested_ = false;
  std::atomic<bool> has_progress_thread_{false};
  std::thread progress_thread_;
  struct Beats {
    Clock::duration interval{};
    Clock::time_point next{};
    MPI_Request recv = MPI_REQUEST_NULL;
    std::vector<MPI_Request> sends;  // by rank in `comm`
  };
  std::optional<Beats> beats_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<MpiWork>>> unmatched_;
  std::vector<std::shared_ptr<MpiWork>> active_;
  std::vector<std::shared_ptr<MpiWork>> orphans_;
};

}  // namespace pipemat::comm::detail::mpi
