#include "pipemat/remat/stats.h"

#include "counters.h"

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

namespace {

// Every counter once: its slot, its member and its name in str(). counters(), += and str() read
// this table, so a new counter is one line here (and one in detail::Counter, counters.h, and the
// struct).
struct CounterField {
  detail::Counter counter;
  int64_t RematCounters::*member;
  const char* name;
};

constexpr CounterField kFields[] = {
    {detail::Counter::kUnitCalls, &RematCounters::unit_calls, "units"},
    {detail::Counter::kReplays, &RematCounters::replays, "replays"},
    {detail::Counter::kEarlyStops, &RematCounters::early_stops, "early_stops"},
    {detail::Counter::kSaveCalls, &RematCounters::save_calls, "save_calls"},
    {detail::Counter::kSaveSkips, &RematCounters::save_skips, "save_skips"},
    {detail::Counter::kPacks, &RematCounters::packs, "handles"},
    {detail::Counter::kSaveKept, &RematCounters::save_kept, "save_kept"},
    {detail::Counter::kOutputLeaves, &RematCounters::output_leaves, "output_leaves"},
    {detail::Counter::kPlaceholders, &RematCounters::placeholders, "placeholders"},
};
static_assert(sizeof(kFields) / sizeof(kFields[0]) == kNumCounters, "one field per counter");

}  // namespace

RematCounters counters() {
  RematCounters out;
  for (const CounterField& f : kFields) out.*f.member = g_counters[static_cast<int>(f.counter)];
  return out;
}

void reset_counters() {
  for (auto& c : g_counters) c = 0;
}

RematCounters& RematCounters::operator+=(const RematCounters& o) {
  for (const CounterField& f : kFields) this->*f.member += o.*f.member;
  return *this;
}

std::string RematCounters::str() const {
  std::ostringstream os;
  const char* separator = "";
  for (const CounterField& f : kFields) {
    os << separator << f.name << "=" << this->*f.member;
    separator = " ";
  }
  return os.str();
}

}  // namespace pipemat::remat
