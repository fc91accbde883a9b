// The device of a rank (pipemat/pp/device.h): names, errors, the CUDA allocator's bytes, and a
// profile on a GPU.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"
#include "pipemat/pp/device.h"
#include "pipemat/pp/profile.h"

namespace pipemat::pp {
namespace {

std::string error_of(const std::string& spec, int local_rank = 0) {
  try {
    resolve_device(spec, local_rank, "training.device");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Device, CpuIsTheCpu) {
  EXPECT_EQ(resolve_device("cpu", 3), c10::Device(c10::kCPU));
  const at::Tensor t = at::ones({3});
  EXPECT_TRUE(copy_to_host(t).is_same(t));
  EXPECT_TRUE(copy_to_device(t, c10::Device(c10::kCPU)).is_same(t));
  EXPECT_EQ(device_memory(c10::Device(c10::kCPU)).current_bytes, 0);
  EXPECT_EQ(device_memory(c10::Device(c10::kCPU)).peak_bytes, 0);
}

TEST(Device, OtherSpellingsAreRefusedNamingTheKey) {
  EXPECT_EQ(error_of("gpu"),
            "training.device: 'gpu' is not a device; use cpu, cuda (the rank's own GPU) or cuda:N");
  EXPECT_EQ(error_of("CUDA"),
            "training.device: 'CUDA' is not a device; use cpu, cuda (the rank's own GPU) or "
            "cuda:N");
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:12345"}) {
    EXPECT_EQ(error_of(bad), std::string("training.device: '") + bad +
                                 "' has no device index; use cuda:N with N >= 0, or cuda");
  }
}

TEST(Device, CudaWithoutAGpuSaysWhy) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible: CUDA resolves";
  const std::string cuda = error_of("cuda");
  const std::string indexed = error_of("cuda:1");
  if (!cuda_compiled()) {
    EXPECT_EQ(cuda,
              "training.device: 'cuda' needs a pipemat built with CUDA (-DPIPEMAT_CUDA=ON, "
              "which needs a CUDA build of LibTorch and the CUDA toolkit); this one runs on "
              "cpu only");
  } else {
    EXPECT_EQ(cuda.rfind("training.device: 'cuda': no CUDA device is visible to this process "
                         "(CUDA_VISIBLE_DEVICES='",
                         0),
              0u)
        << cuda;
    EXPECT_EQ(indexed.rfind("training.device: 'cuda:1': no CUDA device is visible", 0), 0u)
        << indexed;
  }
}

TEST(Device, CudaIsTheRanksOwnGpu) {
  const int count = cuda_device_count();
  if (count == 0) GTEST_SKIP() << "needs a visible CUDA device";
  EXPECT_EQ(resolve_device("cuda", 0), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(resolve_device("cuda", count), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(resolve_device("cuda:0", 5), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(error_of("cuda:" + std::to_string(count)),
            "training.device: 'cuda:" + std::to_string(count) + "': this process sees " +
                std::to_string(count) +
                " CUDA device(s), cuda:0 to cuda:" + std::to_string(count - 1));
}

TEST(Device, CudaAllocatorBytesAreCounted) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a visible CUDA device";
  const c10::Device gpu(c10::kCUDA, 0);
  reset_device_peak(gpu);
  const DeviceMemory before = device_memory(gpu);
  {
    at::Tensor t = at::zeros({1 << 20}, at::TensorOptions().dtype(at::kFloat).device(gpu));
    EXPECT_EQ(device_memory(gpu).current_bytes - before.current_bytes, 4 << 20);
  }
  const DeviceMemory after = device_memory(gpu);
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.peak_bytes - before.current_bytes, 4 << 20);
}

// Note [Copies between host and device]: the values survive both ways, a strided source
// included; the host copy is pinned, the device copy is usable on the compute stream at once
// (a kernel queued right after it reads the copied values).
TEST(Device, CopiesThroughPinnedMemoryKeepTheValues) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a visible CUDA device";
  const c10::Device gpu(c10::kCUDA, 0);
  const at::Tensor host = at::randn({256, 64}).t();  // not contiguous
  const at::Tensor on_gpu = copy_to_device(host, gpu);
  EXPECT_EQ(on_gpu.device(), gpu);
  const at::Tensor doubled = on_gpu * 2;  // queued on the compute stream after the copy
  const at::Tensor back = copy_to_host(doubled);
  EXPECT_TRUE(back.device().is_cpu());
  EXPECT_TRUE(back.is_pinned());
  EXPECT_TRUE(at::equal(back, host * 2));
  // A long chain of kernels before the copy to the host: it waits for them.
  at::Tensor x = at::ones({1024, 1024}, at::TensorOptions().device(gpu));
  for (int i = 0; i < 20; ++i) x = x + 1;
  EXPECT_EQ(copy_to_host(x)[1023][1023].item<float>(), 21.0f);
  // CPU tensors pass through.
  EXPECT_TRUE(copy_to_host(host).is_same(host));
  EXPECT_TRUE(copy_to_device(host, c10::Device(c10::kCPU)).is_same(host));
}

// pipemat plan on a GPU (docs/gpu.md): a layer profiled on a CUDA input is measured in the
// device's bytes. Checkpointing the whole layer keeps its output alone (64 x 64 floats, a multiple
// of the caching allocator's 512-byte blocks); no remat keeps more, and the replay rebuilds some.
TEST(Device, ProfileOnCudaCountsTheDeviceBytes) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a visible CUDA device";
  const c10::Device gpu(c10::kCUDA, 0);
  const auto block = [] { return torch::nn::AnyModule(models::MlpBlock(64, 128)); };
  const LayerCandidates c =
      profile_layer("layers.*", block, at::randn({64, 64}, at::TensorOptions().device(gpu)));
  const auto& k = c.profile.candidates;
  ASSERT_GE(k.size(), 2u);
  EXPECT_EQ(k[1].name, "full");
  EXPECT_EQ(k[1].resident_bytes, 64 * 64 * 4);
  EXPECT_GT(k[1].replayed_bytes, 0);
  EXPECT_GT(k[0].resident_bytes, k[1].resident_bytes);
  EXPECT_GT(k[0].forward, 0);
}

}  // namespace
}  // namespace pipemat::pp
