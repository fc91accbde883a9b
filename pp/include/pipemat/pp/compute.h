#pragma once
// The compute threads of a rank and the BLAS that runs its GEMMs.
//
// LibTorch's CPU GEMMs run in the BLAS LibTorch was built with: PyPI's x86-64 wheel links Intel
// MKL statically and runs its parallel regions on OpenMP. Ranks that share a machine must share
// its cores: set_compute_threads sets LibTorch's intra-op threads, which sets OpenMP's and MKL's
// as well; compute_info reads back what MKL itself reports (LibTorch's parallel-info text), so
// a report shows the threads the GEMMs really get.
//
// Note [Freed memory stays in the process]: glibc hands blocks above its mmap threshold back to
// the kernel when they are freed and trims the heap's top above its trim threshold (both start
// at 128 KiB and adapt only upward, and only for the sizes seen so far). A training step frees
// and allocates the same activations every step, so every step faulted their pages in again:
// about 10,000 page faults per step of the main job's single-process reference, 2-5 us each on
// this machine, and with a 512 KiB buffer a freshly faulted allocation cost 5x the work done in
// it. retain_freed_memory sets the mmap threshold to 32 MiB and the trim threshold to 1 GiB
// (mallopt), so freed activations are reused in place; the process's resident size stays near
// the peak it reaches every step anyway. The `pipemat` command calls it when it starts; a
// library user calls it once before training.
//
// Threading: process-wide settings; call from one thread before training.

#include <cstdint>
#include <string>

namespace pipemat::pp {

struct ComputeInfo {
  std::string torch_version;  // the LibTorch pipemat was built against, e.g. "2.15.0"
  std::string blas;           // e.g. "MKL 2024.2", or LibTorch's BLAS_INFO ("open", ...)
  int threads = 1;            // LibTorch intra-op threads
  int blas_threads = -1;      // the BLAS's own thread count (MKL's); -1 where it reports none
  bool freed_memory_retained = false;  // retain_freed_memory() took effect
};

// Threads for `ranks_on_host` ranks on this machine: hardware threads / ranks_on_host, >= 1.
int default_compute_threads(int ranks_on_host);

// Sets LibTorch's intra-op threads (and with them OpenMP's and MKL's) to `threads` (>= 1;
// ConfigError otherwise) and returns what now runs.
ComputeInfo set_compute_threads(int threads);

// Note [Freed memory stays in the process]. Returns false where it cannot (not glibc).
bool retain_freed_memory();

// What runs now, without changing anything.
ComputeInfo compute_info();

// The most resident memory this process has held so far (getrusage's ru_maxrss), in bytes.
int64_t peak_resident_bytes();

}  // namespace pipemat::pp
