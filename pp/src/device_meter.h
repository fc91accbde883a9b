#pragma once
// What a profile (profile.cpp) reads on the device it measures on (private): the bytes of tensors
// and a clock. On the CPU, remat's tracking allocator and the host clock; on a CUDA device, the
// caching allocator's bytes of that device (pipemat/pp/device.h) and the host clock read after
// the device finished its queued kernels (a kernel launch returns before it ran).

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>

#include "pipemat/pp/device.h"
#include "pipemat/remat/memory.h"

namespace pipemat::pp {

class DeviceMeter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit DeviceMeter(c10::Device device) : device_(device) {}

  int64_t current_bytes() const {
    return device_.is_cuda() ? device_memory(device_).current_bytes
                             : remat::memory_stats().current_bytes;
  }
  // Starts a peak window at the current bytes and returns them (remat::begin_peak_window; on
  // CUDA the device's peak statistic, reset to its current bytes).
  int64_t begin_window() const {
    if (!device_.is_cuda()) return remat::begin_peak_window();
    reset_device_peak(device_);
    return current_bytes();
  }
  int64_t window_peak() const {
    return device_.is_cuda() ? device_memory(device_).peak_bytes : remat::window_peak_bytes();
  }

  Clock::time_point now() const {
    synchronize_device(device_);
    return Clock::now();
  }
  double ms_since(Clock::time_point t0) const {
    return std::chrono::duration<double, std::milli>(now() - t0).count();
  }

 private:
  c10::Device device_;
};

}  // namespace pipemat::pp
