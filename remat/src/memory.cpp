// The tracking CPU allocator of memory.h.
//
// Note [CPU allocator replacement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// install_tracking_allocator() replaces LibTorch's process-wide CPU allocator through
// c10::SetCPUAllocator (priority 100: an allocator set later with the default priority 0 does
// not override it), wrapping the default allocator it replaces. This file is the one place that
// does so, and it leans on how LibTorch uses the allocator: every CPU storage asks
// c10::GetCPUAllocator() when it allocates (so later allocations are seen, earlier ones are
// not); kernels that use raw_allocate() for scratch memory (exact GELU) need a DataPtr whose
// context is the data pointer and free it through raw_deleter() with only that pointer (hence
// the record in a header in front of the data); and a storage's DataPtr keeps the deleter it was
// made with, which is how allocation_sequence() tells our blocks from others. Another LibTorch
// may cache allocators or change the raw_allocate contract: this is checked for every LibTorch
// the configure step accepts (2.11 to 2.15, Note [Finding LibTorch] in cmake/PipematTorch.cmake).
//
// copy_data() (used by Allocator::clone) is a plain copy of the data here. LibTorch has
// copy-on-write storages (made by a lazy clone): the storage's DataPtr is moved into a shared
// context and every storage that shares the data gets a DataPtr with the copy-on-write deleter
// instead of ours. The byte counts stay exact: the block is counted once, and release() runs once,
// either through the shared context when the last sharing storage lets go, or through a storage
// that took the block back on a write (which gets our DataPtr again); a write to a storage that
// still shares the data copies it into a new block from this allocator, counted like any
// allocation. What is not exact: while the data is shared, allocation_sequence() returns -1 for
// every sharing storage, so a report counts it as an older tensor. pipemat makes no lazy clones
// itself. TrackingAllocator.CopyOnWriteStoragesKeepTheBytesExact (tests/remat/memory_test.cpp)
// checks each of these paths.

#include "pipemat/remat/memory.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <exception>
#include <limits>
#include <mutex>
#include <new>
#include <unordered_set>

namespace pipemat::remat {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_window{0};
std::atomic<int64_t> g_sequence{0};

void raise_to(std::atomic<int64_t>& peak, int64_t now) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}
std::atomic<bool> g_installed{false};

// Each block carries its record in a header in front of the data, so that the DataPtr's context
// is the data pointer itself (Note [CPU allocator replacement]). No lock, no lookup on the
// allocation path.
struct Record {
  c10::DataPtr inner;  // the block from the default allocator (header + data)
  int64_t bytes;
  int64_t sequence;
};
constexpr size_t kHeaderBytes = 64;  // keeps the data 64-byte aligned like the default allocator
static_assert(sizeof(Record) <= kHeaderBytes, "allocation header layout");

Record* record_of(void* data) {
  return reinterpret_cast<Record*>(static_cast<char*>(data) - kHeaderBytes);
}

void release(void* data) {
  Record* record = record_of(data);
  g_current.fetch_sub(record->bytes, std::memory_order_relaxed);
  c10::DataPtr inner = std::move(record->inner);
  record->~Record();
  // `inner` frees the block through the default allocator's deleter here.
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override { return allocate_block(n); }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);  // the data only: headers are never copied
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 private:
  c10::DataPtr allocate_block(size_t n) const {
    c10::DataPtr inner = base_->allocate(n + kHeaderBytes);
    char* block = static_cast<char*>(inner.get());
    const c10::Device device = inner.device();
    const auto bytes = static_cast<int64_t>(n);
    new (block) Record{std::move(inner), bytes, g_sequence.fetch_add(1, std::memory_order_relaxed)};
    const int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    raise_to(g_peak, now);
    raise_to(g_window, now);
    void* data = block + kHeaderBytes;
    return c10::DataPtr(data, data, &release, device);
  }

  c10::Allocator* base_;
};

std::atomic<TrackingAllocator*> g_allocator{nullptr};

}  // namespace

void install_tracking_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingAllocator allocator(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    g_allocator.store(&allocator);
    g_installed.store(true);
  });
}

void* allocate_tracked(size_t bytes) {
  TrackingAllocator* allocator = g_allocator.load();
  if (allocator == nullptr || bytes > std::numeric_limits<size_t>::max() - kHeaderBytes) {
    return nullptr;  // not installed, or the header would wrap the size around
  }
  try {
    return allocator->raw_allocate(bytes);  // the DataPtr's context is its data (the header)
  } catch (const std::exception&) {
    return nullptr;  // e.g. a size no allocation can have
  }
}

void release_tracked(void* data) {
  if (data != nullptr) release(data);
}

bool tracking_allocator_installed() { return g_installed.load(); }

MemoryStats memory_stats() {
  MemoryStats s;
  s.current_bytes = g_current.load(std::memory_order_relaxed);
  s.peak_bytes = g_peak.load(std::memory_order_relaxed);
  s.allocations = g_sequence.load(std::memory_order_relaxed);
  return s;
}

int64_t reset_peak_bytes() {
  return g_peak.exchange(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

int64_t begin_peak_window() {
  const int64_t now = g_current.load(std::memory_order_relaxed);
  g_window.store(now, std::memory_order_relaxed);
  return now;
}

int64_t window_peak_bytes() { return g_window.load(std::memory_order_relaxed); }

int64_t allocation_sequence(const c10::StorageImpl* storage) {
  if (storage == nullptr) return -1;
  const c10::DataPtr& ptr = storage->data_ptr();
  if (ptr.get_deleter() != &release) return -1;
  return record_of(ptr.get())->sequence;
}

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

}  // namespace pipemat::remat
