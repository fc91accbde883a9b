#pragma once
// Completion handles of the comm module.
//
// Every send/recv of a Transport returns a `WorkPtr` at once; the bytes move in the background
// (local: the peer's thread, tcp: the transport's I/O thread, mpi: the progress driven by any
// wait/is_completed on that transport). A Work is finished exactly once, either successfully or
// with an error status; the error is stored as a value and only turned into an exception by
// `wait()` (Note [Work contract]).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace pipemat::comm {

using Clock = std::chrono::steady_clock;

// Shared, 64-byte aligned byte storage allocated by a transport: the target of `recv_any` and
// of receives whose size did not match. Cheap to copy (shared ownership); `storage()` can be
// handed to other owners (e.g. a tensor deleter) to keep the bytes alive without copying them.
class Buffer {
 public:
  static constexpr size_t kAlignment = 64;

  Buffer() = default;
  // `size` bytes (uninitialised), rounded up to a multiple of kAlignment internally. Throws
  // std::bad_alloc when the memory cannot be had, including sizes that do not fit in size_t
  // once rounded (never a smaller block than asked for).
  static Buffer allocate(size_t size);
  // The same from std::aligned_alloc, never from the process's BufferMemory: the transports'
  // own control messages (tags above kMaxUserTag: barrier tokens) are no bytes the user holds, so
  // a barrier never shows in what a rank measures. `for_tag` picks by tag.
  static Buffer allocate_control(size_t size);
  static Buffer allocate_for_tag(size_t size, int tag);

  uint8_t* data() const { return storage_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::shared_ptr<uint8_t>& storage() const { return storage_; }

 private:
  static Buffer from(void* (*allocate)(size_t), void (*release)(void*), size_t size);
  std::shared_ptr<uint8_t> storage_;
  size_t size_ = 0;
};

// Where Buffer::allocate takes its bytes. `allocate(bytes)` returns `bytes` bytes aligned to
// Buffer::kAlignment, or nullptr when it cannot (Buffer::allocate then throws std::bad_alloc);
// `release` frees what it returned. The default is std::aligned_alloc / std::free. A process
// that measures its memory routes them through its allocator (pp: the tracking allocator, so a
// step's peak counts the messages it received). Process-wide; a buffer is always freed by the
// `release` of the memory that allocated it, so switching while buffers live is safe.
struct BufferMemory {
  void* (*allocate)(size_t bytes) = nullptr;
  void (*release)(void* data) = nullptr;
};
// Both set, or both null for the default; ConfigError for one without the other.
void set_buffer_memory(BufferMemory memory);
BufferMemory buffer_memory();

enum class OpKind { kSend, kRecv };

// What a Work is doing; used in every message about it.
struct WorkInfo {
  OpKind op = OpKind::kSend;
  int rank = -1;  // this rank
  int peer = -1;  // the other rank
  int tag = -1;
  size_t bytes = 0;       // bytes sent, or bytes the receive was posted for
  bool any_size = false;  // recv_any: size decided by the sender
  std::string transport;  // "local", "tcp", "mpi"

  // "recv of 4.00 KiB (4096 bytes) from rank 1 with tag 7 on rank 0 (tcp)"
  std::string describe() const;
};

enum class StatusCode {
  kOk,
  kCommError,     // peer gone, connection broken, MPI error, ...
  kSizeMismatch,  // the sender's message size differs from the posted receive
  kTimeout,       // wait() passed its deadline (thrown as TimeoutError)
  kAborted,       // abort() by the caller or transport shut down
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;
  bool ok() const { return code == StatusCode::kOk; }
};

class Work;
using WorkPtr = std::shared_ptr<Work>;

// Note [Work contract]
// `wait(timeout)` is equivalent to
//
//     auto deadline = now() + timeout;
//     while (!is_completed()) {
//       if (now() >= deadline) { abort-with-timeout(); break; }   // see below
//       block-or-yield();
//     }
//     if (!status().ok()) throw the stored error;   // CommError, or TimeoutError for kTimeout
//
// * A wait that times out aborts the operation (Note [Abort after timeout]) and throws
//   TimeoutError naming the operation, the peer, the tag and this rank. If the operation finished
//   in the race with the abort, wait() returns normally.
// * `wait()` without a timeout bounds the wait by the peer's liveness (Note [Liveness of a peer]).
// * Every later wait() rethrows the same stored error; is_completed() stays true.
// * `abort()` withdraws an unfinished operation; on return the transport no longer writes into
//   (recv) or reads from (send) the caller's memory — except where MPI cannot withdraw it: a
//   send, and a receive already matched (MPI_Improbe + MPI_Imrecv: its bytes are arriving).
//   Those keep the Work and its `hold()` objects alive until MPI releases the request (to the
//   end of the process if it never does), so memory passed as `keep_alive` is never freed under
//   MPI's hands; the tensor layer (tensor.h) receives only into tensors it holds that way. A
//   raw-pointer receive without keep_alive must keep its memory until the Work completes.
// * Threading: all members are thread-safe. Several threads may wait on the same Work.
// * Ownership: for raw-pointer send/recv the caller keeps the memory alive and untouched until
//   the Work is completed (or wait() threw). Objects passed to hold() live as long as the Work.
//
// Note [Liveness of a peer]
// The tcp and mpi transports send every peer a heartbeat (an empty control message) every
// quarter of their timeout (between 20 ms and 1 s), from their I/O or progress thread, and note
// when anything, a heartbeat or a message, last arrived from each peer. A process that is
// stopped, hung in the kernel or cut off falls silent; one that is only waiting (on another rank)
// or computing keeps beating. `wait()` uses that to blame the right rank when a job stalls:
//
//   * it times out once the transport's timeout has passed and the peer has been silent for that
//     long (a stalled or unreachable peer);
//   * a peer that is alive gets up to twice the timeout (a schedule mismatch or deadlock between
//     live ranks still ends, with a message saying the peer is alive).
//
// In a chain of waits (rank 2 waits for rank 0, which waits for a stopped rank 1) the rank next to
// the stalled one thus times out first and its message, naming rank 1, is the job's first error,
// whatever order the waits began in. The local transport (threads of one process, which cannot
// stall alone) and an mpi transport without a progress thread keep no liveness: there `wait()`
// times out after the timeout, like `wait(timeout)`, which never extends.
//
// Note [Abort after timeout]
// On local and mpi a receive that has not started is simply withdrawn; the transport stays
// usable. On tcp an operation that is mid-transfer cannot be withdrawn without desynchronising
// the byte stream, so the connection to that peer is closed and later operations with that peer
// fail with CommError.
class Work {
 public:
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  virtual ~Work();

  // Non-blocking. True once the operation finished, successfully or not. On mpi it also drives
  // the transport's progress.
  bool is_completed();

  // Blocks until completion, bounded by the transport's timeout (TransportOptions::timeout) as
  // Note [Liveness of a peer] says: at least the timeout, and up to twice it while the peer is
  // alive. Throws CommError / TimeoutError.
  void wait();
  // The same, bounded by exactly `timeout` (Note [Work contract]).
  void wait(std::chrono::milliseconds timeout);

  // Withdraws the operation if it has not finished; the Work then holds kAborted. No-op when
  // already completed. Never throws.
  void abort() noexcept;

  // kOk while pending or after success; the stored error after a failure.
  Status status() const;

  const WorkInfo& info() const { return info_; }
  std::chrono::milliseconds default_timeout() const { return default_timeout_; }
  // Note [Liveness of a peer]: how long ago anything last arrived from the peer; nullopt when the
  // backend keeps no liveness. (A work layered on another, as a device lane's, asks this.)
  std::optional<Clock::duration> silence() const { return peer_silence(); }

  // recv: the number of bytes that arrived (valid after completion, also on kSizeMismatch).
  size_t received_bytes() const;
  // recv_any, or a recv whose size did not match: the transport-allocated bytes. Empty otherwise.
  Buffer buffer() const;

  // Keeps `object` alive for the lifetime of this Work (e.g. the tensor whose bytes are sent).
  void hold(std::shared_ptr<const void> object);

 protected:
  Work(WorkInfo info, std::chrono::milliseconds default_timeout);

  // ---- the backend's side: only the transport that owns a Work completes it ----

  // Completes the work; the first call wins and wakes all waiters. Returns true if this call
  // completed it.
  bool finish(Status status);
  // Records what arrived (recv). Call before finish().
  void set_received(size_t bytes, Buffer buffer = {});

  // Drives the backend's progress (mpi); default: nothing, completion comes from elsewhere.
  virtual void progress() {}
  // True when completion is driven by progress() calls; wait() then blocks in drive_until().
  virtual bool needs_progress() const { return false; }
  // needs_progress() backends: blocks until the Work finished or `deadline` passed, driving the
  // transfer; true when finished. The default polls progress(): it spins for 5 ms, then yields
  // between polls, then sleeps 100 us between them after 100 ms. The mpi backend with a
  // progress thread replaces it.
  virtual bool drive_until(Clock::time_point deadline);
  // Note [Liveness of a peer]: how long ago anything (a message or a heartbeat) last arrived
  // from the peer; nullopt when the backend keeps no liveness.
  virtual std::optional<Clock::duration> peer_silence() const { return std::nullopt; }
  // True once finished (successfully or not); drives nothing.
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Withdraws the operation and finishes it with `reason` unless it finished meanwhile. On
  // return the backend must no longer touch the caller's memory (Note [Work contract]).
  virtual void abort_impl(const Status& reason) noexcept = 0;

 private:
  // Blocks until completed or the deadline; true when completed.
  bool wait_until(Clock::time_point deadline);
  // Aborts with kTimeout after a wait of `waited`, naming the operation and what the peer did.
  void time_out(Clock::duration waited);
  [[noreturn]] void throw_status(const Status& status) const;

  const WorkInfo info_;
  const std::chrono::milliseconds default_timeout_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};  // written under mutex_, read lock-free by spinning waiters
  Status status_;
  size_t received_bytes_ = 0;
  Buffer buffer_;
  std::vector<std::shared_ptr<const void>> held_;
};

}  // namespace pipemat::comm
