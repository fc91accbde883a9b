#pragma once
// The remat planner: one candidate policy per layer, chosen so that every pipeline rank's
// predicted peak fits its memory budget and the simulated step is shortest.
//
// What lives where (pipemat::plan, torch-free; it knows the schedule module only):
//   plan.h          this API: profiles in, a plan out; evaluation of any assignment.
//   src/peak.cpp    the per-rank memory model over a schedule's action order (Note [Plan memory]).
//   src/solve.cpp   the exact search (Note [Plan search]) and the plan's stage costs.
// The profiles come from measuring a model's layers (the profiler is a LibTorch client of remat);
// here they are plain numbers, so the planner is tested against exhaustive enumeration.
//
// Note [Plan memory]
// ~~~~~~~~~~~~~~~~~~
// A candidate policy of a layer has two byte counts, measured for one micro-batch:
//   resident: what its forward leaves alive for the backward (saved activations, SAVE region
//             outputs, checkpoint inputs), held from the end of F until the last of B / W;
//   replayed: what its recompute rebuilds (0 without remat), held from R until B / I ends.
// A stage's bytes are the sums over its layers (R replays the whole stage's micro-batch before
// its backward, so the rebuilt activations of all its layers coexist). A rank's predicted peak
// is its fixed bytes (weights, optimizer state) plus the maximum, over its compute actions in
// schedule order, of the bytes alive right after the action starts: F(s, i) adds resident(s);
// R(s, i) adds replayed(s); B(s, i) frees both at its end; I frees replayed(s) and W frees
// resident(s); the first B / W of stage s adds its gradient bytes for the rest of the step, and
// each B / I / W its stage's backward temporaries while it runs. So
// under 1F1B rank r holds p - r micro-batches' resident bytes and one replay; ZB-H2 and ZB-V hold
// more or other mixes, read off their own action lists.

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
  double backward_input = 0.0;   // I (dx); a fused B takes I + W
  double backward_weight = 0.0;  // W (dw)
  double recompute = 0.0;        // R: the replay before the backward
};

struct LayerProfile {
  std::string layer;  // module path, e.g. "layers.3"
  std::vector<Candidate> candidates;
};

struct PlanProblem {
  schedule::ScheduleOptions schedule;  // kind, ranks, micro-batches, v (recompute is the plan's)
  std::vector<LayerProfile> layers;    // in model order
  std::vector<int> stage_of_layer;     // model stage of each layer (non-decreasing)
  std::vector<double> fixed_bytes;     // per rank: weights + optimizer state
  // Per model stage: its parameters' gradients, alive from the stage's first B / W of the step
  // on (empty: none counted).
  std::vector<double> gradient_bytes;
  // Per model stage: what one backward (B, I or W) allocates at its peak above the bytes alive
  // when it starts, beyond the stage's gradients (its temporaries); empty: none counted.
  std::vector<double> backward_bytes;
  std::vector<double> budget_bytes;  // per rank
  double message_cost = 0.0;         // one stage-boundary message, in the time unit
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
  long long simulations = 0;  // steps the search simulated (Note [Plan search])
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
