// `pipemat plan` (train/plan.h): the problem it builds from a config, the plan it returns and
// the config that runs it.

#include "pipemat/train/plan.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/plan/split.h"
#include "pipemat/train/config.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/train.h"

namespace pipemat::train {
namespace {

TrainConfig mlp_config() {
  TrainConfig c;
  c.model.kind = models::ModelKind::kMlp;
  c.model.layers = 8;
  c.model.hidden = 16;
  c.model.tokens = 32;
  c.schedule.kind = schedule::ScheduleKind::kOneFOneB;
  c.schedule.ranks = 2;
  c.schedule.micro_batches = 4;
  c.training.steps = 2;
  c.training.lr = 0.05;
  c.training.momentum = 0.9;  // one optimizer state per parameter
  c.training.threads = 1;
  c.output.progress = false;
  return c;
}

PlanOptions budget(int64_t bytes) {
  PlanOptions o;
  o.budget_bytes = {bytes};
  o.repeats = 1;
  return o;
}

const UniformPrediction& uniform(const PlanReport& r, const std::string& policy) {
  for (const UniformPrediction& u : r.uniform)
    if (u.policy == policy) return u;
  throw std::runtime_error("no uniform row " + policy);
}

TEST(Plan, ProblemHoldsEachStagesWeightsGradientsAndLayers) {
  const TrainConfig c = mlp_config();
  const PlanReport r = run_plan(c, budget(int64_t{1} << 40));
  const plan::PlanProblem& p = r.problem;
  // Per stage: the "stage s" entry, then its 4 layers with every candidate of the profile:
  // none, full and the 7 sets of the SAVE leaves norm, up, down.
  ASSERT_EQ(p.layers.size(), 10u);
  EXPECT_EQ(p.layers[0].layer, "stage 0");
  EXPECT_EQ(p.layers[1].layer, "layers.0");
  EXPECT_EQ(p.layers[9].layer, "layers.7");
  EXPECT_EQ(p.stage_of_layer, (std::vector<int>{0, 0, 0, 0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(r.is_layer,
            (std::vector<bool>{false, true, true, true, true, false, true, true, true, true}));
  EXPECT_EQ(p.layers[1].candidates.size(), 9u);
  EXPECT_EQ(p.layers[0].candidates.size(), 1u);
  const ModelRun run = make_model_run(c, 2);
  for (int s = 0; s < 2; ++s) {
    double params = 0;
    for (const auto& t : run.stage(s).module->parameters()) params += t.numel();
    EXPECT_DOUBLE_EQ(p.stage_bytes[s].gradients, params * 4) << s;
    EXPECT_DOUBLE_EQ(p.fixed_bytes[s], params * 4 * 2) << s;  // weights + momentum
    // Every rank's optimizer step is timed; no clipping, so the tails do not wait.
    EXPECT_GT(p.step_tail.at(s), 0) << s;
  }
  EXPECT_FALSE(p.tails_wait_for_all);
  EXPECT_EQ(p.message_cost, 0);
  EXPECT_EQ(p.layers[1].candidates[0].name, "none");
  EXPECT_EQ(p.layers[1].candidates[1].name, "full");
  // Without a binding budget the plan is as fast as keeping everything; where a replay costs
  // no step time (it runs while the rank waits) the tie goes to the smaller peaks.
  EXPECT_DOUBLE_EQ(r.result.best.step, uniform(r, "none").prediction.step);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_LE(r.result.best.ranks[rank].peak_bytes,
              uniform(r, "none").prediction.ranks[rank].peak_bytes);
  }
  EXPECT_EQ(r.config.remat.stages, stages_of_plan(r, r.result.best.choice));
  EXPECT_EQ(r.config.schedule.recompute, schedule::RecomputeMode::kPretrigger);
  // Uniform full: every layer of a stage one unit, no SAVE region.
  std::vector<int> full;
  for (bool is_layer : r.is_layer) full.push_back(is_layer ? 1 : 0);
  EXPECT_EQ(stages_of_plan(r, full)[0],
            models::StageRemat::of({"layers.0", "layers.1", "layers.2", "layers.3"}, {}));
  EXPECT_DOUBLE_EQ(uniform(r, "full").prediction.step, plan::evaluate(p, full).step);
  EXPECT_LT(uniform(r, "full").prediction.ranks[0].peak_bytes,
            uniform(r, "none").prediction.ranks[0].peak_bytes);
}

TEST(Plan, ABudgetBetweenFullAndNoneGivesAPlanThatFitsAndTrainsLikeTheReference) {
  const TrainConfig c = mlp_config();
  const PlanReport wide = run_plan(c, budget(int64_t{1} << 40));
  const double none_peak = uniform(wide, "none").prediction.ranks[0].peak_bytes;
  const double full_peak = uniform(wide, "full").prediction.ranks[0].peak_bytes;
  ASSERT_LT(full_peak, none_peak);
  const auto middle = static_cast<int64_t>((none_peak + full_peak) / 2);
  const PlanReport r = run_plan(c, budget(middle));
  ASSERT_TRUE(r.result.best.fits());
  for (const plan::RankPrediction& rank : r.result.best.ranks) {
    EXPECT_LE(rank.peak_bytes, static_cast<double>(middle)) << rank.rank;
  }
  EXPECT_EQ(r.result.best.ranks[0].peak_bytes,
            plan::evaluate(r.problem, r.result.best.choice).ranks[0].peak_bytes);
  for (const UniformPrediction& u : r.uniform) {
    if (u.prediction.fits()) {
      EXPECT_LE(r.result.best.step, u.prediction.step) << u.policy;
    }
  }
  EXPECT_FALSE(uniform(r, "none").prediction.fits());
  // Rank 0 (two micro-batches in flight) recomputes something; the plan's config parses back
  // from YAML and trains bitwise like the single-process reference.
  ASSERT_EQ(r.config.remat.stages.size(), 2u);
  EXPECT_TRUE(r.config.remat.stages[0].own);
  const TrainConfig planned = parse_config(config_to_yaml(r.config), "plan.yaml");
  EXPECT_EQ(planned.remat.stages, r.config.remat.stages);
  const TrainResult pipe = train_in_process(planned, nullptr);
  const TrainResult ref = train_reference(planned, nullptr);
  ASSERT_EQ(pipe.steps.size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_EQ(pipe.steps[s].loss, ref.steps[s].loss) << s;
  std::map<std::string, at::Tensor> want(ref.params.begin(), ref.params.end());
  for (const auto& [name, value] : pipe.params) EXPECT_TRUE(at::equal(value, want[name])) << name;
  EXPECT_GT(pipe.last.remat.replays, 0);
}

TEST(Plan, CoresBecomeTheRanksThatComputeAtOnce) {
  TrainConfig c = mlp_config();
  c.schedule.ranks = 4;
  c.model.layers = 4;
  PlanOptions o = budget(int64_t{1} << 40);
  o.cores = 2;
  o.message_ms = 0.25;
  c.training.clip_grad_norm = 1.0;
  const PlanReport r = run_plan(c, o);
  EXPECT_EQ(r.problem.parallel_ranks, 2);  // two cores, one thread per rank
  EXPECT_EQ(r.problem.message_cost, 0.25);
  EXPECT_TRUE(r.problem.tails_wait_for_all);
  // Four ranks on two cores take longer than on a core each (on fixed costs: the measured ones
  // of a layer this small are timer noise).
  plan::PlanProblem shared = r.problem;
  for (size_t l = 0; l < shared.layers.size(); ++l) {
    for (plan::Candidate& cand : shared.layers[l].candidates) {
      const double t = r.is_layer[l] ? 1.0 : 0.0;
      cand.forward = cand.backward_input = cand.backward_weight = cand.recompute = t;
      cand.backward = 2 * t;
    }
  }
  plan::PlanProblem own = shared;
  own.parallel_ranks = 0;
  EXPECT_GT(plan::evaluate(shared, r.result.best.choice).step,
            plan::evaluate(own, r.result.best.choice).step + 1.0);
  o.cores = 0;
  EXPECT_EQ(run_plan(c, o).problem.parallel_ranks, 0);
}

TEST(Plan, BadInputIsAConfigError) {
  TrainConfig c = mlp_config();
  const auto message = [&](const TrainConfig& config, const PlanOptions& o) {
    try {
      run_plan(config, o);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string tiny = message(c, budget(1000));
  EXPECT_EQ(tiny.rfind("plan: no remat plan fits the memory budget: rank 0 needs at least ", 0), 0u)
      << tiny;
  EXPECT_NE(tiny.find("The smallest budget every rank fits is "), std::string::npos) << tiny;
  PlanOptions three = budget(1 << 20);
  three.budget_bytes = {1 << 20, 1 << 20, 1 << 20};
  EXPECT_EQ(message(c, three),
            "plan: 3 memory budgets for 2 ranks; give one for every rank or one per rank");
  EXPECT_EQ(message(c, budget(0)), "plan: a memory budget must be > 0 bytes, got 0");
  c.schedule_csv = "x.csv";
  EXPECT_EQ(message(c, budget(1 << 20)),
            "plan: schedule.csv is not supported; plan a generated schedule (schedule.kind)");
}

plan::Candidate split_candidate(double f, double i, double w) {
  plan::Candidate c;
  c.name = "none";
  c.forward = f;
  c.backward_input = i;
  c.backward_weight = w;
  return c;
}

// A profile of 9 equal layers on 3 stages of 1F1B whose last stage's entry (a head) costs four
// layers: the stage entries hold `stage_fixed` bytes each, a layer `layer_fixed`.
PlanReport head_heavy_report(double stage_fixed = 0, double layer_fixed = 0) {
  PlanReport report;
  report.problem.schedule.kind = schedule::ScheduleKind::kOneFOneB;
  report.problem.schedule.ranks = 3;
  report.problem.schedule.micro_batches = 4;
  const std::vector<double> entries_f = {0.1, 5.0, 4.0};  // stage 1's: left out
  for (int s = 0; s < 3; ++s) {
    const double f = entries_f[static_cast<size_t>(s)];
    report.problem.layers.push_back(
        {"stage " + std::to_string(s),
         {s == 0 ? split_candidate(f, -1.5, 0.2) : split_candidate(f, f, f)}});
    report.problem.stage_of_layer.push_back(s);
    report.is_layer.push_back(false);
    report.entry_fixed_bytes.push_back(stage_fixed);
    for (int l = 0; l < 3; ++l) {
      report.problem.layers.push_back(
          {"layers." + std::to_string(3 * s + l), {split_candidate(1.0, 1.0, 1.0)}});
      report.problem.stage_of_layer.push_back(s);
      report.is_layer.push_back(true);
      report.entry_fixed_bytes.push_back(layer_fixed);
    }
  }
  return report;
}

// The split problem cost_split_of makes of head_heavy_report (without bytes): layers.0 gets
// stage 0's entry: F 1.1, I 1 - 1.5 < 0 moved to W: I 0, W 1 + 0.2 - 0.5 = 0.7; B (I + W of
// each) 2 + (-1.3) = 0.7; layers.8 stage 2's, F = I = W = 1 + 4.
plan::SplitProblem head_heavy_split_problem(const PlanReport& report) {
  plan::SplitProblem problem;
  problem.schedule = report.problem.schedule;
  for (int l = 0; l < 9; ++l) {
    plan::LayerCost layer;
    layer.layer = "layers." + std::to_string(l);
    layer.cost = split_candidate(1.0, 1.0, 1.0);
    layer.cost.backward = 2.0;
    problem.layers.push_back(layer);
  }
  problem.layers[0].cost = split_candidate(1.1, 0.0, 0.7);
  problem.layers[0].cost.backward = 0.7;
  problem.layers[8].cost = split_candidate(5.0, 5.0, 5.0);
  problem.layers[8].cost.backward = 10.0;
  return problem;
}

// Note [Split by cost]: the first stage's entry goes to the first layer (a negative I moved to
// W), the last stage's to the last layer, the middle stages' entries are left out; the split is
// the best of every contiguous split of those costs, and the parameter split is the profile's.
TEST(CostSplit, StageEntriesGoToTheEndLayersAndTheSplitIsTheBestOfAll) {
  const PlanReport report = head_heavy_report();
  const CostSplit got =
      cost_split_of(report, models::RematPolicyKind::kNone, schedule::RecomputeMode::kNone);
  EXPECT_EQ(got.parameter_split, (std::vector<int64_t>{3, 3, 3}));
  const plan::SplitProblem problem = head_heavy_split_problem(report);
  double best = 1e300;
  std::vector<int> best_split;
  for (int a = 1; a <= 7; ++a) {
    for (int b = 1; a + b <= 8; ++b) {
      const double step = plan::evaluate_split(problem, {a, b, 9 - a - b}).step;
      if (step < best) best = step, best_split = {a, b, 9 - a - b};
    }
  }
  EXPECT_EQ(got.step_ms, best);
  EXPECT_EQ(std::vector<int64_t>(best_split.begin(), best_split.end()), got.layers_per_stage);
  EXPECT_EQ(got.parameter_step_ms, plan::evaluate_split(problem, {3, 3, 3}).step);
  EXPECT_LT(got.step_ms, got.parameter_step_ms);
  EXPECT_EQ(got.layers_per_stage.back(), 1) << "the head's stage holds one layer";

  // A report of another split, and a policy the report has no candidate for.
  PlanReport other = report;
  other.config.partition.layers_per_stage = {2, 3, 4};
  EXPECT_THROW(cost_split_of(other, models::RematPolicyKind::kNone, schedule::RecomputeMode::kNone),
               ConfigError);
  EXPECT_THROW(
      cost_split_of(report, models::RematPolicyKind::kSelective, schedule::RecomputeMode::kNone),
      ConfigError);
}

// Note [Replays that cannot lower a peak]: with remat.policy full and pre-triggered recompute
// the run leaves the last stage of 1F1B without a checkpoint, so the cost split counts its
// layers' none candidates there and the others' full ones (a replay of F 1 each): its choice
// and step are enumeration's over that problem, and not those of the replays on every stage.
TEST(CostSplit, TheLastStageOf1F1BIsCountedWithoutItsReplays) {
  PlanReport report = head_heavy_report();
  for (size_t l = 0; l < report.problem.layers.size(); ++l) {
    if (!report.is_layer[l]) continue;
    plan::Candidate full = split_candidate(1.0, 1.0, 1.0);
    full.name = "full";
    full.recompute = 1.0;
    report.problem.layers[l].candidates.push_back(full);
  }
  const CostSplit got =
      cost_split_of(report, models::RematPolicyKind::kFull, schedule::RecomputeMode::kPretrigger);
  plan::SplitProblem problem = head_heavy_split_problem(report);
  problem.schedule.recompute = schedule::RecomputeMode::kPretrigger;
  for (plan::LayerCost& layer : problem.layers) {
    layer.without_replay = layer.cost;
    layer.cost.recompute = 1.0;
  }
  plan::SplitProblem replayed = problem;
  problem.stages_without_replay = {2};
  double best = 1e300, best_replayed = 1e300;
  std::vector<int> best_split;
  for (int a = 1; a <= 7; ++a) {
    for (int b = 1; a + b <= 8; ++b) {
      const double step = plan::evaluate_split(problem, {a, b, 9 - a - b}).step;
      if (step < best) best = step, best_split = {a, b, 9 - a - b};
      best_replayed =
          std::min(best_replayed, plan::evaluate_split(replayed, {a, b, 9 - a - b}).step);
    }
  }
  EXPECT_EQ(got.step_ms, best);
  EXPECT_EQ(std::vector<int64_t>(best_split.begin(), best_split.end()), got.layers_per_stage);
  EXPECT_EQ(got.parameter_step_ms, plan::evaluate_split(problem, {3, 3, 3}).step);
  EXPECT_LT(got.step_ms, best_replayed) << "the last stage runs no replay";
  // Lazy recompute replays inside the backward on every stage: none is left out.
  const CostSplit lazy =
      cost_split_of(report, models::RematPolicyKind::kFull, schedule::RecomputeMode::kLazy);
  replayed.schedule.recompute = schedule::RecomputeMode::kLazy;
  EXPECT_EQ(lazy.parameter_step_ms, plan::evaluate_split(replayed, {3, 3, 3}).step);
}

// partition.memory_budget: the split is the fastest of those whose every rank's peak (its
// layers' held bytes, the end stages' own on their end layers, no activations here) fits; the
// parameter split is not kept when it does not fit; no split that fits is an error naming the
// key and the closest split.
TEST(CostSplit, ABudgetRulesOutFasterSplitsAndOneNothingFitsIsAnError) {
  // Stage entries 100 B each (stage 1's left out), layers 10 B each.
  const PlanReport report = head_heavy_report(100, 10);
  const CostSplit free =
      cost_split_of(report, models::RematPolicyKind::kNone, schedule::RecomputeMode::kNone);
  ASSERT_EQ(free.layers_per_stage.back(), 1);
  EXPECT_TRUE(free.budget_bytes.empty());
  // Peaks of a split [a, b, c]: 100 + 10a, 10b, 100 + 10c; the parameter split's 130, 30, 130.
  EXPECT_EQ(free.parameter_peak_bytes, (std::vector<double>{130, 30, 130}));
  const std::vector<double> free_peaks = {
      100.0 + 10 * static_cast<double>(free.layers_per_stage[0]),
      10.0 * static_cast<double>(free.layers_per_stage[1]), 110.0};
  EXPECT_EQ(free.peak_bytes, free_peaks);
  ASSERT_GT(free.layers_per_stage[0], 2) << "the budget below must rule the free choice out";

  const CostSplit fit =
      cost_split_of(report, models::RematPolicyKind::kNone, schedule::RecomputeMode::kNone, {120});
  // Every split with a <= 2 and c <= 2 fits 120 B; the fastest of them by enumeration.
  const plan::SplitProblem problem = head_heavy_split_problem(report);
  double best = 1e300;
  std::vector<int64_t> best_split;
  for (int a = 1; a <= 2; ++a) {
    for (int c = 1; c <= 2; ++c) {
      const double step = plan::evaluate_split(problem, {a, 9 - a - c, c}).step;
      if (step < best) best = step, best_split = {a, 9 - a - c, c};
    }
  }
  EXPECT_EQ(fit.layers_per_stage, best_split);
  EXPECT_EQ(fit.step_ms, best);
  EXPECT_GT(fit.step_ms, free.step_ms);
  EXPECT_EQ(fit.budget_bytes, (std::vector<double>{120, 120, 120}));
  EXPECT_FALSE(fit.parameter_fits);
  EXPECT_FALSE(fit.kept_parameter_split);
  for (double peak : fit.peak_bytes) EXPECT_LE(peak, 120);
  const std::string text = describe_cost_split(fit);
  EXPECT_NE(text.find("within the budget [120 B, 120 B, 120 B] (the parameter split's [130 B, "
                      "30 B, 130 B] does not fit)"),
            std::string::npos)
      << text;

  // Per rank: rank 1 may hold 3 layers at most.
  const CostSplit per_rank = cost_split_of(report, models::RematPolicyKind::kNone,
                                           schedule::RecomputeMode::kNone, {1000, 30, 1000});
  EXPECT_LE(per_rank.layers_per_stage[1], 3);

  try {
    cost_split_of(report, models::RematPolicyKind::kNone, schedule::RecomputeMode::kNone, {105});
    ADD_FAILURE() << "no split fits 105 B";
  } catch (const ConfigError& e) {
    // Every split puts 110 B or more on rank 0 and rank 2; the closest is the first of the
    // splits that overshoot 5 B on both ends.
    EXPECT_EQ(std::string(e.what()),
              "partition.memory_budget: split: no contiguous split of the 9 layers on 3 stages "
              "fits the memory budget; the closest (layers per stage 1,7,1) peaks at 110 B on "
              "rank 0, whose budget is 105 B.");
  }
  try {
    cost_split_of(report, models::RematPolicyKind::kNone, schedule::RecomputeMode::kNone, {1, 2});
    ADD_FAILURE() << "2 budgets for 3 ranks";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "partition.memory_budget: 2 memory budgets for 3 ranks; give one for every rank "
                 "or one per rank");
  }
}

TEST(CostSplit, AutoIsAConfigValueWithItsChecks) {
  const TrainConfig c = parse_config("partition: {layers_per_stage: auto}\n", "x.yaml");
  EXPECT_TRUE(c.partition.by_cost);
  EXPECT_TRUE(c.partition.layers_per_stage.empty());
  EXPECT_NE(config_to_yaml(c).find("layers_per_stage: auto"), std::string::npos);
  EXPECT_EQ(parse_config(config_to_yaml(c), "again").partition.by_cost, true);
  const TrainConfig counts = parse_config("partition: {layers_per_stage: auto}\n", "x.yaml",
                                          {"partition.layers_per_stage=[3, 5]", "model.layers=8"});
  EXPECT_FALSE(counts.partition.by_cost);
  EXPECT_EQ(counts.partition.layers_per_stage, (std::vector<int64_t>{3, 5}));
  try {
    parse_config(
        "partition: {layers_per_stage: auto}\nremat: {policy: custom, checkpoint: "
        "[layers.*]}\n",
        "x.yaml");
    ADD_FAILURE() << "auto with a custom policy";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("partition.layers_per_stage: auto profiles the layers"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_config("partition: {layers_per_stage: automatic}\n", "x.yaml"), ConfigError);

  // partition.memory_budget: a size or a list of sizes, only with auto.
  const TrainConfig one =
      parse_config("partition: {layers_per_stage: auto, memory_budget: 2GiB}\n", "x.yaml");
  EXPECT_EQ(one.partition.memory_budget, (std::vector<int64_t>{int64_t{2} << 30}));
  EXPECT_EQ(parse_config(config_to_yaml(one), "again").partition.memory_budget,
            one.partition.memory_budget);
  const TrainConfig two = parse_config(
      "partition: {layers_per_stage: auto, memory_budget: [512MiB, 4096]}\nschedule: {ranks: 2}\n",
      "x.yaml");
  EXPECT_EQ(two.partition.memory_budget, (std::vector<int64_t>{int64_t{512} << 20, 4096}));
  const auto error = [](const std::string& yaml) {
    try {
      parse_config(yaml, "x.yaml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("partition: {memory_budget: 1GiB}\n"),
            "x.yaml:1: partition.memory_budget: a budget for the split "
            "partition.layers_per_stage auto chooses, but layers_per_stage is not auto; set it to "
            "auto, or remove the budget (pipemat plan --memory-budget fits the remat policy of a "
            "given split to a budget)");
  EXPECT_EQ(error("schedule: {ranks: 2}\n"
                  "partition: {layers_per_stage: auto, memory_budget: [1GiB, 1GiB, 1GiB]}\n"),
            "x.yaml:2: partition.memory_budget: 3 sizes for 2 ranks (schedule.ranks); give one "
            "for every rank or one per rank");
  EXPECT_EQ(error("partition: {layers_per_stage: auto, memory_budget: 2TB}\n"),
            "x.yaml:1: partition.memory_budget: memory size: unknown size unit 'TB' in '2TB'; use "
            "B, KiB, MiB or GiB");
  EXPECT_EQ(error("partition: {layers_per_stage: auto, memory_budget: [0]}\n"),
            "x.yaml:1: partition.memory_budget[0]: '0' is not above 0 bytes");
}

}  // namespace
}  // namespace pipemat::train
