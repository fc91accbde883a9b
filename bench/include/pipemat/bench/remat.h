#pragma once
// `pipemat bench remat`: memory and time of the four remat modes on one scenario.
//
// Modes: none (no checkpoint), full (each layer a checkpoint unit, no SAVE region), legacy (the
// GEMM a SAVE region, saved-input rederivation switched off), rederive (the default). Each mode
// runs in a fresh model with the same weights and data; repetitions interleave the modes. Bytes
// come from the tracking CPU allocator and are exact.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pipemat::bench {

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
};

// One mode's numbers over steps x repetitions: the bytes are the largest, the times the
// medians, the loss, gradient norm and body calls those of the last step.
struct BenchRematMode {
  std::string mode;               // none | full | legacy | rederive
  int64_t resident_bytes = 0;     // held from the end of forward until backward
  int64_t replay_peak_bytes = 0;  // the invocation group's peak during replay
  int64_t peak_bytes = 0;         // peak of the whole step
  double step_ms = 0;             // forward and backward
  double host_overhead_us = 0;    // remat's own host time in the step
  double loss = 0;
  double grad_norm = 0;  // of the input and every parameter
  int64_t save_body_calls = 0;
  int64_t recompute_body_calls = 0;
};

struct BenchRematReport {
  std::vector<BenchRematMode> modes;  // none, full, legacy, rederive (in this order)
  // Host cost of one call of an empty SAVE region inside a checkpoint unit, minus the same
  // call without the wrapper (median of 5).
  double empty_save_region_call_us = 0;
};

// Runs the benchmark (blocking, on the calling thread; installs the tracking allocator) and
// returns its numbers; the command prints them as a table or JSON. on_mode_done, when set, is
// called after each mode of each repetition (repetition counted from 1). Throws ConfigError for
// bad options.
BenchRematReport run_bench_remat(
    const BenchRematOptions& options,
    const std::function<void(int64_t repetition, const std::string& mode)>& on_mode_done = {});

}  // namespace pipemat::bench
