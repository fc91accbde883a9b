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

// Note [CPU allocator replacement]: copy-on-write storages (at::_lazy_clone) swap the storage's
// deleter for LibTorch's shared one; the tracked bytes stay exact through sharing, a write that
// copies, a write that takes the block back, and the release of either side first.
TEST(TrackingAllocator, CopyOnWriteStoragesKeepTheBytesExact) {
  install_tracking_allocator();
  constexpr int64_t kBytes = 256 * 4;
  const int64_t base = memory_stats().current_bytes;
  {
    at::Tensor a = at::ones({256});
    const int64_t sequence = allocation_sequence(a.storage().unsafeGetStorageImpl());
    EXPECT_GE(sequence, 0);
    at::Tensor b = at::_lazy_clone(a);
    EXPECT_EQ(memory_stats().current_bytes, base + kBytes) << "a lazy clone copies nothing";
    EXPECT_EQ(b.const_data_ptr<float>()[0], 1.0f);  // a read shares the block
    EXPECT_EQ(memory_stats().current_bytes, base + kBytes);
    b.add_(1);  // a write to a shared storage copies it into a new tracked block
    EXPECT_EQ(memory_stats().current_bytes, base + 2 * kBytes);
    EXPECT_GE(allocation_sequence(b.storage().unsafeGetStorageImpl()), 0);
    EXPECT_EQ(a.sum().item<float>(), 256.0f);
    EXPECT_EQ(b.sum().item<float>(), 512.0f);
    a.add_(1);  // the last sharer takes the block back: no copy
    EXPECT_EQ(memory_stats().current_bytes, base + 2 * kBytes);
    EXPECT_EQ(allocation_sequence(a.storage().unsafeGetStorageImpl()), sequence);
    a.reset();
    EXPECT_EQ(memory_stats().current_bytes, base + kBytes);
  }
  EXPECT_EQ(memory_stats().current_bytes, base);
  {
    // The original released first: the shared block lives on in the clone, freed once.
    at::Tensor a = at::ones({256});
    at::Tensor b = at::_lazy_clone(a);
    a.reset();
    EXPECT_EQ(memory_stats().current_bytes, base + kBytes);
    EXPECT_EQ(b.sum().item<float>(), 256.0f);
    b.reset();
    EXPECT_EQ(memory_stats().current_bytes, base);
  }
}

}  // namespace
}  // namespace pipemat::remat
