// The tracking CPU allocator: exact bytes, and kernels that take scratch memory through
// c10::Allocator::raw_allocate (exact GELU does) work under it.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include "pipemat/remat/memory.h"

namespace pipemat::remat {
namespace {

TEST(TrackingAllocator, TrackedRawBytesCountLikeTensors) {
  install_tracking_allocator();
  const int64_t before = memory_stats().current_bytes;
  reset_peak_bytes();
  void* p = allocate_tracked(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(memory_stats().current_bytes, before + 1000);
  release_tracked(p);
  EXPECT_EQ(memory_stats().current_bytes, before);
  EXPECT_EQ(memory_stats().peak_bytes, before + 1000);
  release_tracked(nullptr);  // nothing
  // A size no allocation can have (a hostile peer's) is nullptr, not an exception.
  for (size_t huge :
       {std::numeric_limits<size_t>::max(), std::numeric_limits<size_t>::max() - 64}) {
    EXPECT_EQ(allocate_tracked(huge), nullptr) << huge;
  }
  EXPECT_EQ(memory_stats().current_bytes, before);
}

TEST(TrackingAllocator, ExactGeluAndRawAllocationsWork) {
  install_tracking_allocator();
  ASSERT_TRUE(tracking_allocator_installed());
  at::Tensor x = at::linspace(-3, 3, 4096);
  at::Tensor y = at::gelu(x);  // default (exact) approximation: raw_allocate inside
  EXPECT_NEAR(y[4095].item<double>(), 3 * 0.5 * (1 + std::erf(3 / std::sqrt(2.0))), 1e-5);

  c10::Allocator* allocator = c10::GetCPUAllocator();
  const int64_t before = memory_stats().current_bytes;
  void* raw = allocator->raw_allocate(1000);
  ASSERT_NE(raw, nullptr);
  EXPECT_EQ(memory_stats().current_bytes, before + 1000);
  allocator->raw_deallocate(raw);
  EXPECT_EQ(memory_stats().current_bytes, before);

  const int64_t base = memory_stats().current_bytes;
  {
    at::Tensor t = at::empty({256}, at::kFloat);
    EXPECT_EQ(memory_stats().current_bytes, base + 1024);
    EXPECT_GE(allocation_sequence(t.storage().unsafeGetStorageImpl()), 0);
  }
  EXPECT_EQ(memory_stats().current_bytes, base);
}

}  // namespace
}  // namespace pipemat::remat
