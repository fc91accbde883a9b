#pragma once
// The remat planner: one candidate policy per layer, chosen so that every pipeline rank's
// predicted peak fits its memory budget and the simulated step is shortest.
//
// This API (pipemat::plan, torch-free; it knows the schedule module only): profiles in, a plan
// out; evaluation of any assignment. The profiles come from measuring a model's layers (the
// profiler is a LibTorch client of remat); here they are plain numbers, so the planner is tested
// against exhaustive enumeration.
//
// Note [Plan memory]
// ~~~~~~~~~~~~~~~~~~
// A candidate policy of a layer has two byte counts, measured for one micro-batch:
//   resident: what its forward leaves alive for the backward (saved activations, SAVE region
//             outputs, checkpoint inputs), held from the end of F until B or W ends;
//   replayed: what its recompute rebuilds (0 without remat), held from R until B or W ends (the
//             split backward's W unpacks the same replay as its I, so I frees none of it).
// A stage's bytes are the sums over its layers (R replays the whole stage's micro-batch before
// its backward, so the rebuilt activations of all its layers coexist). While F, R or B runs it
// also holds temporaries (Candidate::*_temporary_bytes): for a stage, the largest of its layers'
// (one layer runs at a time; the bytes the earlier layers leave are in the sums). A stage has its
// own StageBytes: its gradients, the temporaries of I and W, what I leaves for W and the messages
// it receives. A rank's predicted peak is its fixed bytes (weights, optimizer state) plus the
// maximum, over its compute actions in schedule order, of the bytes alive while the action runs:
// a posted receive adds its message (it may land any time; the transport's buffers count like
// tensors), a send its message through the next compute action (then it has finished); F(s, i)
// takes its input into resident(s); R(s, i) adds replayed(s); B(s, i) frees both and its gradient
// message at its end; I(s, i) frees its message and adds input_held(s) at its end, and W(s, i)
// frees that, the replay and the resident bytes; the first B / W of stage s adds its gradients for
// the rest of the step (a first B, at its peak, only those it has made: first_backward_gradients),
// and each F / R / B / I / W its temporaries while it runs. So under 1F1B rank r holds p - r
// micro-batches' resident bytes and one replay; ZB-H2 and ZB-V hold more or other mixes, read off
// their own action lists.
//
// Note [Plan step]
// ~~~~~~~~~~~~~~~~
// The predicted step is the schedule simulated with each stage's summed F, I, W, B and R and a
// message cost, ranks that compute at the same time slowing each other down (`parallel_ranks`
// when fewer than all of them can compute at once, `shared_speed`: Note [Shared cores] of
// schedule/simulate.h), plus each rank's `step_tail` after its last action (the optimizer
// step): the latest rank's end. With `tails_wait_for_all` (gradient clipping exchanges every
// rank's norms first) the tails start once every rank has ended and one message has crossed.

#include <string>
#include <vector>

#include "pipemat/schedule/schedule.h"

namespace pipemat::plan {

// One measured way to run a layer: times of one micro-batch in any consistent unit (the
// planner's step is in that unit) and bytes as in Note [Plan memory].
struct Candidate {
  std::string name;  // e.g. "none", "full", "save:attn+mlp"
  double resident_bytes = 0.0;
  double replayed_bytes = 0.0;
  double forward = 0.0;
  double backward_input = 0.0;   // I (dx)
  double backward_weight = 0.0;  // W (dw)
  double recompute = 0.0;        // R: the replay before the backward
  double backward = 0.0;         // B, the fused backward; 0: I + W
  // What F, R and B allocate at their peak beyond what stays (resident or replayed bytes; B's
  // above its start, into existing parameter gradients) while they run: intermediate results,
  // gradients of activations (Note [Plan memory]).
  double forward_temporary_bytes = 0.0;
  double recompute_temporary_bytes = 0.0;
  double backward_temporary_bytes = 0.0;
};

struct LayerProfile {
  std::string layer;  // module path, e.g. "layers.3"
  std::vector<Candidate> candidates;
};

// Bytes of a model stage that do not depend on its layers' candidates (Note [Plan memory]): all
// measured for one micro-batch; a pass's temporaries are its peak above the bytes alive when it
// starts, accumulating into existing parameter gradients.
struct StageBytes {
  double gradients = 0.0;        // the parameters' gradients, alive from the first B / W on
  double backward_input = 0.0;   // I's temporaries
  double input_held = 0.0;       // what I leaves alive until W (the gradients W starts from)
  double backward_weight = 0.0;  // W's temporaries
  // Received messages (0 where no receive is posted): the stage's inputs, alive from their
  // receive's posting until F (then part of its resident bytes), and its output gradients, from
  // their receive's posting until B / I ends.
  double received_input = 0.0;
  double received_gradient = 0.0;
  // What the stage's first B (no gradients yet) holds at its peak beyond a later B's peak: the
  // gradients it has made by then (at most `gradients`); negative: all of them.
  double first_backward_gradients = -1.0;
};

struct PlanProblem {
  schedule::ScheduleOptions schedule;   // kind, ranks, micro-batches, v (recompute is the plan's)
  std::vector<LayerProfile> layers;     // in model order
  std::vector<int> stage_of_layer;      // model stage of each layer (non-decreasing)
  std::vector<double> fixed_bytes;      // per rank: weights + optimizer state
  std::vector<StageBytes> stage_bytes;  // per model stage (empty: none counted)
  std::vector<double> budget_bytes;     // per rank
  double message_cost = 0.0;            // one stage-boundary message, in the time unit
  // Note [Plan step]: per rank, the time after its last action (empty: none); how many ranks
  // can compute at once (SimulateOptions::parallel_ranks; 0: every rank) and a rank's speed
  // while others compute too (SimulateOptions::shared_speed).
  std::vector<double> step_tail;
  bool tails_wait_for_all = false;  // the tails start after every rank's end and one message
  int parallel_ranks = 0;
  double shared_speed = 1.0;  // SimulateOptions::shared_speed
};

struct RankPrediction {
  int rank = 0;
  double peak_bytes = 0.0;
  double budget_bytes = 0.0;
  bool fits() const { return peak_bytes <= budget_bytes; }
};

struct Prediction {
  std::vector<int> choice;  // candidate index per layer
  std::vector<RankPrediction> ranks;
  double step = 0.0;  // simulated makespan of one step
  bool fits() const;
};

struct PlanResult {
  Prediction best;
  long long simulations = 0;  // steps the search simulated
};

// The prediction of one assignment (candidate index per layer). ConfigError for a problem whose
// shape is inconsistent (layers / stages / ranks / budgets) or an index out of range.
Prediction evaluate(const PlanProblem& problem, const std::vector<int>& choice);

// The assignment with the shortest simulated step among those that fit every rank's budget;
// ties go to the smaller sum of peaks. ConfigError when no assignment fits, naming each rank
// that cannot fit with the smallest peak any assignment reaches on it.
PlanResult solve(const PlanProblem& problem);

// The schedule a plan runs: the problem's with pre-triggered recompute.
schedule::Schedule plan_schedule(const PlanProblem& problem);

}  // namespace pipemat::plan
