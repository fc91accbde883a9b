#pragma once
// A tracking CPU allocator: current and peak bytes of every CPU tensor allocated after it is
// installed, with a resettable peak. Used by reports, tests and benchmarks to measure memory
// exactly (bytes, not estimates).
//
// install_tracking_allocator() makes it LibTorch's CPU allocator for the rest of the process
// (idempotent, thread-safe). It forwards to the default CPU allocator and adds one small record
// per allocation; storages allocated before installation are not counted.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace c10 {
struct StorageImpl;
}
namespace at {
class Tensor;
}

namespace pipemat::remat {

void install_tracking_allocator();
bool tracking_allocator_installed();

struct MemoryStats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;  // allocations made so far (a sequence number)
};

MemoryStats memory_stats();
// Sets the peak to the current bytes and returns the previous peak.
int64_t reset_peak_bytes();

// A second, independent peak for measuring one phase (e.g. a replay) without disturbing the
// global peak: begin_peak_window() starts it at the current bytes and returns them.
int64_t begin_peak_window();
int64_t window_peak_bytes();

// Raw bytes from the tracking allocator, counted like tensor storages: for what a process holds
// outside tensors (pp routes the transport's receive buffers here, comm::BufferMemory). 64-byte
// aligned; nullptr when the allocator is not installed or the memory cannot be had. Release
// only what allocate_tracked returned.
void* allocate_tracked(size_t bytes);
void release_tracked(void* data);

// The sequence number of the allocation behind `storage`, or -1 when the tracking allocator did
// not allocate it. Lets a report tell activations born in a forward from older tensors (weights).
int64_t allocation_sequence(const c10::StorageImpl* storage);

// The bytes of the storages behind the defined `tensors`, each storage once and whole (what the
// allocator gave it), views and tensors sharing one storage counted once.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors);

}  // namespace pipemat::remat
