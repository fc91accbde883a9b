#pragma once
// How remat's code counts its work into the calling thread's RematCounters (stats.h): one slot per
// counter, bumped where the event happens (stats.cpp holds the slots and the field table).

#include <cstdint>

namespace pipemat::remat::detail {

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

}  // namespace pipemat::remat::detail
