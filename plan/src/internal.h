#pragma once
// Private types of the planner shared by peak.cpp (the per-rank memory model over a schedule's
// action order, Note [Plan memory]) and solve.cpp (the exact search, Note [Plan search], and the
// plan's stage costs).

#include <vector>

#include "pipemat/plan/plan.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::plan::detail {

// What a stage's layers add up to under one assignment (Note [Plan memory]).
struct StageSums {
  double resident = 0.0, replayed = 0.0;
  double forward = 0.0, backward_input = 0.0, backward_weight = 0.0, recompute = 0.0;
  double backward = 0.0;  // B (fused)
  // The largest of the layers' (Note [Plan memory]).
  double forward_temporary = 0.0, recompute_temporary = 0.0, backward_temporary = 0.0;

  void add(const Candidate& c);
  schedule::CostModel costs(double message_cost) const;
};

// Note [Plan step]: the step of `schedule` with `costs` per stage (their message cost included),
// the problem's shared cores and step tails.
double step_time(const PlanProblem& problem, const schedule::Schedule& schedule,
                 const std::vector<schedule::CostModel>& costs);

// A rank's peak as a function of its stages' sums: fixed + max over forms of
// constant + sum_s resident_count[s] * resident(s) + replay_count[s] * replayed(s) + the
// temporaries of the form's action (its kind on its stage), one form per compute action of the
// rank's list (duplicates removed); the constant is the gradient bytes of the stages whose first
// B / W has started, what earlier I passes left for their W, and the temporaries of an I / W.
// Index s runs over the rank's own stages.
struct PeakForms {
  enum class Temporary { kNone, kForward, kRecompute, kBackward };
  std::vector<int> stages;  // the rank's model stages, ascending
  std::vector<std::vector<int>> resident_count;
  std::vector<std::vector<int>> replay_count;
  std::vector<double> constant;
  std::vector<Temporary> temporary;  // per form: the kind of its action's temporaries
  std::vector<int> temporary_stage;  // per form: the model stage of its action

  // `sums` is indexed by model stage.
  double peak(const std::vector<StageSums>& sums) const;
};

// `stage_bytes` by model stage (PlanProblem's; empty: none counted).
PeakForms peak_forms(const schedule::Schedule& schedule, int rank,
                     const std::vector<StageBytes>& stage_bytes);

// Checks the problem's shape; ConfigError naming what does not fit.
void check_problem(const PlanProblem& problem, const schedule::Schedule& schedule);

}  // namespace pipemat::plan::detail
