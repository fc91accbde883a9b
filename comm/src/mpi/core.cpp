// The mpi backend's request engine (mpi/core.h): posting, matching with MPI_Improbe, progress
// (also on the progress thread), abort and shutdown.

#include "mpi/core.h"

#include <algorithm>
#include <climits>
#include <exception>
#include <iterator>

#include "mpi/environment.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail::mpi {
namespace {

Status mpi_failure(const char* call, int code, const WorkInfo& info) {
  return Status{StatusCode::kCommError,
                concat(call, " failed on rank ", info.rank, " during ", info.describe(), ": ",
                       mpi_error_string(code), " (MPI error code ", code, ")")};
}

// Builds the (buffer, count, datatype) triple for a list of spans: plain bytes for one span,
// an hindexed type over absolute addresses (MPI_BOTTOM) for several. Returns MPI_SUCCESS or a
// code; `type` must be freed with MPI_Type_free when it is not MPI_BYTE.
template <typename Span>
int describe_spans(const std::vector<Span>& spans, void*& base, int& count, MPI_Datatype& type) {
  std::vector<const Span*> used;
  for (const auto& s : spans) {
    if (s.size) used.push_back(&s);
  }
  type = MPI_BYTE;
  if (used.size() <= 1) {
    base = used.empty() ? nullptr : const_cast<void*>(static_cast<const void*>(used[0]->data));
    count = used.empty() ? 0 : static_cast<int>(used[0]->size);
    return MPI_SUCCESS;
  }
  std::vector<int> lengths;
  std::vector<MPI_Aint> displacements;
  for (const Span* s : used) {
    MPI_Aint address = 0;
    MPI_Get_address(s->data, &address);
    lengths.push_back(static_cast<int>(s->size));
    displacements.push_back(address);
  }
  int rc = MPI_Type_create_hindexed(static_cast<int>(used.size()), lengths.data(),
                                    displacements.data(), MPI_BYTE, &type);
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&type);
  base = MPI_BOTTOM;
  count = 1;
  return rc;
}

}  // namespace

void MpiCore::post_send(const std::shared_ptr<MpiWork>& work) {
  auto lock = acquire();
  const WorkInfo& info = work->info();
  if (!check_usable(work)) return;
  void* base = nullptr;
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  int rc = describe_spans(work->send_spans, base, count, type);
  if (rc == MPI_SUCCESS) {
    rc = MPI_Isend(base, count, type, comm_rank(info.peer), info.tag, comm, &work->request);
  }
  if (type != MPI_BYTE) MPI_Type_free(&type);
  if (rc != MPI_SUCCESS) {
    work->finish(mpi_failure("MPI_Isend", rc, info));
    return;
  }
  work->started = true;
  active_.push_back(work);
  pending_.notify_one();
}

void MpiCore::post_recv(const std::shared_ptr<MpiWork>& work) {
  auto lock = acquire();
  if (!check_usable(work)) return;
  const WorkInfo& info = work->info();
  work->posted = Clock::now();
  unmatched_[{info.peer, info.tag}].push_back(work);
  progress_locked();
  pending_.notify_one();
}

Clock::duration MpiCore::next_round_locked(Clock::duration interval) const {
  // Note [Idle progress rounds].
  constexpr auto kMaxIdleRound = std::chrono::milliseconds(2);
  constexpr int kIdleFraction = 16;
  if (!active_.empty() || unmatched_.empty() ||
      match_waiters_.load(std::memory_order_relaxed) > 0) {
    return interval;
  }
  Clock::time_point oldest = Clock::time_point::max();
  for (const auto& [key, queue] : unmatched_) {
    if (!queue.empty()) oldest = std::min(oldest, queue.front()->posted);
  }
  if (oldest == Clock::time_point::max()) return interval;
  const Clock::duration idle = (Clock::now() - oldest) / kIdleFraction;
  return std::clamp<Clock::duration>(idle, interval,
                                     std::max<Clock::duration>(interval, kMaxIdleRound));
}

MpiCore::~MpiCore() { stop_progress_thread(); }

void MpiCore::start_progress_thread(std::chrono::microseconds interval,
                                    std::optional<Clock::duration> beat) {
  if (interval.count() <= 0) return;
  interval_ = interval;
  if (beat && clocks) {
    int size = 0;
    MPI_Comm_size(comm, &size);
    beats_.emplace();
    beats_->interval = *beat;
    beats_->sends.assign(static_cast<size_t>(size), MPI_REQUEST_NULL);
  }
  has_progress_thread_ = true;
  progress_thread_ = std::thread([this, interval] {
    const auto pending = [&] { return stopping_ || !unmatched_.empty() || !active_.empty(); };
    for (;;) {
      Clock::duration sleep = interval;
      {
        auto lock = acquire();
        if (beats_) {
          // Note [Liveness of a peer]: the thread wakes for the heartbeats too; a wake-up for a
          // heartbeat alone drives nothing else.
          pending_.wait_until(lock, beats_->next, pending);
          if (stopping_) return;
          if (pending()) {
            progress_locked();
            sleep = next_round_locked(interval);
          } else {
            beat_locked();
          }
          const auto until_beat = beats_->next - Clock::now();
          sleep = std::min(sleep, std::max<Clock::duration>(until_beat, kMinBeatSleep));
        } else {
          pending_.wait(lock, pending);
          if (stopping_) return;
          progress_locked();
          sleep = next_round_locked(interval);
        }
      }
      // Sleep for the interval (at most until the next heartbeat), and for as long as a waiter
      // drives MPI itself (MpiCore::wait, which beats too): its MPI_Test calls advance every
      // transfer, and a round would only take the mutex and the core (mpirun binds all threads
      // of a rank to one core) from it.
      std::unique_lock<std::mutex> lock(stop_mutex_);
      do {
        if (stop_.wait_for(lock, sleep, [&] { return stop_requested_; })) return;
      } while (drivers_.load(std::memory_order_relaxed) > 0);
    }
  });
}

void MpiCore::beat_locked() {
  if (!beats_ || comm == MPI_COMM_NULL) return;
  Beats& b = *beats_;
  const auto now = Clock::now();
  // Once per interval (progress rounds and driving waiters call this often): a peer's beat is
  // noted at most an interval late, a quarter of the timeout.
  if (now < b.next) return;
  b.next = now + b.interval;
  for (;;) {  // the heartbeats that arrived (zero bytes, from any rank)
    if (b.recv == MPI_REQUEST_NULL && MPI_Irecv(nullptr, 0, MPI_BYTE, MPI_ANY_SOURCE, kHeartbeatTag,
                                                comm, &b.recv) != MPI_SUCCESS) {
      break;
    }
    int flag = 0;
    MPI_Status status;
    if (MPI_Test(&b.recv, &flag, &status) != MPI_SUCCESS || !flag) break;
    clocks->heard(status.MPI_SOURCE);  // the job's transport: comm ranks are job ranks
  }
  int self = 0;
  MPI_Comm_rank(comm, &self);
  for (size_t r = 0; r < b.sends.size(); ++r) {
    if (static_cast<int>(r) == self) continue;
    MPI_Request& send = b.sends[r];
    int flag = 1;
    MPI_Status status;
    if (send != MPI_REQUEST_NULL) MPI_Test(&send, &flag, &status);
    // A beat still in flight (a peer that stopped reading) is not followed by another.
    if (flag) MPI_Isend(nullptr, 0, MPI_BYTE, static_cast<int>(r), kHeartbeatTag, comm, &send);
  }
}

bool MpiCore::stop_beats_locked() noexcept {
  if (!beats_) return false;
  if (beats_->recv != MPI_REQUEST_NULL) {
    MPI_Cancel(&beats_->recv);
    MPI_Status status;
    MPI_Wait(&beats_->recv, &status);  // a cancelled receive completes at once
  }
  bool active = false;
  for (MPI_Request& send : beats_->sends) {
    if (send == MPI_REQUEST_NULL) continue;
    int flag = 0;
    MPI_Status status;
    MPI_Test(&send, &flag, &status);
    if (!flag) {  // a peer that stopped reading: MPI finishes the send, the communicator stays
      active = true;
      MPI_Request_free(&send);
    }
  }
  beats_.reset();
  return active;
}

void MpiCore::stop_progress_thread() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    stop_requested_ = true;
  }
  pending_.notify_all();
  stop_.notify_all();
  if (progress_thread_.joinable()) progress_thread_.join();
  has_progress_thread_ = false;
}

void MpiCore::lock_counted(std::unique_lock<std::mutex>& lock) {
  wanted_.fetch_add(1, std::memory_order_relaxed);
  lock.lock();
  wanted_.fetch_sub(1, std::memory_order_relaxed);
}

std::unique_lock<std::mutex> MpiCore::acquire() {
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  lock_counted(lock);
  return lock;
}

void MpiCore::progress() {
  auto lock = acquire();
  progress_locked();
}

bool MpiCore::wait(MpiWork& work, Clock::time_point deadline) {
  // Note [MPI progress thread]. A started operation is driven by its waiter: one MPI_Test of it
  // (and the MPI_Improbe of receives posted meanwhile) at a time, the mutex released in between.
  // It spins for kSpinFor without yielding (a yield would hand the core to any other busy
  // process for a whole time slice), except to let in a thread that announced it waits for the
  // mutex; then it yields between tests until kDriveFor; then it tests once per progress
  // interval (at most kIdlePoll) and leaves the rest to the progress thread, which pauses while
  // a waiter drives. An unmatched receive has nothing to drive until its message arrives: after
  // kMatchSpin of progress rounds its waiter sleeps until a progress round (the progress
  // thread's, or another thread's) matches it, and runs a round itself every kIdlePoll.
  constexpr auto kMatchSpin = std::chrono::microseconds(200);
  constexpr auto kSpinFor = std::chrono::milliseconds(20);
  constexpr auto kDriveFor = std::chrono::milliseconds(100);
  constexpr auto kIdlePoll = std::chrono::milliseconds(1);
  const auto start = Clock::now();
  const auto backoff = std::min<Clock::duration>(interval_, kIdlePoll);
  Clock::time_point started_at{};
  // Counted in drivers_ while it drives continuously (the progress thread then pauses).
  struct Driving {
    std::atomic<int>& drivers;
    bool on = false;
    void set(bool value) {
      if (value != on) drivers.fetch_add(value ? 1 : -1, std::memory_order_relaxed);
      on = value;
    }
    ~Driving() { set(false); }
  } driving{drivers_};
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (work.done()) return true;
    if (work.started) {
      // Match the receives posted meanwhile too: their senders may be waiting for them (two
      // ranks that each wait on a send to the other). The progress thread pauses while a waiter
      // drives: the waiter beats.
      test_locked(work);
      if (!unmatched_.empty()) match_locked();
      beat_locked();
    } else {
      progress_locked();
    }
    if (work.done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (!work.started && now - start >= kMatchSpin) {
      // Note [Idle progress rounds]: while it sleeps here the progress thread runs its rounds
      // at the interval; woken, so that a longer idle sleep of the thread ends now.
      if (match_waiters_.fetch_add(1, std::memory_order_relaxed) == 0) stop_.notify_all();
      matched_.wait_until(lock, std::min(deadline, now + kIdlePoll),
                          [&] { return work.started || work.done(); });
      match_waiters_.fetch_sub(1, std::memory_order_relaxed);
      continue;
    }
    if (work.started && started_at == Clock::time_point{}) started_at = now;
    const auto driven = now - started_at;
    driving.set(work.started && driven < kDriveFor);
    lock.unlock();
    if (wanted_.load(std::memory_order_relaxed) > 0) {
      // std::mutex is not fair: let in whoever announced that it waits for it (the progress
      // thread, a post, an abort, another waiter), which may need this core (mpirun binds all
      // threads of a rank to one core).
      std::this_thread::yield();
      const auto until = Clock::now() + std::chrono::microseconds(20);
      while (wanted_.load(std::memory_order_relaxed) > 0 && Clock::now() < until) {
      }
    } else if (!work.started || driven < kSpinFor) {
      // spin
    } else if (driving.on) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(backoff);
    }
    lock_counted(lock);  // another waiter may be spinning too
  }
}

void MpiCore::abort(MpiWork* work, const Status& reason) {
  auto lock = acquire();
  const WorkInfo& info = work->info();
  if (info.op == OpKind::kRecv) {
    auto it = unmatched_.find({info.peer, info.tag});
    if (it != unmatched_.end()) {
      auto& queue = it->second;
      for (auto i = queue.begin(); i != queue.end(); ++i) {
        if (i->get() == work) {
          queue.erase(i);
          work->finish(reason);
          matched_.notify_all();
          return;
        }
      }
    }
  }
  auto it =
      std::find_if(active_.begin(), active_.end(), [&](const auto& w) { return w.get() == work; });
  if (it == active_.end()) {
    work->finish(reason);
    return;
  }
  std::shared_ptr<MpiWork> owned = *it;
  active_.erase(it);
  if (info.op == OpKind::kRecv && comm != MPI_COMM_NULL) MPI_Cancel(&owned->request);
  // MPI cannot withdraw a send (nor a matched receive): keep the request and the Work (with
  // its hold() objects) until MPI releases it (Note [Work contract]).
  int flag = 0;
  MPI_Status status;
  MPI_Test(&owned->request, &flag, &status);
  if (!flag) orphans_.push_back(owned);
  work->finish(reason);
}

void MpiCore::shutdown(std::chrono::milliseconds linger) noexcept {
  stop_progress_thread();
  bool beating = false;  // a heartbeat send MPI has not finished
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm != MPI_COMM_NULL) beating = stop_beats_locked();
  }
  const auto deadline = Clock::now() + linger;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      progress_locked();
      bool sends_left = std::any_of(active_.begin(), active_.end(),
                                    [](const auto& w) { return w->info().op == OpKind::kSend; });
      if (!sends_left || Clock::now() >= deadline) break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [key, queue] : unmatched_) {
    for (auto& work : queue) {
      work->finish(Status{StatusCode::kAborted, shutdown_message(work->info())});
    }
  }
  unmatched_.clear();
  matched_.notify_all();
  // A request MPI has not released may still read or write its buffers (a send, or a
  // receive matched by MPI_Improbe that MPI_Cancel cannot withdraw), so its Work and the
  // objects it holds are never freed: they move to a list that lives until the process
  // ends. This only happens when a peer failed or stopped; the memory is bounded by what
  // was in flight then.
  bool pending = beating;
  auto retire = [&](std::shared_ptr<MpiWork>& work) {
    int flag = 0;
    MPI_Status status;
    MPI_Test(&work->request, &flag, &status);
    if (!flag) {
      pending = true;
      unreleased().push_back(work);
    }
  };
  for (auto& work : active_) {
    if (work->info().op == OpKind::kRecv) MPI_Cancel(&work->request);
    retire(work);
    work->finish(Status{StatusCode::kAborted, shutdown_message(work->info())});
  }
  active_.clear();
  for (auto& work : orphans_) retire(work);
  orphans_.clear();
  // Operations still pending would run on a freed communicator inside the MPI library;
  // keep it when any request is still active.
  if (comm != MPI_COMM_NULL && !pending) MPI_Comm_free(&comm);
  comm = MPI_COMM_NULL;
}

std::vector<std::shared_ptr<MpiWork>>& MpiCore::unreleased() {
  static auto* works = new std::vector<std::shared_ptr<MpiWork>>();  // never destroyed
  return *works;
}

bool MpiCore::check_usable(const std::shared_ptr<MpiWork>& work) {
  const WorkInfo& info = work->info();
  if (comm == MPI_COMM_NULL) {
    work->finish(Status{StatusCode::kAborted, shutdown_message(info)});
    return false;
  }
  if (info.tag > tag_upper_bound) {
    work->finish(Status{StatusCode::kCommError,
                        concat("mpi transport: tag ", info.tag, " of ", info.describe(),
                               " exceeds MPI_TAG_UB = ", tag_upper_bound,
                               " of this MPI library; use smaller tags")});
    return false;
  }
  if (info.bytes > static_cast<size_t>(INT_MAX)) {
    work->finish(Status{StatusCode::kCommError,
                        concat("mpi transport: ", info.describe(),
                               " exceeds the 2 GiB limit of one MPI message; split the tensor")});
    return false;
  }
  return true;
}

void MpiCore::progress_locked() {
  if (comm == MPI_COMM_NULL) return;
  beat_locked();
  match_locked();
  for (auto it = active_.begin(); it != active_.end();) {
    auto& work = *it;
    int flag = 0;
    MPI_Status status;
    int rc = MPI_Test(&work->request, &flag, &status);
    if (rc != MPI_SUCCESS) {
      work->finish(mpi_failure("MPI_Test", rc, work->info()));
      it = active_.erase(it);
      continue;
    }
    if (!flag) {
      ++it;
      continue;
    }
    complete(*work);
    it = active_.erase(it);
  }
  for (auto it = orphans_.begin(); it != orphans_.end();) {
    int flag = 0;
    MPI_Status status;
    MPI_Test(&(*it)->request, &flag, &status);
    it = flag ? orphans_.erase(it) : std::next(it);
  }
}

void MpiCore::match_locked() {
  if (comm == MPI_COMM_NULL) return;
  bool left_unmatched = false;
  for (auto it = unmatched_.begin(); it != unmatched_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      int flag = 0;
      MPI_Message message = MPI_MESSAGE_NULL;
      MPI_Status status;
      const auto& work = queue.front();
      int rc =
          MPI_Improbe(comm_rank(it->first.first), it->first.second, comm, &flag, &message, &status);
      if (rc != MPI_SUCCESS) {
        work->finish(mpi_failure("MPI_Improbe", rc, work->info()));
        queue.pop_front();
        left_unmatched = true;
        continue;
      }
      if (!flag) break;
      start_matched_recv(work, message, status);
      queue.pop_front();
      left_unmatched = true;
    }
    it = queue.empty() ? unmatched_.erase(it) : std::next(it);
  }
  if (left_unmatched) matched_.notify_all();
}

void MpiCore::test_locked(MpiWork& work) {
  if (comm == MPI_COMM_NULL) return;
  int flag = 0;
  MPI_Status status;
  int rc = MPI_Test(&work.request, &flag, &status);
  if (rc == MPI_SUCCESS && !flag) return;
  auto it =
      std::find_if(active_.begin(), active_.end(), [&](const auto& w) { return w.get() == &work; });
  // Keep the Work alive until it is finished, whoever else holds it.
  std::shared_ptr<MpiWork> owned;
  if (it != active_.end()) {
    owned = std::move(*it);
    active_.erase(it);
  }
  if (rc != MPI_SUCCESS) {
    work.finish(mpi_failure("MPI_Test", rc, work.info()));
  } else {
    complete(work);
  }
}

void MpiCore::start_matched_recv(const std::shared_ptr<MpiWork>& work, MPI_Message& message,
                                 const MPI_Status& status) {
  const WorkInfo& info = work->info();
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  work->incoming = static_cast<size_t>(count);
  int rc = MPI_SUCCESS;
  if (info.any_size || work->incoming != info.bytes) {
    work->target = Buffer::allocate_for_tag(work->incoming, info.tag);
    rc = MPI_Imrecv(work->target.data(), count, MPI_BYTE, &message, &work->request);
  } else {
    void* base = nullptr;
    int n = 0;
    MPI_Datatype type = MPI_BYTE;
    rc = describe_spans(work->recv_spans, base, n, type);
    if (rc == MPI_SUCCESS) rc = MPI_Imrecv(base, n, type, &message, &work->request);
    if (type != MPI_BYTE) MPI_Type_free(&type);
  }
  if (rc != MPI_SUCCESS) {
    work->finish(mpi_failure("MPI_Imrecv", rc, info));
    return;
  }
  work->started = true;
  active_.push_back(work);
}

void MpiCore::complete(MpiWork& work) {
  const WorkInfo& info = work.info();
  if (info.op == OpKind::kSend) {
    work.finish(Status{});
    return;
  }
  if (work.target.data() != nullptr) {
    work.set_received(work.incoming, work.target);
    if (!info.any_size && work.incoming != info.bytes) {
      work.finish(Status{StatusCode::kSizeMismatch, size_mismatch_message(info, work.incoming)});
      return;
    }
  } else {
    work.set_received(work.incoming);
  }
  if (clocks) clocks->heard(info.peer);
  work.finish(Status{});
}

void MpiWork::progress() { core_->progress(); }

bool MpiWork::drive_until(Clock::time_point deadline) {
  if (!core_->has_progress_thread()) return Work::drive_until(deadline);
  return core_->wait(*this, deadline);
}

std::optional<Clock::duration> MpiWork::peer_silence() const {
  if (!core_->clocks) return std::nullopt;
  return core_->clocks->silence(info().peer);
}

void MpiWork::abort_impl(const Status& reason) noexcept {
  try {
    core_->abort(this, reason);
  } catch (...) {
    finish(reason);
  }
}

}  // namespace pipemat::comm::detail::mpi
