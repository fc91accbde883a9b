// MPI backend (Open MPI).
//
// * MPI is initialized on first use at MPI_THREAD_MULTIPLE through a process-wide RAII object,
//   and finalized at exit only if pipemat initialized it.
// * The transport works on its own duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN, so every
//   failure comes back as a code and becomes a Status with MPI_Error_string, the call and rank.
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

#include "mpi/transport.h"

// The C API only; the deprecated C++ bindings would add link dependencies for nothing.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "common.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail {
namespace {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<size_t>(length));
}

Status mpi_failure(const char* call, int code, const WorkInfo& info) {
  return Status{StatusCode::kCommError,
                concat(call, " failed on rank ", info.rank, " during ", info.describe(), ": ",
                       mpi_error_string(code), " (MPI error code ", code, ")")};
}

}  // namespace

namespace mpi {

// Note [MPI lifetime]
// MPI can be initialized once per process and never again after MPI_Finalize. So the
// environment is one process-wide RAII object, created on first use and kept alive by every
// transport and by a static reference until static destruction at exit; only then, and only if
// pipemat was the one to call MPI_Init_thread, is MPI finalized. A program that initializes MPI
// itself keeps full control: pipemat never finalizes it.
class MpiEnvironment {
 public:
  static std::shared_ptr<MpiEnvironment> acquire() {
    static std::mutex mutex;
    static std::shared_ptr<MpiEnvironment> instance;
    std::lock_guard<std::mutex> lock(mutex);
    if (!instance) instance = std::shared_ptr<MpiEnvironment>(new MpiEnvironment());
    return instance;
  }

  ~MpiEnvironment() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

 private:
  MpiEnvironment() {
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

 public:
  // The progress thread calls MPI while the program may too (its own MPI calls, the raw
  // baseline of bench p2p): it runs only at MPI_THREAD_MULTIPLE.
  bool thread_multiple() const { return thread_multiple_; }

 private:
  bool owns_ = false;
  bool thread_multiple_ = false;
};

}  // namespace mpi

namespace {

using mpi::MpiEnvironment;

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

class MpiCore {
 public:
  MPI_Comm comm = MPI_COMM_NULL;
  long tag_upper_bound = 32767;

  void post_send(const std::shared_ptr<MpiWork>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    const WorkInfo& info = work->info();
    if (!check_usable(work)) return;
    void* base = nullptr;
    int count = 0;
    MPI_Datatype type = MPI_BYTE;
    int rc = describe_spans(work->send_spans, base, count, type);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Isend(base, count, type, info.peer, info.tag, comm, &work->request);
    }
    if (type != MPI_BYTE) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) {
      work->finish(mpi_failure("MPI_Isend", rc, info));
      return;
    }
    active_.push_back(work);
    pending_.notify_one();
  }

  void post_recv(const std::shared_ptr<MpiWork>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!check_usable(work)) return;
    const WorkInfo& info = work->info();
    unmatched_[{info.peer, info.tag}].push_back(work);
    progress_locked();
    pending_.notify_one();
  }

  ~MpiCore() { stop_progress_thread(); }

  bool has_progress_thread() const { return has_progress_thread_; }

  // Note [MPI progress thread]. Called once, after `comm` is set.
  void start_progress_thread(std::chrono::microseconds interval) {
    if (interval.count() <= 0) return;
    has_progress_thread_ = true;
    progress_thread_ = std::thread([this, interval] {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!stopping_) {
        if (unmatched_.empty() && active_.empty()) {
          pending_.wait(lock, [&] { return stopping_ || !unmatched_.empty() || !active_.empty(); });
          continue;
        }
        progress_locked();
        lock.unlock();
        std::this_thread::sleep_for(interval);
        lock.lock();
      }
    });
  }

  void stop_progress_thread() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    pending_.notify_all();
    if (progress_thread_.joinable()) progress_thread_.join();
    has_progress_thread_ = false;
  }

  void progress() {
    std::lock_guard<std::mutex> lock(mutex_);
    progress_locked();
  }

  void abort(MpiWork* work, const Status& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    const WorkInfo& info = work->info();
    if (info.op == OpKind::kRecv) {
      auto it = unmatched_.find({info.peer, info.tag});
      if (it != unmatched_.end()) {
        auto& queue = it->second;
        for (auto i = queue.begin(); i != queue.end(); ++i) {
          if (i->get() == work) {
            queue.erase(i);
            work->finish(reason);
            return;
          }
        }
      }
    }
    auto it = std::find_if(active_.begin(), active_.end(),
                           [&](const auto& w) { return w.get() == work; });
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

  // Destructor path: drain sends (bounded), then fail and release everything. Never throws.
  void shutdown(std::chrono::milliseconds linger) noexcept {
    stop_progress_thread();
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
    // A request MPI has not released may still read or write its buffers (a send, or a
    // receive matched by MPI_Improbe that MPI_Cancel cannot withdraw), so its Work and the
    // objects it holds are never freed: they move to a list that lives until the process
    // ends. This only happens when a peer failed or stopped; the memory is bounded by what
    // was in flight then.
    bool pending = false;
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

  static std::vector<std::shared_ptr<MpiWork>>& unreleased() {
    static auto* works = new std::vector<std::shared_ptr<MpiWork>>();  // never destroyed
    return *works;
  }

 private:
  bool check_usable(const std::shared_ptr<MpiWork>& work) {
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

  void progress_locked() {
    if (comm == MPI_COMM_NULL) return;
    for (auto it = unmatched_.begin(); it != unmatched_.end();) {
      auto& queue = it->second;
      while (!queue.empty()) {
        int flag = 0;
        MPI_Message message = MPI_MESSAGE_NULL;
        MPI_Status status;
        const auto& work = queue.front();
        int rc = MPI_Improbe(it->first.first, it->first.second, comm, &flag, &message, &status);
        if (rc != MPI_SUCCESS) {
          work->finish(mpi_failure("MPI_Improbe", rc, work->info()));
          queue.pop_front();
          continue;
        }
        if (!flag) break;
        start_matched_recv(work, message, status);
        queue.pop_front();
      }
      it = queue.empty() ? unmatched_.erase(it) : std::next(it);
    }
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
      complete(work);
      it = active_.erase(it);
    }
    for (auto it = orphans_.begin(); it != orphans_.end();) {
      int flag = 0;
      MPI_Status status;
      MPI_Test(&(*it)->request, &flag, &status);
      it = flag ? orphans_.erase(it) : std::next(it);
    }
  }

  void start_matched_recv(const std::shared_ptr<MpiWork>& work, MPI_Message& message,
                          const MPI_Status& status) {
    const WorkInfo& info = work->info();
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    work->incoming = static_cast<size_t>(count);
    int rc = MPI_SUCCESS;
    if (info.any_size || work->incoming != info.bytes) {
      work->target = Buffer::allocate(work->incoming);
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
    active_.push_back(work);
  }

  static void complete(const std::shared_ptr<MpiWork>& work) {
    const WorkInfo& info = work->info();
    if (info.op == OpKind::kSend) {
      work->finish(Status{});
      return;
    }
    if (work->target.data() != nullptr) {
      work->set_received(work->incoming, work->target);
      if (!info.any_size && work->incoming != info.bytes) {
        work->finish(
            Status{StatusCode::kSizeMismatch, size_mismatch_message(info, work->incoming)});
        return;
      }
    } else {
      work->set_received(work->incoming);
    }
    work->finish(Status{});
  }

  std::mutex mutex_;
  std::condition_variable pending_;  // signalled when an operation is posted or on stop
  bool stopping_ = false;
  std::atomic<bool> has_progress_thread_{false};
  std::thread progress_thread_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<MpiWork>>> unmatched_;
  std::vector<std::shared_ptr<MpiWork>> active_;
  std::vector<std::shared_ptr<MpiWork>> orphans_;
};

void MpiWork::progress() { core_->progress(); }
bool MpiWork::progress_thread() const { return core_->has_progress_thread(); }

void MpiWork::abort_impl(const Status& reason) noexcept {
  try {
    core_->abort(this, reason);
  } catch (...) {
    finish(reason);
  }
}

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

class MpiTransport final : public Transport {
 public:
  MpiTransport(const TransportOptions& options, std::shared_ptr<MpiEnvironment> env, CommInfo world)
      : Transport(TransportKind::kMpi, world.rank, world.world_size, options.timeout),
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

 protected:
  WorkPtr post_send(Request request) override {
    auto work = std::make_shared<MpiWork>(request.info, timeout(), core_);
    work->hold(std::move(request.keep_alive));
    work->send_spans = std::move(request.send_spans);
    core_->post_send(work);
    return work;
  }

  WorkPtr post_recv(Request request) override {
    auto work = std::make_shared<MpiWork>(request.info, timeout(), core_);
    work->hold(std::move(request.keep_alive));
    work->recv_spans = std::move(request.recv_spans);
    core_->post_recv(work);
    return work;
  }

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

std::shared_ptr<mpi::MpiEnvironment> mpi::acquire_environment() {
  return MpiEnvironment::acquire();
}

}  // namespace pipemat::comm::detail

namespace pipemat::comm {

void abort_job(int exit_code) noexcept {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

}  // namespace pipemat::comm
