#pragma once
// `pipemat demo`: trains the RMSNorm -> GEMM stack for a few steps with a checkpoint unit per
// layer and the GEMM as a SAVE region, next to the same model without checkpointing, and reports
// per-step loss and remat counters as each step ends (the command prints them).

#include <cstdint>
#include <functional>

#include "pipemat/remat/stats.h"

namespace pipemat::bench {

struct DemoOptions {
  int64_t layers = 4;
  int64_t tokens = 64;
  int64_t hidden = 128;
  int64_t steps = 5;
  double lr = 0.05;
  uint64_t seed = 0;
};

// One training step of both runs.
struct DemoStep {
  double loss = 0;                // with checkpoint units and SAVE regions
  double reference_loss = 0;      // the same model without checkpointing
  double ms = 0;                  // wall time of the checkpointed step
  remat::RematCounters counters;  // of the checkpointed step
};

// Called after each step (0-based), on the calling thread, before the next step starts.
using DemoStepFn = std::function<void(int64_t step, const DemoStep& result)>;

// The run's verdict. Keeps no step: each goes to the DemoStepFn as it ends, so memory stays flat
// however many steps run.
struct DemoReport {
  int64_t steps = 0;  // steps run (options.steps)
  // Every step's losses and, after the last step, every parameter of the two runs are equal
  // bitwise.
  bool all_equal = false;
};

// Runs both models for options.steps steps (blocking, on the calling thread), handing each step
// to `on_step` (may be empty) as it ends; an exception from on_step ends the run. ConfigError
// for a non-positive size or step count.
DemoReport run_demo(const DemoOptions& options, const DemoStepFn& on_step = nullptr);

}  // namespace pipemat::bench
