// Compute threads of a rank: LibTorch's intra-op threads and MKL's follow one setting.

#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/version.h>

#include <sys/resource.h>

#include <chrono>
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

// Note [Threads are measured, not assumed]: the probe alternates 1 thread and the asked count,
// one unmeasured round of each first, and keeps the asked count only when it is not slower.
TEST(ComputeThreads, TheProbeKeepsTheFasterOfOneAndTheAskedThreads) {
  // Work whose time depends on the threads it runs with: 2 ms on `fast` threads, 12 ms else.
  const auto probe = [](int fast, std::vector<int>* seen) {
    return [fast, seen] {
      const int n = at::get_num_threads();
      seen->push_back(n);
      std::this_thread::sleep_for(std::chrono::milliseconds(n == fast ? 2 : 12));
    };
  };
  std::vector<int> seen;
  const ThreadChoice slower = choose_compute_threads(2, probe(1, &seen), 3);
  EXPECT_EQ(seen, (std::vector<int>{1, 2, 1, 2, 1, 2, 1, 2}));
  EXPECT_TRUE(slower.probed);
  EXPECT_EQ(slower.asked, 2);
  EXPECT_EQ(slower.threads, 1);
  EXPECT_EQ(slower.rounds, 3);
  EXPECT_GE(slower.one_ms, 2.0);
  EXPECT_LT(slower.one_ms, slower.asked_ms);
  EXPECT_GE(slower.asked_ms, 12.0);
  EXPECT_EQ(at::get_num_threads(), 1);
  ComputeInfo info = compute_info();
  ASSERT_TRUE(info.choice.has_value());
  EXPECT_EQ(info.choice->threads, 1);
  EXPECT_EQ(info.choice->asked_ms, slower.asked_ms);

  seen.clear();
  const ThreadChoice faster = choose_compute_threads(2, probe(2, &seen), 1);
  EXPECT_EQ(seen, (std::vector<int>{1, 2, 1, 2}));
  EXPECT_EQ(faster.threads, 2);
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_LT(faster.asked_ms, faster.one_ms);

  // One thread asked: nothing to measure, the work never runs.
  seen.clear();
  const ThreadChoice one = choose_compute_threads(1, probe(1, &seen));
  EXPECT_TRUE(seen.empty());
  EXPECT_FALSE(one.probed);
  EXPECT_EQ(one.threads, 1);
  EXPECT_EQ(at::get_num_threads(), 1);

  // Setting threads unmeasured forgets the choice; bad counts are errors.
  EXPECT_FALSE(set_compute_threads(1).choice.has_value());
  EXPECT_THROW(choose_compute_threads(0, probe(1, &seen)), ConfigError);
  EXPECT_THROW(choose_compute_threads(2, probe(1, &seen), 0), ConfigError);
  EXPECT_TRUE(seen.empty());
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
