#pragma once
// The compute threads of a rank and the BLAS that runs its GEMMs.
//
// LibTorch's CPU GEMMs go to whatever libblas.so.3 the system selects. Debian's default is the
// reference BLAS (about 6 GFLOP/s for a 1024x256 @ 256x256 float GEMM here); OpenBLAS
// (libopenblas0-pthread, installed by scripts/install-deps.sh) runs the same GEMM at 70-90
// GFLOP/s on one thread. Ranks that share a machine must share its cores: set_compute_threads
// sets LibTorch's intra-op threads and, when the BLAS is OpenBLAS, its threads too.
//
// Threading: process-wide settings; call from one thread before training.

#include <string>

namespace pipemat::pp {

struct ComputeInfo {
  std::string blas;            // "OpenBLAS 0.3.21 ...", or the path of the libblas.so.3 in use
  bool reference_blas = false; // the slow reference implementation
  int threads = 1;             // LibTorch intra-op threads (and OpenBLAS threads)
};

// Threads for `ranks_on_host` ranks on this machine: hardware threads / ranks_on_host, >= 1.
int default_compute_threads(int ranks_on_host);

// Sets LibTorch's intra-op threads and the BLAS's threads (OpenBLAS) to `threads` (>= 1;
// ConfigError otherwise) and returns what now runs.
ComputeInfo set_compute_threads(int threads);

// What runs now, without changing anything.
ComputeInfo compute_info();

}  // namespace pipemat::pp
