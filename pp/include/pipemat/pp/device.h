#pragma once
// Where a rank computes: the device its stage modules, micro-batch inputs, targets, received
// tensors and optimizer state live on.
//
// A device is named as in LibTorch: "cpu", "cuda" (the rank's own GPU: cuda:local_rank, where
// local_rank is the rank's index among the ranks of its host, modulo the GPUs it sees) or
// "cuda:N". CUDA needs a pipemat compiled with its CUDA paths (-DPIPEMAT_CUDA=ON, the default
// when the LibTorch found is a CUDA build and a CUDA toolkit is present) and a visible GPU.
//
// Threading: the functions are safe to call from any thread.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace pipemat::pp {

// True when this pipemat was compiled with its CUDA paths.
bool cuda_compiled();

// The CUDA devices this process sees: 0 when pipemat was compiled without CUDA or no GPU is
// visible.
int cuda_device_count();

// The device `spec` names for the rank with index `local_rank` on its host. ConfigError naming
// `key` (the option or YAML key the spec came from) for another spelling, a negative index, CUDA
// in a build without it, no visible GPU, or an index past the visible GPUs.
c10::Device resolve_device(const std::string& spec, int local_rank,
                           const std::string& key = "device");

// The bytes of tensors the CUDA caching allocator holds for `device`, now and at most since the
// last reset_device_peak (LibTorch's allocated_bytes, all pools). Zeros for the CPU, whose
// bytes remat's memory accounting counts (remat/memory.h).
struct DeviceMemory {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
};
DeviceMemory device_memory(c10::Device device);
void reset_device_peak(c10::Device device);

// Waits until every kernel queued on `device` finished (before reading a clock); nothing for the
// CPU, whose work is done when the call that did it returns.
void synchronize_device(c10::Device device);

// Seeds the default generator of a CUDA `device` (random ops on its tensors draw from it); nothing
// for the CPU, whose draws come from the thread's generator (remat/rng.h).
void seed_device(c10::Device device, uint64_t seed);

}  // namespace pipemat::pp
