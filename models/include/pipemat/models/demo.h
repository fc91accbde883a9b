#pragma once
// `pipemat demo`: trains the RMSNorm -> GEMM stack for a few steps with a checkpoint unit per
// layer and the GEMM as a SAVE region, next to the same model without checkpointing, and prints
// per-step loss and remat counters. Returns 0 when both runs agree bitwise, 1 otherwise.

#include <cstdint>
#include <ostream>

namespace pipemat::models {

struct DemoOptions {
  int64_t layers = 4;
  int64_t tokens = 64;
  int64_t hidden = 128;
  int64_t steps = 5;
  double lr = 0.05;
  uint64_t seed = 0;
};

int run_demo(const DemoOptions& options, std::ostream& out);

}  // namespace pipemat::models
