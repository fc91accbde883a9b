// remat's host-overhead clock (overhead_clock.h) and its public readers (stats.h).

#include "overhead_clock.h"

#include <chrono>
#include <cstdint>

#include "pipemat/remat/stats.h"

namespace pipemat::remat {

namespace {
thread_local bool tls_in_remat = false;
thread_local int64_t tls_overhead_ns = 0;
thread_local std::chrono::steady_clock::time_point tls_since;

void switch_clock(bool to_remat) {
  if (tls_in_remat == to_remat) return;
  const auto now = std::chrono::steady_clock::now();
  if (tls_in_remat) {
    tls_overhead_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - tls_since).count();
  }
  tls_since = now;
  tls_in_remat = to_remat;
}
}  // namespace

int64_t host_overhead_ns() { return tls_overhead_ns; }
void reset_host_overhead() { tls_overhead_ns = 0; }

namespace detail {
RematCode::RematCode() : previous_(tls_in_remat) { switch_clock(true); }
RematCode::~RematCode() { switch_clock(previous_); }
UserCode::UserCode() : previous_(tls_in_remat) { switch_clock(false); }
UserCode::~UserCode() { switch_clock(previous_); }
}  // namespace detail
}  // namespace pipemat::remat
