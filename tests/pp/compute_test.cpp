// Compute threads of a rank: LibTorch's intra-op threads and MKL's follow one setting.

#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/version.h>

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/pp/compute.h"

namespace pipemat::pp {
namespace {

TEST(ComputeThreads, OneSettingForLibTorchAndTheBlas) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(default_compute_threads(1), hw < 1 ? 1 : hw);
  EXPECT_EQ(default_compute_threads(hw * 4), 1) << "at least one thread per rank";
  EXPECT_EQ(default_compute_threads(0), default_compute_threads(1));

  const ComputeInfo two = set_compute_threads(2);
  EXPECT_EQ(two.threads, 2);
  EXPECT_EQ(at::get_num_threads(), 2);
  // PyPI's x86-64 LibTorch computes with MKL, which reports its own thread count.
  EXPECT_EQ(two.blas.rfind("MKL 20", 0), 0u) << two.blas;
  EXPECT_EQ(two.blas_threads, 2);
  EXPECT_EQ(two.torch_version, TORCH_VERSION);
  const ComputeInfo one = set_compute_threads(1);
  EXPECT_EQ(one.threads, 1);
  EXPECT_EQ(one.blas_threads, 1);
  EXPECT_THROW(set_compute_threads(0), ConfigError);
}

// cmake/PipematTorch.cmake: PyPI's LibTorch libraries export copies of parts of the C++ standard
// library (2.11's std::filesystem::remove_all jumped to a null address); programs name libstdc++
// first, so their calls bind to the standard library they were compiled against.
TEST(Linking, StandardLibraryCallsBindToLibstdcxxNotLibTorchsCopies) {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const RemoveAll remove_all = &std::filesystem::remove_all;
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>(remove_all), &info), 0);
  ASSERT_NE(info.dli_fname, nullptr);
  EXPECT_NE(std::string(info.dli_fname).find("libstdc++.so"), std::string::npos) << info.dli_fname;
}

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Note [Freed memory stays in the process]: a step that allocates, touches and frees 8 MiB of
// 1 MiB activations faults them in once, not every step. Without it glibc trims the freed top
// of the heap each time (2,048 faults per step of 4 KiB pages).
TEST(FreedMemory, AStepsActivationsAreFaultedInOnce) {
  ASSERT_TRUE(retain_freed_memory());
  EXPECT_TRUE(compute_info().freed_memory_retained);
  constexpr size_t kBlock = 1 << 20;
  auto step = [] {
    std::vector<void*> blocks;
    for (int i = 0; i < 8; ++i) {
      blocks.push_back(std::malloc(kBlock));
      std::memset(blocks.back(), i + 1, kBlock);
    }
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) std::free(*it);
  };
  step();
  const long before = minor_faults();
  for (int i = 0; i < 20; ++i) step();
  EXPECT_LT(minor_faults() - before, 256) << "20 steps of 8 MiB faulted their pages in again";
}

}  // namespace
}  // namespace pipemat::pp
