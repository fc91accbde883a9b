#pragma once
// `pipemat bench remat`: memory and time of the four remat modes on one scenario.
//
// Modes: none (no checkpoint), full (each layer a checkpoint unit, no SAVE region), legacy (the
// GEMM a SAVE region, saved-input rederivation switched off), rederive (the default). Each mode
// runs in a fresh model with the same weights and data; repetitions interleave the modes. Bytes
// come from the tracking CPU allocator and are exact.

#include <cstdint>
#include <ostream>
#include <string>

namespace pipemat::models {

struct BenchRematOptions {
  std::string scenario = "rmsnorm-gemm";  // rmsnorm-gemm | moe | save-chain | gpt
  int64_t layers = 4;
  int64_t tokens = 1024;
  int64_t hidden = 256;
  int64_t experts = 4;  // moe
  int64_t top_k = 2;    // moe
  int64_t steps = 3;
  int64_t repeat = 3;
  uint64_t seed = 0;
  bool json = false;
};

// Runs the benchmark and prints one JSON object (json) or a table. Throws ConfigError for bad
// options.
void run_bench_remat(const BenchRematOptions& options, std::ostream& out);

}  // namespace pipemat::models
