#pragma once
// Private types of the planner shared by peak.cpp and solve.cpp.

#include <vector>

#include "pipemat/plan/plan.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::plan::detail {

// What a stage's layers add up to under one assignment (Note [Plan memory]).
struct StageSums {
  double resident = 0.0, replayed = 0.0;
  double forward = 0.0, backward_input = 0.0, backward_weight = 0.0, recompute = 0.0;

  void add(const Candidate& c);
  schedule::CostModel costs(double message_cost) const;
};

// A rank's peak as a function of its stages' sums: fixed + max over forms of
// constant + sum_s resident_count[s] * resident(s) + replay_count[s] * replayed(s), one form per
// compute action of the rank's list (duplicates removed); the constant is the gradient bytes of
// the stages whose first B / W has started, plus the backward temporaries of a B / I / W.
// Index s runs over the rank's own stages.
struct PeakForms {
  std::vector<int> stages;  // the rank's model stages, ascending
  std::vector<std::vector<int>> resident_count;
  std::vector<std::vector<int>> replay_count;
  std::vector<double> constant;

  // `sums` is indexed by model stage.
  double peak(const std::vector<StageSums>& sums) const;
};

// `gradient_bytes`, `backward_bytes` by model stage (PlanProblem's; empty: none).
PeakForms peak_forms(const schedule::Schedule& schedule, int rank,
                     const std::vector<double>& gradient_bytes,
                     const std::vector<double>& backward_bytes);

// Checks the problem's shape; ConfigError naming what does not fit.
void check_problem(const PlanProblem& problem, const schedule::Schedule& schedule);

}  // namespace pipemat::plan::detail
