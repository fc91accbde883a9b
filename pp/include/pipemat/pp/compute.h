#pragma once
// The compute threads of a rank and the BLAS that runs its GEMMs.
//
// LibTorch's CPU GEMMs run in the BLAS LibTorch was built with: PyPI's x86-64 wheel links Intel
// MKL statically and runs its parallel regions on OpenMP. Ranks that share a machine must share
// its cores: set_compute_threads sets LibTorch's intra-op threads, which sets OpenMP's and MKL's
// as well; compute_info reads back what MKL itself reports (LibTorch's parallel-info text), so
// a report shows the threads the GEMMs really get.
//
// Note [Freed memory stays in the process]
// Glibc hands blocks above its mmap threshold back to the kernel when they are freed and trims the
// heap's top above its trim threshold (both start at 128 KiB and adapt only upward, and only for
// the sizes seen so far). A training step frees and allocates the same activations every step, so
// every step faulted their pages in again: about 10,000 page faults per step of the main job's
// single-process reference, 2-5 us each on this machine, and with a 512 KiB buffer a freshly
// faulted allocation cost 5x the work done in it. retain_freed_memory sets the mmap threshold to
// 32 MiB and the trim threshold to 1 GiB (mallopt), so freed activations are reused in place; the
// process's resident size stays near the peak it reaches every step anyway. The `pipemat` command
// calls it when it starts; a library user calls it once before training.
//
// Threading: process-wide settings; call from one thread before training.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace pipemat::pp {

// Note [Threads are measured, not assumed]
// More threads are not always faster. With LibTorch's OpenMP (GNU libgomp) two threads that spin
// while they wait made the main job's single process 1.5-2.0x faster than one thread on a quiet
// machine of two cores and 1.3-5.2x slower when one core was busy with another process; threads
// that sleep while they wait (OMP_WAIT_POLICY=PASSIVE) did the reverse. The policy is read once,
// when the library loads, so a running process can only choose its thread count.
// choose_compute_threads runs the caller's work (one micro-batch's forward and backward, say)
// alternately with 1 thread and with `threads`, after one unmeasured round of each, and keeps
// `threads` only when its median is not slower: the count it returns never ran slower than 1 thread
// when it was measured.
struct ThreadChoice {
  int asked = 1;            // what the caller asked for
  int threads = 1;          // what now runs
  bool probed = false;      // false when asked was 1: nothing to choose
  double one_ms = 0;        // the probe's median with 1 thread
  double asked_ms = 0;      // ... and with `asked` threads
  int rounds = 0;           // measured rounds of each
  std::string wait_policy;  // OMP_WAIT_POLICY as this process started ("" when unset)
};

struct ComputeInfo {
  std::string torch_version;  // the LibTorch pipemat was built against, e.g. "2.15.0"
  std::string blas;           // e.g. "MKL 2024.2", or LibTorch's BLAS_INFO ("open", ...)
  int threads = 1;            // LibTorch intra-op threads
  int blas_threads = -1;      // the BLAS's own thread count (MKL's); -1 where it reports none
  bool freed_memory_retained = false;  // retain_freed_memory() took effect
  // How `threads` was chosen when choose_compute_threads set it last (set_compute_threads since
  // clears it).
  std::optional<ThreadChoice> choice;
};

// Threads for `ranks_on_host` ranks on this machine: hardware threads / ranks_on_host, >= 1.
int default_compute_threads(int ranks_on_host);

// Sets LibTorch's intra-op threads (and with them OpenMP's and MKL's) to `threads` (>= 1;
// ConfigError otherwise), unmeasured, and returns what now runs.
ComputeInfo set_compute_threads(int threads);

// Note [Threads are measured, not assumed]. `threads` >= 1 (ConfigError otherwise); `rounds`
// >= 1. Runs `work` 2 x (rounds + 1) times when threads > 1, never when threads == 1 (1 thread
// is then set, unmeasured). compute_info() reports the choice until threads are set again.
ThreadChoice choose_compute_threads(int threads, const std::function<void()>& work, int rounds = 3);

// Note [Freed memory stays in the process]. Returns false where it cannot (not glibc).
bool retain_freed_memory();

// What runs now, without changing anything.
ComputeInfo compute_info();

// The most resident memory this process has held so far (getrusage's ru_maxrss), in bytes.
int64_t peak_resident_bytes();

}  // namespace pipemat::pp
