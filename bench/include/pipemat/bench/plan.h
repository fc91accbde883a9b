#pragma once
// `pipemat bench plan`: does a plan keep its promises? Profiles a config once (profile_plan),
// then for each memory budget solves it and runs the plan as a multi-process job (pipemat-run,
// tcp or mpi: each rank its own process, so each rank's peak is its own), and runs the uniform
// policies (none, full, selective) once on the same schedule. Per run it reports the predicted
// and the measured step (median after warm-up) and per rank the predicted and the measured peak
// (the tracking allocator's bytes at the step's start plus the step's peak above them, the
// maximum over every step), and whether every step's loss equals the single-process reference's
// bitwise; per budget, the fastest uniform policy whose measured peaks fit and the plan's
// speedup over it. The predictions' message cost and shared speed come from a short calibration
// run of the same job unless given (Note [Plan calibration] in train/plan.h).
//
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pipemat/train/plan.h"

namespace pipemat::bench {

struct BenchPlanOptions {
  std::string config;                  // YAML file
  std::vector<std::string> overrides;  // --set k=v
  std::vector<int64_t> budgets;        // bytes; each applies to every rank
  int64_t steps = 12;                  // per run, warm-up included
  int64_t warmup = 4;                  // steps left out of the step-time median
  std::string transport = "tcp";       // "tcp" or "mpi"
  std::string launcher;                // pipemat-run; empty: next to /proc/self/exe
  std::string log;                     // output of the runs; empty: a temp file
  train::PlanOptions plan;             // the profiler and step model (budget_bytes unused)
  // The predictions' message cost (ms) and shared speed; each measured by the calibration
  // run when below 0 (Note [Plan calibration]).
  double message_ms = -1;
  double shared_speed = -1;
  int64_t calibration_steps = 10;
  // Rounds of profile, calibration and runs: the plans are solved in the first round and every
  // round predicts and runs them again; a run's step is the median over rounds of its rounds'
  // medians, and so is its prediction (Note [Plan calibration]: the machine's speed drifts over
  // minutes, so a round pairs each prediction with runs taken right after its profile).
  int rounds = 1;
};

struct BenchPlanRun {
  std::string policy;  // "plan", "none", "full" or "selective"
  int64_t budget = 0;  // the plan's budget; 0 for the uniform policies
  int round = 0;       // the round (on_run); -1 for the medians over rounds of the report
  double predicted_step_ms = 0, step_ms = 0;
  std::vector<double> round_predicted_step_ms, round_step_ms;  // per round (the report's)
  // step_ms / predicted_step_ms - 1 of a round; the report's: the median of the rounds' (each
  // round pairs a prediction with runs taken right after its profile).
  double step_error = 0;
  std::vector<double> predicted_peak_bytes;  // per rank
  std::vector<int64_t> peak_bytes;           // per rank, measured (the report's: max over rounds)
  bool losses_equal = true;                  // every step bitwise equal to the reference
};

struct BenchPlanBudget {
  int64_t budget = 0;
  std::string infeasible;  // the planner's error when no plan fits (then nothing ran)
  BenchPlanRun plan;
  // The fastest uniform policy whose measured peaks all fit the budget ("" when none does), and
  // the plan's speedup over it (0 without one): the median over rounds of its step / the plan's;
  // the same from the predictions.
  std::string best_uniform;
  double speedup = 0;
  std::string predicted_best_uniform;
  double predicted_speedup = 0;
};

struct BenchPlanReport {
  std::string summary;  // the planner's summary
  // Per round: the message cost and shared speed the predictions use, the calibration
  // run's median step and its prediction at shared speed 1 (0: no calibration run).
  std::vector<double> message_ms, shared_speed;
  std::vector<double> calibration_step_ms, calibration_predicted_ms;
  std::vector<double> fixed_bytes;  // per rank: weights and optimizer state (Note [Plan inputs])
  std::vector<double> reference_losses;
  std::vector<BenchPlanRun> uniform;
  std::vector<BenchPlanBudget> budgets;
};

// Calls on_run as each run of each round is done (the uniform ones first). ConfigError for bad
// options; PipelineError naming the run and the log when one fails.
BenchPlanReport run_bench_plan(const BenchPlanOptions& options,
                               const std::function<void(const BenchPlanRun&)>& on_run);

// Step time against memory budget, as an SVG: the plan's measured and predicted step per budget,
// and each uniform policy's measured step from its measured peak on (where it starts to fit).
std::string render_bench_plan_svg(const BenchPlanReport& report);

}  // namespace pipemat::bench
