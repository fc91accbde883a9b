#pragma once
// remat counters of the calling thread (a pipeline rank counts its own work; in-process runs
// have one thread per rank), for progress lines, tests and benchmarks.

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

namespace detail {
enum class Counter {
  kUnitCalls,
  kReplays,
  kEarlyStops,
  kSaveCalls,
  kSaveSkips,
  kPacks,
  kSaveKept,
  kOutputLeaves,
  kPlaceholders,
};
void bump(Counter c, int64_t n = 1);
}  // namespace detail

}  // namespace pipemat::remat
