#pragma once
// The compute threads of a rank and the BLAS that runs its GEMMs.
//
// LibTorch's CPU GEMMs go to whatever libblas.so.3 the system selects. Debian's default is the
// reference BLAS (about 6 GFLOP/s for a 1024x256 @ 256x256 float GEMM here); OpenBLAS
// (libopenblas0-pthread, installed by scripts/install-deps.sh) runs the same GEMM at 70-90
// GFLOP/s on one thread. Ranks that share a machine must share its cores: set_compute_threads
// sets LibTorch's intra-op threads and, when the BLAS is OpenBLAS, its threads too.
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

#include <string>

namespace pipemat::pp {

struct ComputeInfo {
  std::string blas;             // "OpenBLAS 0.3.21 ...", or the path of the libblas.so.3 in use
  bool reference_blas = false;  // the slow reference implementation
  int threads = 1;              // LibTorch intra-op threads (and OpenBLAS threads)
  bool freed_memory_retained = false;  // retain_freed_memory() took effect
};

// Threads for `ranks_on_host` ranks on this machine: hardware threads / ranks_on_host, >= 1.
int default_compute_threads(int ranks_on_host);

// Sets LibTorch's intra-op threads and the BLAS's threads (OpenBLAS) to `threads` (>= 1;
// ConfigError otherwise) and returns what now runs.
ComputeInfo set_compute_threads(int threads);

// Note [Freed memory stays in the process]. Returns false where it cannot (not glibc).
bool retain_freed_memory();

// What runs now, without changing anything.
ComputeInfo compute_info();

}  // namespace pipemat::pp
