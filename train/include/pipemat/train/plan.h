#pragma once
// `pipemat plan`: a remat policy per layer and rank for a config under a memory budget. Profiles
// the config's layers (pp::profile_layer: every candidate from the layer's module tree) and each
// pipeline stage as a whole (pp::profile_stage: its input, embedding, head and loss), builds the
// planning problem of its schedule and partition (pipemat::plan) and solves it; predicts the
// uniform policies (none, full, selective) next to the plan; and returns the config that runs the
// plan (remat.stages with each stage's own lists, schedule.recompute pretrigger).
//
// Note [Plan inputs]
// ~~~~~~~~~~~~~~~~~~
// The problem's layers, per model stage in order: one "stage s" entry with a single candidate
// (what the stage holds besides its layers: its input from F until the backward, the embedding
// and head of the gpt, the loss; measured as the whole stage without remat minus its layers
// without remat, so the layers' outputs that the stage sends are not counted twice), then the
// stage's layers, all profiled from one layer of the kind (the zoo's and the gpt's layers are
// identical; the gpt's with the model's dropout, whose masks a layer saves without remat and
// replays with it). The entry's times make the stage's sums under `none` equal the whole stage's
// measured times (they are negative where the layers alone measured slower); its temporaries are
// the whole stage's. Fixed bytes of a rank: its stages' parameters x (1 + optimizer states: sgd
// with momentum 1, adamw 2) x 4 bytes. A stage's StageBytes (Note [Plan memory]): its gradients,
// its parameters x 4 bytes; the temporaries of its I and W and what I leaves for W, from the
// whole stage's split backward; what its first B holds beyond a later one's peak (the gradients
// made by then), its input and its outputs' gradients (the messages it receives). Times are
// milliseconds on this machine with the config's threads. Every candidate of a layer gets the
// forward, I, W and B times of `none` (a checkpointed layer runs the same math; what remat adds is
// the replay, R): timer noise between candidates would otherwise decide the plan. A rank's step
// tail is its optimizer step (and, with clipping, the norms of its gradients) timed on its own
// parameters; with clipping the tails wait for every rank and one message (the exchange of norms).
// Messages cost PlanOptions::message_ms; the ranks share PlanOptions::cores over the config's
// threads and run at PlanOptions::shared_speed while others compute (Note [Plan step]).

#include <cstdint>
#include <string>
#include <vector>

#include "pipemat/plan/plan.h"
#include "pipemat/pp/profile.h"
#include "pipemat/train/options.h"

namespace pipemat::train {

struct PlanOptions {
  // Memory budget of every rank, or one per rank (bytes).
  std::vector<int64_t> budget_bytes;
  int repeats = 5;          // profiler repeats (times: median)
  int warmup = 2;           // unmeasured profiler rounds before them
  int max_save_leaves = 4;  // SAVE leaves per layer tried (2^n - 1 selective candidates)
  // Non-empty: profile only these selective candidates (pp::ProfileOptions::save_sets).
  std::vector<std::vector<std::string>> save_sets = {};
  // What one stage-boundary message takes from its send to being usable on the peer, ms (the
  // `message_delay_ms` of a run's metrics; 0: free).
  double message_ms = 0.0;
  // Cores the ranks share (Note [Plan step]): -1 this machine's (the ranks run here, as
  // pipemat-run starts them); 0 every rank has its own (ranks on separate machines).
  int cores = -1;
  // A rank's speed while other ranks compute too, in (0, 1] (SimulateOptions::shared_speed;
  // `pipemat bench plan` measures it).
  double shared_speed = 1.0;
};

// Note [Plan calibration]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Two numbers of the step model (Note [Plan step]) are the machine's and the transport's, not the
// model's, and the profile (one process, alone) cannot see them: what a message takes from send
// to use, and a rank's speed while other ranks compute too (Note [Shared cores]: shared caches
// and memory bandwidth, the transport's threads, and with more ranks than cores the switching
// between them). The calibration run is CalibrationOptions::steps steps of the job with remat
// none, as its own job (pipemat-run) before anything is predicted: the message cost is the
// median of its steps' message_delay_ms (the first step left out); the shared speed is the s in
// [0.2, 1] at which the plan's prediction of that run (remat none everywhere, that message cost)
// equals its median step, found by bisection (the prediction falls as s grows), and 1 when the
// prediction at s = 1 is already no faster than the run. Both are printed; the plan and every
// uniform policy are then predicted with them, so `none` is predicted from its own kind of run and
// the others test the model. Without it (the profile alone: message cost 0, shared speed 1),
// `pipemat plan` predicted 278.6 ms for configs/plan-transformer.yaml at 28 MiB where the plan ran
// 400.6 ms
// (-30 %) on this machine's two cores.

struct CalibrationOptions {
  int64_t steps = 10;             // of the calibration run (>= 2; its first step is left out)
  std::string launcher;           // pipemat-run; empty: next to /proc/self/exe
  std::string transport = "mpi";  // "mpi" or "tcp": as pipemat-run will start the plan
  std::string log;                // the run's output is appended here; empty: a temporary file
  // Given (>= 0; the speed in (0, 1]): used as is, not measured. Both given: nothing runs.
  double message_ms = -1;
  double shared_speed = -1;
};

struct Calibration {
  double message_ms = 0;    // what the problem's predictions now use
  double shared_speed = 1;  // ...
  int64_t steps = 0;        // of the calibration run; 0 when nothing ran
  double step_ms = 0;       // its median step (its first step left out)
  double predicted_ms = 0;  // its prediction at shared speed 1 and the message cost above
};

struct UniformPrediction {
  std::string policy;  // "none", "full", "selective"
  plan::Prediction prediction;
};

struct PlanReport {
  std::string summary;         // model, schedule, what was profiled
  plan::PlanProblem problem;   // Note [Plan inputs]; layer names are global
  std::vector<bool> is_layer;  // per problem layer: false for the "stage s" entries
  // Per problem layer: the bytes it holds for the whole step, its parameters x (2 + optimizer
  // states) x 4 (weights, gradients, optimizer state; a stage entry: its stage's besides the
  // layers'). The cost split's budget counts them (Note [Split by cost]).
  std::vector<double> entry_fixed_bytes;
  std::vector<pp::LayerPolicy> policies;  // per candidate of a layer (same for every layer)
  int selective = -1;  // the candidate remat.policy selective runs (-1: the layer has none)
  plan::PlanResult result;
  std::vector<UniformPrediction> uniform;
  TrainConfig config;  // runs the plan as is
};

// profile_plan + solve_plan. ConfigError for a config the planner cannot take (schedule.csv,
// an imported schedule, budgets not one or one per rank) and, from plan::solve, for a budget no
// assignment fits (naming the smallest budget that does).
PlanReport run_plan(const TrainConfig& config, const PlanOptions& options);

// The profiling half: the problem, its layers' candidates and the planned config's schedule;
// budgets (options.budget_bytes) are ignored and result, uniform and the config's remat.stages
// left empty. One profile serves any number of budgets.
PlanReport profile_plan(const TrainConfig& config, const PlanOptions& options);

// One budget for every rank or one per rank, each > 0, as one per rank; ConfigError naming
// `who` otherwise.
std::vector<double> budgets_per_rank(const std::vector<int64_t>& budget_bytes, int ranks,
                                     const std::string& who);

// The solving half, on a profiled report: sets the budgets (one for every rank or one per rank),
// predicts the uniform policies, solves, and writes the plan into report.config.
void solve_plan(PlanReport& report, const std::vector<int64_t>& budget_bytes);

// The config that runs `policy` (none / full / selective) on every stage of a profiled report:
// its schedule (recompute pretrigger) and threads, so that it runs what the uniform predictions
// predict.
TrainConfig uniform_config(const PlanReport& report, models::RematPolicyKind policy);

// The uniform policies a profiled report predicts: none, full and, when a layer's candidates hold
// it, selective.
std::vector<models::RematPolicyKind> uniform_policies(const PlanReport& report);

// The assignment (candidate per problem layer) that runs `policy` on every layer.
std::vector<int> uniform_choice(const PlanReport& report, models::RematPolicyKind policy);

// Note [Plan calibration]: runs the calibration job of a profiled report when a number is to be
// measured and sets its problem's message cost and shared speed. ConfigError for bad options;
// PipelineError naming `who`, the run and its log when the run fails.
Calibration calibrate_plan(PlanReport& report, const CalibrationOptions& options,
                           const std::string& who);

// Note [Split by cost]
// ~~~~~~~~~~~~~~~~~~~~
// `partition.layers_per_stage: auto` and `pipemat plan`'s proposed split. The config is
// profiled as `pipemat plan` profiles it (profile_plan, Note [Plan inputs]) on the parameter-
// balanced split (layers_per_stage empty); each layer's cost is its candidate of the run's
// uniform remat policy (none, full or selective); the first model stage's own entry (the input,
// the embedding) is added to the first layer and the last stage's (the head and the loss) to the
// last layer, which a contiguous split always leaves on those stages; the middle stages' entries
// (their received input) are the same on every split and left out. plan::choose_split then
// finds the contiguous split with the shortest simulated step for the config's schedule kind,
// ranks, micro-batches, virtual stages and recompute (Note [Cost split]), the parameter split as
// its reference, with the profile's shared cores (PlanProblem::parallel_ranks and shared_speed:
// 4 ranks on 2 cores compute 2 at a time). The parameter split is kept unless the chosen one is
// predicted at least kMinGain faster: the profile's timer noise is of that order, and where the
// ranks share cores every split's step is close to the total work over the cores. What the
// prediction leaves out the step tails (optimizer step, clipping), the same for every split.
// The stages the run leaves without a checkpoint because their replays cannot lower a peak
// (stages_without_replay in pipemat/train/train.h, Note [Replays that cannot lower a peak]: the
// last stage of 1F1B and ZB-H1 with selective or full) follow from the schedule alone, so they
// are the same on every split; there each layer costs its `none` candidate
// (plan::SplitProblem::stages_without_replay), elsewhere the run's policy's.
// With `partition.memory_budget` (bytes per rank) the split is the fastest whose predicted peak
// fits on every rank, and the parameter split is kept only when it fits too. A rank's predicted
// peak is its layers' weights, gradients and optimizer state (held the whole step; the first
// and last stage's own, the embedding's and the head's, on their end layers) plus the
// activation peak of Note [Plan memory] over the schedule's action order. It leaves out the
// stage temporaries and received messages that `pipemat plan` adds (StageBytes): a budget with
// room to spare is the safe one. A budget no split fits is an error naming the split that
// comes closest.
// In a job, rank 0 profiles and chooses, and sends every rank the split (or its error), so all
// ranks build the same stages.
constexpr double kMinGain = 0.03;

struct CostSplit {
  std::vector<int64_t> layers_per_stage;  // the chosen split
  double step_ms = 0;                     // its predicted step
  std::vector<int64_t> parameter_split;   // the parameter-balanced split
  double parameter_step_ms = 0;           // its predicted step
  long long simulations = 0;              // by the search
  bool kept_parameter_split = false;      // no split was predicted kMinGain faster
  // partition.memory_budget per rank (empty: none), the predicted peak per rank of the chosen
  // split and of the parameter split, and whether the parameter split fits the budget.
  std::vector<double> budget_bytes;
  std::vector<double> peak_bytes;
  std::vector<double> parameter_peak_bytes;
  bool parameter_fits = true;
  std::string summary;  // what was profiled (PlanReport::summary)
};

// The split of a report profiled on the parameter split (profile_plan of a config whose
// layers_per_stage is empty) for a uniform remat `policy`, within `budget_bytes` (one for every
// rank or one per rank; empty: no budget). ConfigError for a report of another split, a policy
// the report has no candidate for, budgets not one or one per rank, or from plan::choose_split
// (a budget no split fits, naming the split that comes closest).
CostSplit cost_split_of(const PlanReport& profiled, models::RematPolicyKind policy,
                        schedule::RecomputeMode recompute,
                        const std::vector<int64_t>& budget_bytes = {});

// profile_plan on `config`'s parameter split, then cost_split_of its remat.policy. ConfigError
// for a config the split cannot take (remat.policy custom, remat.stages, schedule.csv).
CostSplit choose_cost_split(const TrainConfig& config, const PlanOptions& options);

// "split by cost: [3, 5], predicted step 210.5 ms; parameter split [4, 4]: 240.1 ms (1.14x)".
std::string describe_cost_split(const CostSplit& split);

// The remat.stages of an assignment (candidate per problem layer) of `report`.
std::vector<models::StageRemat> stages_of_plan(const PlanReport& report,
                                               const std::vector<int>& choice);

}  // namespace pipemat::train
