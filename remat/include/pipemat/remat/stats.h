#pragma once
// remat counters and host overhead of the calling thread (a pipeline rank counts its own work;
// in-process runs have one thread per rank), for progress lines, tests and benchmarks.

#include <cstdint>
#include <string>

namespace pipemat::remat {

struct RematCounters {
  int64_t unit_calls = 0;     // checkpoint-unit forwards
  int64_t replays = 0;        // replays run (lazy or pre-triggered)
  int64_t early_stops = 0;    // replays that stopped before the end of the unit
  int64_t save_calls = 0;     // SAVE bodies run in forward
  int64_t save_skips = 0;     // SAVE bodies skipped in replay
  int64_t packs = 0;          // tensors saved as replay handles
  int64_t save_kept = 0;      // tensors kept for SAVE regions' own backward
  int64_t output_leaves = 0;  // tensor leaves of save_output=false outputs in forward
  int64_t placeholders = 0;   // placeholders handed out in replay for them
  std::string str() const;
  RematCounters& operator+=(const RematCounters& other);
};

RematCounters counters();
void reset_counters();

// Host time this thread spent in remat's own code (wrappers, hooks, replay bookkeeping; not the
// wrapped bodies, not autograd), in nanoseconds since the last reset. Measured by switching a
// thread-local clock between "remat" and "user code" at every boundary.
int64_t host_overhead_ns();
void reset_host_overhead();

}  // namespace pipemat::remat
