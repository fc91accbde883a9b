// partition.layers_per_stage: auto and pipemat plan's proposed split (Note [Split by cost] in
// pipemat/train/plan.h): the profile of `pipemat plan` as the costs of plan::choose_split.

#include <algorithm>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/plan/split.h"
#include "pipemat/train/plan.h"
#include "pipemat/train/train.h"

namespace pipemat::train {
namespace {

// `c` with its fused backward spelled out (0 means I + W in plan::Candidate).
plan::Candidate with_backward(plan::Candidate c) {
  if (c.backward == 0) c.backward = c.backward_input + c.backward_weight;
  return c;
}

// A layer's cost with a stage's own entry added: times and kept bytes add up, temporaries are
// the larger. An entry's times are the whole stage's minus its layers' and can be negative: the
// first stage's I is nearly empty (its input, token ids, needs no gradient, so W runs the whole
// backward), which makes that entry's I negative. Such a deficit moves to the partner pass (I to
// W and back), so the stage's I + W stays the measured one; what is left below 0 becomes 0.
void add_entry(plan::Candidate& layer, const plan::Candidate& entry) {
  layer = with_backward(layer);
  const plan::Candidate e = with_backward(entry);
  layer.forward += e.forward;
  layer.backward_input += e.backward_input;
  layer.backward_weight += e.backward_weight;
  layer.backward += e.backward;
  layer.recompute += e.recompute;
  layer.resident_bytes += e.resident_bytes;
  layer.replayed_bytes += e.replayed_bytes;
  layer.forward_temporary_bytes =
      std::max(layer.forward_temporary_bytes, e.forward_temporary_bytes);
  layer.recompute_temporary_bytes =
      std::max(layer.recompute_temporary_bytes, e.recompute_temporary_bytes);
  layer.backward_temporary_bytes =
      std::max(layer.backward_temporary_bytes, e.backward_temporary_bytes);
  if (layer.backward_input < 0) layer.backward_weight += layer.backward_input;
  if (layer.backward_weight < 0) layer.backward_input += layer.backward_weight;
  for (double* v : {&layer.forward, &layer.backward_input, &layer.backward_weight, &layer.backward,
                    &layer.recompute, &layer.resident_bytes, &layer.replayed_bytes}) {
    *v = std::max(0.0, *v);
  }
}

// The SAVE leaves (paths below a layer) of the model kind's selective policy: its exclude rules
// "<units>.*.<leaf>".
std::vector<std::string> selective_save_leaves(const TrainConfig& config) {
  models::RematConfig selective = config.remat;
  selective.policy = models::RematPolicyKind::kSelective;
  std::vector<std::string> out;
  for (const remat::ExcludeRule& rule : models::stage_policy(config.model, selective).exclude) {
    const size_t at = rule.path.find(".*.");
    if (at != std::string::npos) out.push_back(rule.path.substr(at + 3));
  }
  return out;
}

std::string counts_text(const std::vector<int64_t>& counts) {
  std::string s = "[";
  for (size_t i = 0; i < counts.size(); ++i) s += (i ? ", " : "") + std::to_string(counts[i]);
  return s + "]";
}

}  // namespace

CostSplit cost_split_of(const PlanReport& profiled, models::RematPolicyKind policy,
                        schedule::RecomputeMode recompute,
                        const std::vector<int64_t>& budget_bytes) {
  const plan::PlanProblem& problem = profiled.problem;
  PIPEMAT_CHECK(
      !profiled.config.partition.by_cost && profiled.config.partition.layers_per_stage.empty(),
      ConfigError,
      "partition.layers_per_stage auto: the profile must be of the parameter split "
      "(layers_per_stage empty)");
  PIPEMAT_CHECK(problem.layers.size() == profiled.is_layer.size() &&
                    problem.layers.size() == problem.stage_of_layer.size() &&
                    problem.layers.size() == profiled.entry_fixed_bytes.size() &&
                    !problem.layers.empty(),
                ConfigError, "partition.layers_per_stage auto: a malformed profile");
  const std::vector<int> choice = uniform_choice(profiled, policy);
  const std::vector<int> plain = uniform_choice(profiled, models::RematPolicyKind::kNone);
  const int stages = problem.stage_of_layer.back() + 1;
  CostSplit out;
  out.summary = profiled.summary;
  out.parameter_split.assign(static_cast<size_t>(stages), 0);
  plan::SplitProblem split;
  split.schedule = problem.schedule;
  split.schedule.recompute = recompute;
  split.message_cost = problem.message_cost;
  split.parallel_ranks = problem.parallel_ranks;  // Note [Shared cores]
  split.shared_speed = problem.shared_speed;
  // The stages the run leaves without a checkpoint, the same on every split (they follow from
  // the schedule alone).
  models::RematConfig remat;
  remat.policy = policy;
  split.stages_without_replay =
      stages_without_replay(remat, recompute, schedule::build_schedule(split.schedule));
  if (!budget_bytes.empty()) {
    split.budget_bytes =
        budgets_per_rank(budget_bytes, problem.schedule.ranks, "partition.memory_budget");
  }
  const plan::Candidate* first_entry = nullptr;
  const plan::Candidate* last_entry = nullptr;
  double first_fixed = 0, last_fixed = 0;
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    const int s = problem.stage_of_layer[l];
    const auto& candidates = problem.layers[l].candidates;
    if (!profiled.is_layer[l]) {
      PIPEMAT_CHECK(!candidates.empty(), ConfigError, "partition.layers_per_stage auto: stage ", s,
                    " has no profile");
      if (s == 0) {
        first_entry = &candidates.front();
        first_fixed = profiled.entry_fixed_bytes[l];
      }
      if (s == stages - 1) {
        last_entry = &candidates.front();
        last_fixed = profiled.entry_fixed_bytes[l];
      }
      continue;
    }
    ++out.parameter_split[static_cast<size_t>(s)];
    split.layers.push_back({problem.layers[l].layer, candidates.at(static_cast<size_t>(choice[l])),
                            profiled.entry_fixed_bytes[l],
                            candidates.at(static_cast<size_t>(plain[l]))});
  }
  PIPEMAT_CHECK(first_entry != nullptr && last_entry != nullptr && !split.layers.empty(),
                ConfigError, "partition.layers_per_stage auto: the profile holds no stage entries");
  add_entry(split.layers.front().cost, *first_entry);
  add_entry(split.layers.front().without_replay, *first_entry);
  split.layers.front().fixed_bytes += first_fixed;
  if (last_entry != first_entry) {  // 1 stage: one entry
    add_entry(split.layers.back().cost, *last_entry);
    add_entry(split.layers.back().without_replay, *last_entry);
    split.layers.back().fixed_bytes += last_fixed;
  }
  // The parameter split is evaluated on its own below (no SplitProblem::reference: the search
  // would simulate it once more).
  const std::vector<int> parameter_counts(out.parameter_split.begin(), out.parameter_split.end());
  plan::SplitResult chosen;
  try {
    chosen = plan::choose_split(split);
  } catch (const ConfigError& e) {
    if (split.budget_bytes.empty()) throw;
    PIPEMAT_THROW(ConfigError, "partition.memory_budget: ", e.what());
  }
  const plan::SplitResult parameter = plan::evaluate_split(split, parameter_counts);
  out.parameter_step_ms = parameter.step;
  out.simulations = chosen.simulations;
  out.parameter_peak_bytes = parameter.peak_bytes;
  out.parameter_fits = true;
  for (size_t r = 0; r < split.budget_bytes.size(); ++r) {
    out.parameter_fits = out.parameter_fits && parameter.peak_bytes[r] <= split.budget_bytes[r];
  }
  out.budget_bytes = split.budget_bytes;
  out.kept_parameter_split = out.parameter_fits && parameter.step <= chosen.step * (1 + kMinGain);
  if (out.kept_parameter_split) {
    out.layers_per_stage = out.parameter_split;
    out.step_ms = parameter.step;
    out.peak_bytes = parameter.peak_bytes;
  } else {
    for (int n : chosen.layers_per_stage) out.layers_per_stage.push_back(n);
    out.step_ms = chosen.step;
    out.peak_bytes = chosen.peak_bytes;
  }
  return out;
}

CostSplit choose_cost_split(const TrainConfig& config, const PlanOptions& options) {
  PIPEMAT_CHECK(
      config.remat.policy != models::RematPolicyKind::kCustom && config.remat.stages.empty(),
      ConfigError,
      "partition.layers_per_stage auto profiles the layers under remat.policy none, "
      "full or selective; with remat.policy custom or remat.stages give the layer counts "
      "by hand");
  TrainConfig parameter_split = config;
  parameter_split.partition = {};
  // Only the candidates the run can use: none, full and the selective policy's SAVE set.
  PlanOptions only = options;
  only.save_sets = {selective_save_leaves(config)};
  if (only.save_sets.front().empty()) only.save_sets.clear();
  const PlanReport report = profile_plan(parameter_split, only);
  return cost_split_of(report, config.remat.policy, config.schedule.recompute,
                       config.partition.memory_budget);
}

std::string describe_cost_split(const CostSplit& split) {
  std::string s = "split by cost: " + counts_text(split.layers_per_stage) + " layers per stage, " +
                  "predicted step " + format_fixed(split.step_ms, 1) + " ms; parameter split " +
                  counts_text(split.parameter_split) + ": " +
                  format_fixed(split.parameter_step_ms, 1) + " ms";
  if (split.step_ms > 0) {
    s += " (" + format_fixed(split.parameter_step_ms / split.step_ms, 2) + "x)";
  }
  if (split.kept_parameter_split) {
    s += "; kept: no split is predicted " + format_fixed(kMinGain * 100, 0) + " % faster";
  }
  if (!split.budget_bytes.empty()) {
    const auto bytes = [](const std::vector<double>& v) {
      std::vector<std::string> parts;
      for (double b : v) parts.push_back(format_bytes(static_cast<int64_t>(b)));
      return "[" + join(parts, ", ") + "]";
    };
    s += "; predicted peak per rank " + bytes(split.peak_bytes) + " within the budget " +
         bytes(split.budget_bytes);
    if (!split.parameter_fits) {
      s += " (the parameter split's " + bytes(split.parameter_peak_bytes) + " does not fit)";
    }
  }
  return s;
}

}  // namespace pipemat::train
