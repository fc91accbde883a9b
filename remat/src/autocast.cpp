// Note [Autocast in replay] (internal.h): the thread's autocast state, and the region a replay
// runs in.

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <string>

#include "internal.h"

namespace pipemat::remat::detail {
namespace {

// The thread's autocast nesting: LibTorch tells it only as the result of a change.
int autocast_nesting() {
  const int now = at::autocast::increment_nesting() - 1;
  at::autocast::decrement_nesting();
  return now;
}

std::string describe_one(bool enabled, at::ScalarType dtype) {
  return enabled ? std::string(c10::toString(dtype)) : std::string("off");
}

}  // namespace

AutocastState current_autocast() {
  AutocastState s;
  s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return s;
}

void set_autocast(const AutocastState& s) {
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda_enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
  at::autocast::set_autocast_cache_enabled(s.cache_enabled);
}

std::string describe_autocast(const AutocastState& s) {
  return "cpu " + describe_one(s.cpu_enabled, s.cpu_dtype) + ", cuda " +
         describe_one(s.cuda_enabled, s.cuda_dtype);
}

ReplayRegion::ReplayRegion(const AutocastState& recorded)
    : outside_(current_autocast()),
      nesting_outside_(autocast_nesting()),
      grad_outside_(c10::GradMode::is_enabled()) {
  set_autocast(recorded);
  at::autocast::increment_nesting();
}

ReplayRegion::~ReplayRegion() {
  // The body may have left regions of its own open (an early stop before its "off"), or
  // closed more than it opened: back to this region's level, then close it.
  int now = autocast_nesting();
  for (; now > nesting_outside_ + 1; --now) at::autocast::decrement_nesting();
  if (now == nesting_outside_ + 1) {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  } else {
    for (; now < nesting_outside_; ++now) at::autocast::increment_nesting();
  }
  set_autocast(outside_);
  c10::GradMode::set_enabled(grad_outside_);
}

}  // namespace pipemat::remat::detail
