#include "pipemat/remat/stats.h"

#include <atomic>
#include <sstream>

namespace pipemat::remat {
namespace {
constexpr int kNumCounters = 9;
std::atomic<int64_t> g_counters[kNumCounters];
}  // namespace

namespace detail {
void bump(Counter c, int64_t n) {
  g_counters[static_cast<int>(c)].fetch_add(n, std::memory_order_relaxed);
}
}  // namespace detail

RematCounters counters() {
  auto get = [](detail::Counter c) {
    return g_counters[static_cast<int>(c)].load(std::memory_order_relaxed);
  };
  RematCounters out;
  out.unit_calls = get(detail::Counter::kUnitCalls);
  out.replays = get(detail::Counter::kReplays);
  out.early_stops = get(detail::Counter::kEarlyStops);
  out.save_calls = get(detail::Counter::kSaveCalls);
  out.save_skips = get(detail::Counter::kSaveSkips);
  out.packs = get(detail::Counter::kPacks);
  out.save_kept = get(detail::Counter::kSaveKept);
  out.output_leaves = get(detail::Counter::kOutputLeaves);
  out.placeholders = get(detail::Counter::kPlaceholders);
  return out;
}

void reset_counters() {
  for (auto& c : g_counters) c.store(0, std::memory_order_relaxed);
}

std::string RematCounters::str() const {
  std::ostringstream os;
  os << "units=" << unit_calls << " replays=" << replays << " early_stops=" << early_stops
     << " save_calls=" << save_calls << " save_skips=" << save_skips << " handles=" << packs
     << " save_kept=" << save_kept << " output_leaves=" << output_leaves
     << " placeholders=" << placeholders;
  return os.str();
}

}  // namespace pipemat::remat
