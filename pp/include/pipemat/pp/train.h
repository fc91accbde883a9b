#pragma once
// Training drivers: a pipeline run on this process's transport (mpirun / tcp), the same run
// with ranks as threads over the local transport (tests), and the single-process reference.
// Progress: one human-readable line per step and one JSON line per step (metrics file), both
// from the last stage's rank.

#include <ATen/core/Tensor.h>

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/pp/options.h"
#include "pipemat/pp/runtime.h"

namespace pipemat::pp {

struct TrainResult {
  std::vector<StepMetrics> steps;                          // the last stage's rank's view
  std::vector<std::pair<std::string, at::Tensor>> params;  // this rank's (in-process: all)
  bool last_stage_rank = false;
};

// Runs config.training.steps steps on `transport` (one rank of the pipeline).
TrainResult train_on(const TrainConfig& config, comm::Transport& transport, std::ostream* progress);

// Runs the whole pipeline in this process, one thread per rank over local transports.
// Rethrows the first rank's error (the other ranks fail fast when a peer is gone).
TrainResult train_in_process(const TrainConfig& config, std::ostream* progress);

// The oracle run with the same progress and metrics output.
TrainResult train_reference(const TrainConfig& config, std::ostream* progress);

// `pipemat train`: picks the transport (config.transport.kind; local runs in-process), runs,
// writes progress to `out` and metrics to config.output.metrics. Returns the exit code.
int run_train(const TrainConfig& config, bool reference, std::ostream& out);

// The JSON line of one step: {"step":..,"loss":..,"step_ms":..,"bubble":..,"peak_bytes":..,...}
std::string metrics_json(const StepMetrics& m);

}  // namespace pipemat::pp
