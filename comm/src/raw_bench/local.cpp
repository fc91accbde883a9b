// The local baseline of raw_pingpong_seconds: one memcpy per direction between the two threads,
// handed over by an atomic turn in the group's mailbox.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "local/transport.h"
#include "pipemat/core/error.h"
#include "raw_bench/baselines.h"

namespace pipemat::comm::detail {
namespace {

void wait_turn(const std::atomic<long>& turn, long value) {
  for (int spins = 0; turn.load(std::memory_order_acquire) != value; ++spins) {
    if (spins > 1000) std::this_thread::yield();
  }
}

}  // namespace

double local_raw_pingpong(Transport& transport, int peer, size_t bytes, int iterations,
                          int warmup) {
  local::RawPingPong* mailbox = local::raw_pingpong_mailbox(transport);
  PIPEMAT_INTERNAL_ASSERT(mailbox != nullptr, "local_raw_pingpong on a non-local transport");
  local::RawPingPong& raw = *mailbox;
  const bool lower = transport.rank() < peer;
  std::vector<uint8_t> mine(std::max<size_t>(bytes, 1), 1);
  if (lower) raw.turn.store(0);
  raw.buffers[lower ? 0 : 1] = mine.data();
  transport.barrier();
  void* other = raw.buffers[lower ? 1 : 0];
  Clock::time_point start;
  for (long i = 0; i < warmup + iterations; ++i) {
    if (i == warmup) start = Clock::now();
    if (lower) {
      std::memcpy(other, mine.data(), bytes);
      raw.turn.store(2 * i + 1, std::memory_order_release);
      wait_turn(raw.turn, 2 * i + 2);
    } else {
      wait_turn(raw.turn, 2 * i + 1);
      std::memcpy(other, mine.data(), bytes);
      raw.turn.store(2 * i + 2, std::memory_order_release);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  transport.barrier();
  return seconds / iterations;
}

}  // namespace pipemat::comm::detail
