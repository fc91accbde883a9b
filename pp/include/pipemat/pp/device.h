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

#include <ATen/core/Tensor.h>
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

// Note [Copies between host and device]
// What crosses between a rank on a GPU and its transport goes through page-locked (pinned) host
// memory, copied on a side stream of the device (one per device, from LibTorch's pool) and ordered
// with CUDA events:
//   copy_to_host   has the side stream wait (an event) for what the compute stream queued so far,
//                  copies into a pinned host tensor there and waits for that copy: the rank waits
//                  as long as a blocking .to(cpu) would, and the copy runs from pinned memory. A
//                  send posted by another thread once the copy's event fired, so that the rank
//                  could queue more work meanwhile, is not written;
//   copy_to_device copies a host tensor into pinned memory of its own (the caller's may change
//                  once this returns), starts its copy to the device on the side stream and has
//                  the compute stream wait for it with an event, without blocking the calling
//                  thread; the kernels queued before it overlap the copy. The result is
//                  contiguous.
// A tensor already where it goes is returned as it is; a copy (plain in a build without CUDA) is a
// leaf that requires grad when the tensor does, as a received activation is.
at::Tensor copy_to_host(const at::Tensor& tensor);
at::Tensor copy_to_device(const at::Tensor& tensor, c10::Device device);

// Makes a CUDA `device` the calling thread's current device for the scope's life, and the one
// before current again after; nothing for the CPU. (Out of line: LibTorch's inlined device
// guards trip GCC's -Wmaybe-uninitialized with some LibTorch versions.)
class DeviceScope {
 public:
  explicit DeviceScope(c10::Device device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;  // the CUDA device current before, or -1
};

// Waits until every kernel queued on `device` finished (before reading a clock); nothing for the
// CPU, whose work is done when the call that did it returns.
void synchronize_device(c10::Device device);

// Seeds the default generator of a CUDA `device` (random ops on its tensors draw from it); nothing
// for the CPU, whose draws come from the thread's generator (remat/rng.h).
void seed_device(c10::Device device, uint64_t seed);

}  // namespace pipemat::pp
