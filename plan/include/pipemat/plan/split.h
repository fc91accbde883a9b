#pragma once
// The stage split by cost: which contiguous runs of layers the pipeline's stages hold, chosen so
// that the simulated step is shortest (within a per-rank memory budget when one is set).
//
// Note [Cost split]
// ~~~~~~~~~~~~~~~~~
// Cost model. Each layer has one measured Candidate (times of one micro-batch: F, I, W, B, R;
// bytes as in Note [Plan memory]) and fixed bytes (its weights and optimizer state); on the
// stages a run leaves without a checkpoint (SplitProblem::stages_without_replay) a layer costs
// its second Candidate, that of no checkpoint, instead. A stage's
// costs are the sums over its layers, added in model order (StageSums, as Note [Plan step]
// does); a message between stages costs `message_cost`. The step of a split is
// schedule::simulate of build_schedule(schedule) with those per-stage CostModels; a rank's peak
// is the sum of its layers' fixed bytes plus the peak of Note [Plan memory] over the same
// schedule's action order (no StageBytes; replayed bytes count where the schedule has R actions,
// i.e. with pre-triggered recompute).
//
// Search. Branch and bound over the boundaries, stage 0 first, each stage taking 1, 2, ... layers
// (so splits are visited in lexicographic order of their layers per stage). It is exact because
// every cut uses a lower bound that never exceeds the step (or peak) of any completion:
//   - the step does not fall when a stage's F, I, W, R or B grows: every start time is a max of
//     sums over an order the schedule fixes (a longest path), so simulating with the stages still
//     open at zero cost bounds every completion from below;
//   - a rank's busy time (the sum of its actions' costs) bounds the step; with the open layers'
//     least work spread over the ranks of the open stages as evenly as it can go (water filling)
//     on top of the fixed stages' busy time, the largest rank's level is a lower bound too and
//     costs no simulation, so it is tried first (with ranks sharing cores, SplitProblem::
//     parallel_ranks, only this bound is used);
//   - a rank's peak does not fall when a stage's bytes or the rank's layers grow, so a prefix
//     whose peak with the open stages empty is over a budget is cut.
// The search is seeded with the split that minimises the largest stage's work (a dynamic
// programme), so the bound cuts from the first branch. Ties in the step go to the split whose
// layers-per-stage list is lexicographically smallest; equal steps are equal doubles, since each
// split's step is one deterministic simulation. When no split fits the budget a second branch
// and bound finds the split whose largest overshoot (peak - budget over the ranks) is smallest
// and the error names it. Before the branch and bound the seed is improved by moving single
// boundaries while that shortens the step (only a tighter start; exactness does not rest on it).
// Cost: one simulation per visited node (the bound) and per leaf; 32 near-equal layers with a
// heavier head on 8 ranks of 1F1B (16 micro-batches, C(31, 7) = 2.6M splits) take about 9,200
// simulations. Layers of very unequal cost flatten the bound and cost more (32 layers uniform in
// [0.5, 3] on the same pipeline: about 250,000, a tenth of the splits).
//
// Thread safety: pure functions over values.

#include <string>
#include <vector>

#include "pipemat/plan/plan.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::plan {

struct LayerCost {
  std::string layer;       // module path, e.g. "layers.3"
  Candidate cost;          // one micro-batch's times and bytes (the name is not used)
  double fixed_bytes = 0;  // weights + optimizer state, on the rank that holds the layer
  // The layer without a checkpoint, on the stages of SplitProblem::stages_without_replay (used
  // only there).
  Candidate without_replay;
};

struct SplitProblem {
  schedule::ScheduleOptions schedule;  // kind, ranks, micro-batches, virtual stages, recompute
  std::vector<LayerCost> layers;       // in model order
  std::vector<double> budget_bytes;    // per rank; empty: no memory limit
  double message_cost = 0.0;           // one stage-boundary message, in the time unit
  // Note [Shared cores] (schedule/simulate.h): how many ranks compute at once (0: every rank has
  // its own cores) and a rank's speed while others compute. With fewer than the ranks the search
  // drops its simulated bound (the step of ranks sharing cores need not grow with every cost)
  // and keeps the busy-time bound, so it stays exact, visiting more splits.
  int parallel_ranks = 0;
  double shared_speed = 1.0;
  // Layers per stage of a split to compare with (e.g. the parameter-balanced one); empty: none.
  std::vector<int> reference;
  // Model stages whose layers cost their LayerCost::without_replay wherever the split puts them
  // (a run that leaves those stages without a checkpoint, Note [Replays that cannot lower a
  // peak] in pipemat/schedule/schedule.h); ascending, each below the schedule's stage count.
  std::vector<int> stages_without_replay;
};

struct SplitResult {
  std::vector<int> layers_per_stage;  // the chosen split, one count per model stage
  double step = 0.0;                  // its simulated step
  std::vector<double> peak_bytes;     // its predicted peak per rank
  double reference_step = 0.0;        // the reference split's step (0 without one)
  long long simulations = 0;          // steps the search simulated (bounds included)
};

// The simulated step and per-rank peaks of one split (layers per stage). ConfigError for a
// malformed problem or split.
SplitResult evaluate_split(const SplitProblem& problem, const std::vector<int>& layers_per_stage);

// The contiguous split with the shortest simulated step among those that fit the budget
// (Note [Cost split]). ConfigError naming the field: fewer layers than stages, a cost or byte
// count that is negative or not finite, budgets not one per rank, a malformed reference, or no
// split that fits (with the smallest overshoot found).
SplitResult choose_split(const SplitProblem& problem);

}  // namespace pipemat::plan
