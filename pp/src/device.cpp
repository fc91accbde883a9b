// Devices of the ranks (pipemat/pp/device.h). The CUDA paths compile under PIPEMAT_CUDA only:
// their headers come with a CUDA build of LibTorch.

#include "pipemat/pp/device.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "pipemat/core/error.h"

#ifdef PIPEMAT_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#endif

namespace pipemat::pp {
namespace {

// The N of "cuda:N", or -1 for a malformed index.
int parse_index(const std::string& digits) {
  if (digits.empty() || digits.size() > 4) return -1;
  int n = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

#ifdef PIPEMAT_CUDA
// Note [Copies between host and device]: the side stream of a device, the same for the process's
// whole life (streams of LibTorch's pool are never destroyed).
c10::cuda::CUDAStream side_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static auto* streams = new std::map<c10::DeviceIndex, c10::cuda::CUDAStream>();  // never freed
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams->find(index);
  if (it == streams->end()) {
    it = streams->emplace(index, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index))
             .first;
  }
  return it->second;
}
#endif

// Note [Copies between host and device]: `copy`, a leaf that requires grad as `tensor` does.
at::Tensor leaf_like(at::Tensor copy, const at::Tensor& tensor) {
  if (tensor.requires_grad()) copy.requires_grad_(true);
  return copy;
}

}  // namespace

at::Tensor copy_to_host(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.device().is_cpu()) return tensor;
#ifdef PIPEMAT_CUDA
  if (tensor.is_cuda()) {
    const c10::cuda::CUDAGuard guard(tensor.device());
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(tensor.device().index());
    const c10::cuda::CUDAStream side = side_stream(tensor.device().index());
    at::cuda::CUDAEvent produced;
    produced.record(compute);
    produced.block(side);
    at::Tensor host =
        at::empty(tensor.sizes(), tensor.options().device(c10::kCPU).pinned_memory(true));
    {
      const at::NoGradGuard no_grad;  // a leaf (leaf_like)
      const c10::cuda::CUDAStreamGuard on_side(side);
      host.copy_(tensor, /*non_blocking=*/true);
    }
    at::cuda::CUDAEvent copied;
    copied.record(side);
    copied.synchronize();
    return leaf_like(host, tensor);
  }
#endif
  return leaf_like(tensor.detach().to(c10::kCPU), tensor);
}

at::Tensor copy_to_device(const at::Tensor& tensor, c10::Device device) {
  if (!tensor.defined() || tensor.device() == device) return tensor;
#ifdef PIPEMAT_CUDA
  if (device.is_cuda() && tensor.device().is_cpu()) {
    const c10::cuda::CUDAGuard guard(device);
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device.index());
    const c10::cuda::CUDAStream side = side_stream(device.index());
    // Always a pinned copy of its own (read after this returns: the caller's memory, pinned or
    // not, may change or go).
    at::Tensor pinned =
        at::empty(tensor.sizes(), tensor.options().device(c10::kCPU).pinned_memory(true));
    at::Tensor out;
    {
      const at::NoGradGuard no_grad;
      pinned.copy_(tensor);
      // Allocated and written on the side stream (a block the caching allocator gives that
      // stream is free of its earlier kernels), then used on the compute stream, which the
      // allocator is told of so that the block is not reused before compute is done with it.
      const c10::cuda::CUDAStreamGuard on_side(side);
      out = at::empty(tensor.sizes(), tensor.options().device(device));
      out.copy_(pinned, /*non_blocking=*/true);  // keeps the pinned block until the copy ran
    }
    out.record_stream(compute);
    at::cuda::CUDAEvent copied;
    copied.record(side);
    copied.block(compute);
    return leaf_like(out, tensor);
  }
#endif
  return leaf_like(tensor.detach().to(device), tensor);
}

DeviceScope::DeviceScope(c10::Device device) {
#ifdef PIPEMAT_CUDA
  if (device.is_cuda()) {
    previous_ = c10::cuda::current_device();
    c10::cuda::set_device(device.index());
  }
#else
  (void)device;
#endif
}

DeviceScope::~DeviceScope() {
#ifdef PIPEMAT_CUDA
  // Never throws (a destructor, maybe during an exception of the step): the error, if any, is
  // the CUDA runtime's and the next CUDA call reports it.
  if (previous_ >= 0) (void)c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(previous_));
#endif
}

bool cuda_compiled() {
#ifdef PIPEMAT_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
  if (!cuda_compiled()) return 0;
  return static_cast<int>(torch::cuda::device_count());
}

c10::Device resolve_device(const std::string& spec, int local_rank, const std::string& key) {
  if (spec == "cpu") return c10::Device(c10::kCPU);
  const bool cuda = spec == "cuda";
  const bool indexed = spec.rfind("cuda:", 0) == 0;
  PIPEMAT_CHECK(cuda || indexed, ConfigError, key, ": '", spec,
                "' is not a device; use cpu, cuda (the rank's own GPU) or cuda:N");
  const int index = cuda ? local_rank : parse_index(spec.substr(5));
  PIPEMAT_CHECK(index >= 0, ConfigError, key, ": '", spec,
                "' has no device index; use cuda:N with N >= 0, or cuda");
  PIPEMAT_CHECK(cuda_compiled(), ConfigError, key, ": '", spec,
                "' needs a pipemat built with CUDA (-DPIPEMAT_CUDA=ON, which needs a CUDA build "
                "of LibTorch and the CUDA toolkit); this one runs on cpu only");
  const int count = cuda_device_count();
  PIPEMAT_CHECK(count > 0, ConfigError, key, ": '", spec,
                "': no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES='",
                std::getenv("CUDA_VISIBLE_DEVICES") != nullptr ? std::getenv("CUDA_VISIBLE_DEVICES")
                                                               : "<unset>",
                "')");
  PIPEMAT_CHECK(cuda || index < count, ConfigError, key, ": '", spec, "': this process sees ",
                count, " CUDA device(s), cuda:0 to cuda:", count - 1);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda ? index % count : index));
}

DeviceMemory device_memory(c10::Device device) {
  DeviceMemory out;
#ifdef PIPEMAT_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto& bytes =
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    out.current_bytes = bytes.current;
    out.peak_bytes = bytes.peak;
  }
#else
  (void)device;
#endif
  return out;
}

void seed_device(c10::Device device, uint64_t seed) {
  if (!device.is_cuda()) return;
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_current_seed(seed);
}

void synchronize_device(c10::Device device) {
#ifdef PIPEMAT_CUDA
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
#else
  (void)device;
#endif
}

void reset_device_peak(c10::Device device) {
#ifdef PIPEMAT_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  (void)device;
#endif
}

}  // namespace pipemat::pp
