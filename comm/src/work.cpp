#include "pipemat/comm/work.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

#include "common.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::comm {
namespace {

void* default_allocate(size_t bytes) { return std::aligned_alloc(Buffer::kAlignment, bytes); }
void default_release(void* data) { std::free(data); }

// A year is "forever" and keeps now() + 2 * timeout from overflowing.
std::chrono::milliseconds capped(std::chrono::milliseconds timeout) {
  return std::min(timeout, std::chrono::milliseconds(std::chrono::hours(24 * 365)));
}

std::mutex g_memory_mutex;
BufferMemory g_memory{&default_allocate, &default_release};

}  // namespace

void set_buffer_memory(BufferMemory memory) {
  PIPEMAT_CHECK((memory.allocate == nullptr) == (memory.release == nullptr), ConfigError,
                "set_buffer_memory: allocate and release must both be set or both be null");
  if (memory.allocate == nullptr) memory = {&default_allocate, &default_release};
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  g_memory = memory;
}

BufferMemory buffer_memory() {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  return g_memory;
}

Buffer Buffer::allocate(size_t size) {
  const BufferMemory memory = buffer_memory();
  return from(memory.allocate, memory.release, size);
}

Buffer Buffer::allocate_control(size_t size) {
  return from(&default_allocate, &default_release, size);
}

Buffer Buffer::allocate_for_tag(size_t size, int tag) {
  return tag > kMaxUserTag ? allocate_control(size) : allocate(size);
}

Buffer Buffer::from(void* (*allocate)(size_t), void (*release)(void*), size_t size) {
  Buffer buffer;
  // A size from the wire can be anything: rounding up must not wrap around to a small block.
  if (size > std::numeric_limits<size_t>::max() - (kAlignment - 1)) throw std::bad_alloc();
  size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded == 0) rounded = kAlignment;
  void* raw = allocate(rounded);
  if (raw == nullptr) throw std::bad_alloc();
  buffer.storage_ =
      std::shared_ptr<uint8_t>(static_cast<uint8_t*>(raw), [release](uint8_t* p) { release(p); });
  buffer.size_ = size;
  return buffer;
}

std::string WorkInfo::describe() const {
  std::string what = op == OpKind::kSend ? "send" : "recv";
  if (any_size) {
    what += " (any size)";
  } else {
    what += " of " + std::to_string(bytes) + " bytes";
    if (bytes >= 1024) what += " (" + format_bytes(static_cast<int64_t>(bytes)) + ")";
  }
  what += op == OpKind::kSend ? " to rank " : " from rank ";
  what += std::to_string(peer) + " with tag " + std::to_string(tag);
  what += (op == OpKind::kSend ? " from rank " : " on rank ") + std::to_string(rank);
  what += " (" + transport + ")";
  return what;
}

namespace detail {

std::string size_mismatch_message(const WorkInfo& info, size_t sent_bytes) {
  return concat("message size mismatch on tag ", info.tag, ": rank ", info.peer, " sent ",
                sent_bytes, " bytes, but rank ", info.rank, " posted a recv of ", info.bytes,
                " bytes (", info.transport,
                "). Both ranks must agree on every message of a (peer, tag) pair; check the "
                "shapes the two stages exchange, or receive with recv_any.");
}

std::string peer_failure_message(const WorkInfo& info, const std::string& what_happened) {
  return concat(
      what_happened, " while rank ", info.rank, " was waiting for ", info.describe(),
      ". The peer process probably exited or crashed, or the network to it failed; look at its "
      "log first.");
}

std::string shutdown_message(const WorkInfo& info) {
  return concat("the transport of rank ", info.rank, " was destroyed before the ", info.describe(),
                " finished");
}

}  // namespace detail

Work::Work(WorkInfo info, std::chrono::milliseconds default_timeout)
    : info_(std::move(info)), default_timeout_(default_timeout) {}

Work::~Work() = default;

bool Work::is_completed() {
  if (needs_progress()) progress();
  return done_.load(std::memory_order_acquire);
}

void Work::wait() {
  // Note [Liveness of a peer]: past the timeout, a peer that is alive extends the wait (up to
  // twice the timeout); one that has been silent for the timeout ends it.
  const auto timeout = std::chrono::duration_cast<Clock::duration>(capped(default_timeout_));
  const auto start = Clock::now();
  for (;;) {
    const auto now = Clock::now();
    const std::optional<Clock::duration> silence = peer_silence();
    auto deadline = start + timeout;
    if (silence)
      deadline = std::min(std::max(deadline, now - *silence + timeout), start + 2 * timeout);
    if (now >= deadline) {
      time_out(now - start);
      break;
    }
    if (wait_until(deadline)) break;
  }
  Status s = status();
  if (!s.ok()) throw_status(s);
}

void Work::wait(std::chrono::milliseconds timeout) {
  timeout = capped(timeout);
  if (!wait_until(Clock::now() + timeout)) time_out(timeout);
  Status s = status();
  if (!s.ok()) throw_status(s);
}

void Work::time_out(Clock::duration waited) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(waited);
  const std::optional<Clock::duration> silence = peer_silence();
  const int peer = info_.peer;
  const char* verb = info_.op == OpKind::kRecv ? "send" : "receive";
  std::string why;
  if (!silence) {
    why = detail::concat("rank ", peer, " did not ", verb,
                         " in time: check that both ranks post the matching operation with the "
                         "same tag (a schedule mismatch or deadlock) and that the peer is not "
                         "stalled");
  } else if (*silence >= waited / 2) {
    // Silent for the second half of the wait at least: a wait may begin just before the peer's
    // last message (the operation was posted early).
    why = detail::concat(
        "Nothing arrived from rank ", peer, " for the last ",
        format_fixed(std::chrono::duration<double>(*silence).count(), 1),
        " s, not even its heartbeat: it is stalled or unreachable (a stopped or hung process, a "
        "stalled or cut network between the hosts)");
  } else {
    why = detail::concat(
        "Rank ", peer, " is alive (it was last heard from ",
        std::chrono::duration_cast<std::chrono::milliseconds>(*silence).count(),
        " ms ago) but did not ", verb,
        " this one: check that both ranks post the matching operation with the same tag (a "
        "schedule mismatch or deadlock), or look at its log for what it waits for");
  }
  abort_impl(Status{StatusCode::kTimeout,
                    detail::concat("timed out after ", ms.count(), " ms waiting for ",
                                   info_.describe(), ". ", why,
                                   "; or raise the timeout (TransportOptions::timeout, "
                                   "PIPEMAT_COMM_TIMEOUT seconds).")});
}

void Work::abort() noexcept {
  {
    if (done_.load(std::memory_order_acquire)) return;
  }
  abort_impl(Status{StatusCode::kAborted, "aborted by the caller: " + info_.describe()});
}

Status Work::status() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return status_;
}

size_t Work::received_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return received_bytes_;
}

Buffer Work::buffer() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return buffer_;
}

void Work::hold(std::shared_ptr<const void> object) {
  if (!object) return;
  std::lock_guard<std::mutex> lock(mutex_);
  held_.push_back(std::move(object));
}

bool Work::finish(Status status) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_.load()) return false;
    status_ = std::move(status);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  return true;
}

void Work::set_received(size_t bytes, Buffer buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  received_bytes_ = bytes;
  buffer_ = std::move(buffer);
}

bool Work::wait_until(Clock::time_point deadline) {
  if (needs_progress()) return drive_until(deadline);
  // Completion comes from another thread. Spin first: a handoff between two threads through a
  // condition variable costs tens of microseconds of wake-up latency, which dominates small
  // pipeline messages.
  const auto spin_until = std::min(deadline, Clock::now() + std::chrono::microseconds(200));
  for (int i = 0; !done_.load(std::memory_order_acquire); ++i) {
    if ((i & 63) == 0) {
      if (Clock::now() >= spin_until) break;
      // The completing thread may be waiting for this very core (oversubscribed machines).
      if (i > 0) std::this_thread::yield();
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_until(lock, deadline, [&] { return done_.load(); });
}

bool Work::drive_until(Clock::time_point deadline) {
  // The waiter drives the transfer. Spin for a few milliseconds (a large message needs
  // continuous progress), then yield, then sleep briefly so that an idle rank does not steal
  // the core of a computing neighbour.
  const auto start = Clock::now();
  for (;;) {
    progress();
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    const auto waited = now - start;
    if (waited < std::chrono::milliseconds(5)) {
      continue;
    } else if (waited < std::chrono::milliseconds(100)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

void Work::throw_status(const Status& status) const {
  if (status.code == StatusCode::kTimeout) throw TimeoutError(status.message);
  throw CommError(status.message);
}

}  // namespace pipemat::comm
