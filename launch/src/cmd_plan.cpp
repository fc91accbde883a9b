#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/train/config.h"
#include "pipemat/train/plan.h"

namespace pipemat::launch {
namespace {

// "layers.0-3 full, layers.4 save:up": consecutive layers of one stage with one choice merged.
std::string stage_choices(const train::PlanReport& report, const std::vector<int>& choice,
                          int stage) {
  const plan::PlanProblem& problem = report.problem;
  std::vector<std::string> parts;
  size_t l = 0;
  while (l < problem.layers.size()) {
    if (problem.stage_of_layer[l] != stage || !report.is_layer[l]) {
      ++l;
      continue;
    }
    size_t end = l + 1;
    while (end < problem.layers.size() && problem.stage_of_layer[end] == stage &&
           report.is_layer[end] && choice[end] == choice[l])
      ++end;
    const std::string& first = problem.layers[l].layer;
    std::string name = first;
    if (end - l > 1) {
      const std::string& last = problem.layers[end - 1].layer;
      name += "-" + last.substr(last.find('.') + 1);
    }
    parts.push_back(name + " " + problem.layers[l].candidates[static_cast<size_t>(choice[l])].name);
    l = end;
  }
  return join(parts, ", ");
}

std::string peaks_of(const plan::Prediction& p) {
  std::vector<std::string> peaks;
  for (const plan::RankPrediction& r : p.ranks)
    peaks.push_back(format_bytes(static_cast<int64_t>(r.peak_bytes)));
  return join(peaks, ", ");
}

nlohmann::json prediction_json(const plan::Prediction& p) {
  nlohmann::json out;
  out["step_ms"] = p.step;
  out["fits"] = p.fits();
  for (const plan::RankPrediction& r : p.ranks) {
    out["ranks"].push_back({{"rank", r.rank},
                            {"peak_bytes", static_cast<int64_t>(r.peak_bytes)},
                            {"budget_bytes", static_cast<int64_t>(r.budget_bytes)},
                            {"fits", r.fits()}});
  }
  return out;
}

nlohmann::json candidate_json(const plan::Candidate& c) {
  return {{"name", c.name},
          {"resident_bytes", c.resident_bytes},
          {"replayed_bytes", c.replayed_bytes},
          {"forward_ms", c.forward},
          {"backward_input_ms", c.backward_input},
          {"backward_weight_ms", c.backward_weight},
          {"backward_ms", c.backward},
          {"recompute_ms", c.recompute},
          {"forward_temporary_bytes", c.forward_temporary_bytes},
          {"recompute_temporary_bytes", c.recompute_temporary_bytes},
          {"backward_temporary_bytes", c.backward_temporary_bytes}};
}

void print_text(const train::PlanReport& report, const train::Calibration& calibrated,
                std::ostream& out) {
  const plan::Prediction& best = report.result.best;
  const plan::PlanProblem& problem = report.problem;
  out << "plan: " << report.summary << "\n";
  out << "plan: step model: messages " << format_fixed(problem.message_cost, 2)
      << " ms, shared speed " << format_fixed(problem.shared_speed, 3);
  if (calibrated.steps > 0) {
    out << " (calibration run of remat none: " << format_fixed(calibrated.step_ms, 1)
        << " ms a step, predicted at shared speed 1: " << format_fixed(calibrated.predicted_ms, 1)
        << " ms)";
  } else {
    out << " (not measured)";
  }
  out << "\n";
  out << "plan: predicted step " << format_fixed(best.step, 2) << " ms ("
      << report.result.simulations << " schedules simulated)\n";
  const schedule::Schedule s = plan::plan_schedule(problem);
  for (const plan::RankPrediction& r : best.ranks) {
    out << "  rank " << r.rank << ": peak " << format_bytes(static_cast<int64_t>(r.peak_bytes))
        << " of " << format_bytes(static_cast<int64_t>(r.budget_bytes)) << " (weights and "
        << "optimizer state " << format_bytes(static_cast<int64_t>(problem.fixed_bytes[r.rank]))
        << ")\n";
    for (int stage : s.stages_of(r.rank)) {
      out << "    stage " << stage << ": " << stage_choices(report, best.choice, stage) << "\n";
    }
  }
  out << "uniform policies (same schedule and profiles):\n";
  const plan::Prediction* best_uniform = nullptr;
  std::string best_name;
  for (const train::UniformPrediction& u : report.uniform) {
    const plan::Prediction& p = u.prediction;
    out << "  " << std::left << std::setw(10) << u.policy << std::right << " step " << std::setw(9)
        << format_fixed(p.step, 2) << " ms  peaks " << peaks_of(p) << "  "
        << (p.fits() ? "fits" : "over budget") << "\n";
    if (p.fits() && (best_uniform == nullptr || p.step < best_uniform->step)) {
      best_uniform = &p;
      best_name = u.policy;
    }
  }
  if (best_uniform != nullptr) {
    out << "plan: " << format_fixed(best_uniform->step / best.step, 3)
        << "x the speed of the fastest uniform policy that fits (" << best_name << ")\n";
  } else {
    out << "plan: no uniform policy fits the budget\n";
  }
}

struct PlanFlags {
  std::string config;
  std::vector<std::string> overrides;
  std::string budget;
  std::string out;
  bool json = false;
  train::PlanOptions plan;
  train::CalibrationOptions calibration;
};

// The calibration run's flags (Note [Plan calibration]).
void add_plan_calibration_flags(CLI::App& cmd, train::CalibrationOptions& calibration) {
  cmd.add_option("--calibration-steps", calibration.steps,
                 "Steps of the calibration run: the config with remat none as its own job\n"
                 "(pipemat-run) before the plan is solved; it measures what a message takes\n"
                 "and how fast a rank computes while the others do too (Note [Plan\n"
                 "calibration]). 0: no run, the profile alone (--message-ms, --shared-speed)")
      ->check(CLI::Range(int64_t{0}, int64_t{1000}))
      ->capture_default_str();
  cmd.add_option("--transport", calibration.transport,
                 "Transport of the calibration run: mpi (as `pipemat-run -n N plan.yaml` runs\n"
                 "the plan) or tcp")
      ->check(CLI::IsMember({"mpi", "tcp"}))
      ->capture_default_str();
  cmd.add_option("--launcher", calibration.launcher,
                 "pipemat-run for the calibration run (default: next to this binary)");
  cmd.add_option("--message-ms", calibration.message_ms,
                 "What one stage-boundary message takes from send to use, ms, instead of the\n"
                 "calibration run's (default: measured; 0 with --calibration-steps 0)")
      ->check(CLI::Range(0.0, 1e6));
  cmd.add_option("--shared-speed", calibration.shared_speed,
                 "A rank's speed while other ranks compute too, in (0, 1], instead of the\n"
                 "calibration run's: shared caches and memory bandwidth, the transport's threads,\n"
                 "switching when ranks outnumber --cores (default: measured; 1 with\n"
                 "--calibration-steps 0)")
      ->check(CLI::Range(0.01, 1.0));
}

// The calibration run's options: without a run, the times it would measure default to none
// (messages) and 1 (shared speed).
train::CalibrationOptions plan_calibration(const PlanFlags& f) {
  train::CalibrationOptions calibration = f.calibration;
  if (calibration.steps == 0) {
    calibration.message_ms = std::max(calibration.message_ms, 0.0);
    if (calibration.shared_speed < 0) calibration.shared_speed = 1;
  } else if (!f.json && (calibration.message_ms < 0 || calibration.shared_speed < 0)) {
    std::cout << "plan: calibrating the step model on " << calibration.steps
              << " steps of the config with remat none (pipemat-run, " << calibration.transport
              << ")\n"
              << std::flush;
  }
  return calibration;
}

void write_plan_config(const PlanFlags& f, const train::PlanReport& report) {
  std::ofstream file(f.out);
  PIPEMAT_CHECK(file.good(), ConfigError, "--out: cannot write '", f.out, "'");
  file << "# pipemat plan --config " << f.config << " --memory-budget " << f.budget
       << ": predicted step " << format_fixed(report.result.best.step, 2) << " ms, peaks "
       << peaks_of(report.result.best) << "\n"
       << train::config_to_yaml(report.config);
  PIPEMAT_CHECK(file.good(), ConfigError, "--out: cannot write '", f.out, "'");
}

// Stage entry `l` of the problem, beyond its layers (Note [Plan inputs]), with its StageBytes.
nlohmann::json stage_json(const plan::PlanProblem& problem, size_t l) {
  const size_t s = static_cast<size_t>(problem.stage_of_layer[l]);
  nlohmann::json stage = candidate_json(problem.layers[l].candidates.front());
  stage.erase("name");
  stage["stage"] = s;
  if (s < problem.stage_bytes.size()) {
    const plan::StageBytes& b = problem.stage_bytes[s];
    stage["gradient_bytes"] = b.gradients;
    stage["input_temporary_bytes"] = b.backward_input;
    stage["input_held_bytes"] = b.input_held;
    stage["received_input_bytes"] = b.received_input;
    stage["received_gradient_bytes"] = b.received_gradient;
    stage["first_backward_gradient_bytes"] = b.first_backward_gradients;
    stage["weight_temporary_bytes"] = b.backward_weight;
  }
  return stage;
}

nlohmann::json plan_json(const PlanFlags& f, const train::PlanReport& report,
                         const train::Calibration& calibrated) {
  nlohmann::json out;
  out["summary"] = report.summary;
  out["plan"] = prediction_json(report.result.best);
  out["simulations"] = report.result.simulations;
  const plan::PlanProblem& problem = report.problem;
  for (double bytes : problem.fixed_bytes) out["fixed_bytes"].push_back(bytes);
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    if (!report.is_layer[l]) continue;
    const auto& c = problem.layers[l].candidates[static_cast<size_t>(report.result.best.choice[l])];
    out["plan"]["layers"].push_back({{"layer", problem.layers[l].layer},
                                     {"stage", problem.stage_of_layer[l]},
                                     {"policy", c.name}});
  }
  for (const train::UniformPrediction& u : report.uniform)
    out["uniform"][u.policy] = prediction_json(u.prediction);
  const auto first_layer = std::find(report.is_layer.begin(), report.is_layer.end(), true);
  const size_t layer = static_cast<size_t>(first_layer - report.is_layer.begin());
  for (const plan::Candidate& c : problem.layers.at(layer).candidates)
    out["candidates"].push_back(candidate_json(c));
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    if (!report.is_layer[l]) out["stages"].push_back(stage_json(problem, l));
  }
  out["step_tail_ms"] = problem.step_tail;
  out["tails_wait_for_all"] = problem.tails_wait_for_all;
  out["message_ms"] = problem.message_cost;
  out["parallel_ranks"] = problem.parallel_ranks;
  out["shared_speed"] = problem.shared_speed;
  out["calibration"] = {{"steps", calibrated.steps},
                        {"step_ms", calibrated.step_ms},
                        {"predicted_ms", calibrated.predicted_ms}};
  if (!f.out.empty()) out["out"] = f.out;
  return out;
}

// Note [Split by cost]: the split the planner proposes, for the run's uniform remat policy (none
// for a plan's own config). With partition.layers_per_stage auto it is chosen first, from a
// profile of the parameter split, and the remat plan is made on it; with no counts (the plan's
// profile is then of the parameter split) it is a proposal beside the plan, from that profile
// when it holds the policy's candidate; counts given by hand are planned as they are.
models::RematPolicyKind proposal_policy(const train::TrainConfig& config) {
  return config.remat.policy == models::RematPolicyKind::kCustom || !config.remat.stages.empty()
             ? models::RematPolicyKind::kNone
             : config.remat.policy;
}

// `config` with proposal_policy on every stage.
train::TrainConfig with_proposal_policy(const train::TrainConfig& config) {
  train::TrainConfig uniform = config;
  uniform.remat.policy = proposal_policy(config);
  uniform.remat.custom = {};
  uniform.remat.stages.clear();
  return uniform;
}

std::optional<train::CostSplit> split_first(train::TrainConfig& config,
                                            const train::PlanOptions& options) {
  if (!config.partition.by_cost) return std::nullopt;
  train::CostSplit split = train::choose_cost_split(with_proposal_policy(config), options);
  config.partition.by_cost = false;
  config.partition.memory_budget.clear();  // met by the counts
  config.partition.layers_per_stage = split.layers_per_stage;
  return split;
}

std::optional<train::CostSplit> proposal_beside(const train::TrainConfig& config,
                                                const train::PlanReport& report,
                                                const train::PlanOptions& options) {
  if (!config.partition.layers_per_stage.empty()) return std::nullopt;
  const models::RematPolicyKind policy = proposal_policy(config);
  if (policy != models::RematPolicyKind::kSelective || report.selective >= 0) {
    return train::cost_split_of(report, policy, config.schedule.recompute);
  }
  // The plan profiled other SAVE sets: one more profile.
  return train::choose_cost_split(with_proposal_policy(config), options);
}

void run_plan_command(PlanFlags& f) {
  train::TrainConfig config = train::load_config(f.config, f.overrides);
  print_config_warnings(config.warnings);
  f.plan.budget_bytes = parse_byte_list(f.budget, "--memory-budget",
                                        "a size such as 48MiB, or one per rank: 64MiB,48MiB");
  std::optional<train::CostSplit> split = split_first(config, f.plan);
  // Solved once before the calibration run, so that a budget nothing fits fails at once (the
  // bytes do not depend on the times), and again with the calibrated step model.
  train::PlanReport report = train::profile_plan(config, f.plan);
  if (!split) split = proposal_beside(config, report, f.plan);
  train::solve_plan(report, f.plan.budget_bytes);
  const train::Calibration calibrated = train::calibrate_plan(report, plan_calibration(f), "plan");
  train::solve_plan(report, f.plan.budget_bytes);
  if (!f.out.empty()) write_plan_config(f, report);
  // The plan is on the proposed split when the config holds it, or the parameter split is it.
  const bool planned_on_split =
      split && (config.partition.layers_per_stage == split->layers_per_stage ||
                (config.partition.layers_per_stage.empty() &&
                 split->layers_per_stage == split->parameter_split));
  if (f.json) {
    nlohmann::json out = plan_json(f, report, calibrated);
    if (split) {
      out["split"] = {{"layers_per_stage", split->layers_per_stage},
                      {"step_ms", split->step_ms},
                      {"parameter_split", split->parameter_split},
                      {"parameter_step_ms", split->parameter_step_ms},
                      {"kept_parameter_split", split->kept_parameter_split},
                      {"planned", planned_on_split}};
    }
    std::cout << out.dump() << std::endl;
    return;
  }
  print_text(report, calibrated, std::cout);
  if (split) {
    std::cout << "plan: " << train::describe_cost_split(*split)
              << (planned_on_split
                      ? "; the plan above is on this split\n"
                      : "; the plan above is on the parameter split (partition.layers_per_stage: "
                        "auto plans on the split by cost)\n");
  }
  if (!f.out.empty()) {
    std::cout << "plan: wrote " << f.out << "; run it with: pipemat-run -n "
              << config.schedule.ranks << " " << f.out << "\n";
  }
}

}  // namespace

std::vector<int64_t> parse_byte_list(const std::string& text, const std::string& flag,
                                     const std::string& expected) {
  std::vector<int64_t> out;
  for (const std::string& item : split(text, ',')) out.push_back(parse_bytes(item, flag));
  PIPEMAT_CHECK(!out.empty(), ConfigError, flag, ": expected ", expected);
  return out;
}

void add_plan_profile_flags(CLI::App& cmd, train::PlanOptions& plan) {
  cmd.add_option("--repeats", plan.repeats, "Profiler repeats per candidate (times: median)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd.add_option("--profile-warmup", plan.warmup, "Unmeasured profiler rounds before the repeats")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  cmd.add_option("--max-save-leaves", plan.max_save_leaves,
                 "SAVE regions per layer to combine (2^n - 1 selective candidates)")
      ->check(CLI::Range(0, 10))
      ->capture_default_str();
  cmd.add_option("--cores", plan.cores,
                 "Cores the ranks share: more ranks than cores / threads per rank compute at\n"
                 "once only by sharing them (-1: this machine's, where pipemat-run starts the\n"
                 "ranks; 0: each rank its own, e.g. ranks on separate machines)")
      ->check(CLI::Range(-1, 1 << 20))
      ->capture_default_str();
}

void add_plan_command(CLI::App& app) {
  auto f = std::make_shared<PlanFlags>();
  auto* cmd = app.add_subcommand(
      "plan",
      "Chooses a remat policy per layer and rank under a memory budget. Profiles the config's\n"
      "layers (every candidate: none, full, and each set of SAVE regions from the layer's module\n"
      "tree) and each pipeline stage on this machine, then picks the candidates whose simulated\n"
      "step is shortest while every rank's predicted peak (weights, optimizer state, gradients,\n"
      "in-flight micro-batches, the replay) fits its budget; prints the same prediction for the\n"
      "uniform policies. The step model's message cost and shared speed come from a short\n"
      "calibration run of the config with remat none (pipemat-run; --calibration-steps 0:\n"
      "none). It also proposes the stage split by measured cost (the layers, the embedding, the\n"
      "head and the loss) and prints its predicted step beside the parameter split's; with\n"
      "partition.layers_per_stage auto the plan is made on that split. --out writes a config\n"
      "that `pipemat train` runs as is (schedule.recompute pretrigger, remat.stages with each\n"
      "stage's lists, the split). The profiles run on the config's training.device, so on `cuda`\n"
      "the budgets are GPU bytes (the CUDA caching allocator's).\n"
      "Examples:\n"
      "  pipemat plan --config configs/1f1b.yaml --memory-budget 24MiB\n"
      "  pipemat plan --config configs/llama.yaml --set model.vocab=8000 --set model.layers=8 \\\n"
      "      --set partition.layers_per_stage=auto --memory-budget 1GiB\n"
      "  pipemat plan --config configs/1f1b.yaml --memory-budget 32MiB,20MiB --out plan.yaml\n"
      "  pipemat-run -n 2 plan.yaml");
  cmd->add_option("--config", f->config, "YAML config (docs/config.md)")->required();
  cmd->add_option("--set", f->overrides, "Override a config key: --set schedule.ranks=4")
      ->take_all();
  cmd->add_option("--memory-budget", f->budget,
                  "Bytes per rank on its device (training.device): one size for every rank "
                  "(48MiB) or one per rank (64MiB,48MiB)")
      ->required();
  cmd->add_option("--out", f->out, "Write the planned config here (YAML)");
  cmd->add_flag("--json", f->json, "Print one JSON object instead of lines");
  add_plan_profile_flags(*cmd, f->plan);
  add_plan_calibration_flags(*cmd, f->calibration);
  cmd->callback([f] { run_plan_command(*f); });
}

}  // namespace pipemat::launch
