#pragma once
// The stage runtime: executes this rank's lowered action list of a schedule, step by step.
//
// Per action (Note [Executor contract] in pipemat/schedule/schedule.h):
//   F(s,i)   stage s forward of micro-batch i under remat InvocationScope {step, s, i}; input
//            from the data (s == 0), RECV_F, or the local hand-off; loss on the last stage.
//   SEND_F   sends the stage output; the runtime then drops the output tensor and keeps only
//            its autograd edge, so the activation is freed once the send is done.
//   R(s,i)   pre-triggers the replay of every checkpoint unit of (s,i) (InvocationGroup).
//   B(s,i)   fused backward: parameter gradients accumulate, the input gradient is sent.
//   I(s,i)   input gradient only (SplitBackward, Note [Split backward]); sent at once.
//   W(s,i)   parameter gradients from the state retained at I; then the invocation group is
//            released and every tensor of (s,i) is freed.
// Gradients accumulate over the micro-batches of a step; the optimizer steps once per step.
//
// Threading: one runtime per rank, driven by one thread. The transport may be shared with the
// transports of other ranks in the same process (local backend).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/pp/model.h"
#include "pipemat/pp/options.h"
#include "pipemat/remat/stats.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::pp {

// Start and end of one executed action, microseconds from the start of the step.
struct ActionTiming {
  schedule::Action action;
  double start_us = 0;
  double end_us = 0;
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;          // mean micro-batch loss (last stage's rank; 0 elsewhere)
  double step_ms = 0;       // wall time of the step on this rank (max over ranks on the last)
  double busy_ms = 0;       // time in compute actions on this rank
  double bubble = 0;        // 1 - sum(busy) / (ranks * makespan), on the last stage's rank
  int64_t peak_bytes = 0;   // tracking-allocator peak during the step (this process)
  remat::RematCounters remat;  // this rank's; on the last stage's rank summed over all ranks
  std::vector<ActionTiming> timeline;  // this rank's actions
  // On the last stage's rank: every rank's measured timeline (ms) as a simulation result, and
  // the simulator's prediction for the same schedule with the measured mean cost of each action
  // type (F, B, I, W, R; zero comm latency).
  schedule::SimulationResult measured;
  schedule::CostModel measured_costs;
  double simulated_bubble = 0;
};

class PipelineRuntime {
 public:
  // Builds the schedule, this rank's stages (with the remat policy) and the optimizer.
  // ConfigError when the configuration does not fit the transport's world size.
  PipelineRuntime(const TrainConfig& config, comm::Transport& transport);
  ~PipelineRuntime();
  PipelineRuntime(const PipelineRuntime&) = delete;
  PipelineRuntime& operator=(const PipelineRuntime&) = delete;

  // Runs the action list for step `step`, then the optimizer step. Collective: every rank of
  // the pipeline must call it for the same step.
  StepMetrics run_step(int64_t step);

  bool is_last_stage_rank() const;
  const schedule::Schedule& schedule() const;
  // Parameters of this rank's stages, by global name "layers.<global index>.<name>".
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The oracle: the same model, data and steps in one process, no pipeline and no remat.
// Returns one StepMetrics per step (loss and step time); `params` receives the final parameters.
std::vector<StepMetrics> run_reference(const TrainConfig& config,
                                       std::vector<std::pair<std::string, at::Tensor>>* params);

}  // namespace pipemat::pp
