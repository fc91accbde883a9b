#include "pipemat/remat/stats.h"

#include <sstream>

namespace pipemat::remat {
namespace {
constexpr int kNumCounters = 9;
// Per thread: a pipeline rank is a process (mpi, tcp) or a thread (in-process runs), and every
// rank counts its own work.
thread_local int64_t g_counters[kNumCounters];
}  // namespace

namespace detail {
void bump(Counter c, int64_t n) { g_counters[static_cast<int>(c)] += n; }
}  // namespace detail

RematCounters counters() {
  auto get = [](detail::Counter c) { return g_counters[static_cast<int>(c)]; };
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
  for (auto& c : g_counters) c = 0;
}

RematCounters& RematCounters::operator+=(const RematCounters& o) {
  unit_calls += o.unit_calls;
  replays += o.replays;
  early_stops += o.early_stops;
  save_calls += o.save_calls;
  save_skips += o.save_skips;
  packs += o.packs;
  save_kept += o.save_kept;
  output_leaves += o.output_leaves;
  placeholders += o.placeholders;
  return *this;
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
