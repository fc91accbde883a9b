#include "pipemat/bench/plan.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "pipemat/core/error.h"
#include "pipemat/core/stats.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/memory.h"
#include "pipemat/train/config.h"
#include "pipemat/train/launched_run.h"
#include "pipemat/train/plan.h"
#include "pipemat/train/train.h"

namespace pipemat::bench {
namespace {

constexpr const char* kWho = "bench plan";

struct Runner {
  const BenchPlanOptions& options;
  const std::vector<double>& reference_losses;
  train::LaunchedRun launch;

  // Writes `config` to a temporary YAML file and runs it as a job; fills the measured fields.
  void run(const train::TrainConfig& config, BenchPlanRun& out) {
    const train::TempFile yaml("pipemat-bench-plan-XXXXXX.yaml", kWho);
    train::write_config_file(config, yaml.path(), kWho);
    train::LaunchedRun job = launch;
    job.config = yaml.path();
    // concat, not std::string operator+: GCC 12 reports a false -Warray-bounds for a chain of
    // operator+ on std::string in C++20.
    const std::string what = out.budget > 0
                                 ? ::pipemat::detail::concat(kWho, ": the ", out.policy,
                                                             " run for ", out.budget, " bytes")
                                 : ::pipemat::detail::concat(kWho, ": the ", out.policy, " run");
    const std::vector<pp::StepMetrics> steps = train::run_launched(job, options.steps, what);
    std::vector<double> step_ms;
    out.peak_bytes.assign(static_cast<size_t>(launch.ranks), 0);
    for (const pp::StepMetrics& m : steps) {
      const auto i = static_cast<size_t>(m.step);
      if (i >= reference_losses.size() || reference_losses[i] != m.loss) out.losses_equal = false;
      PIPEMAT_CHECK(m.rank_peak_bytes.size() == out.peak_bytes.size() &&
                        m.rank_start_bytes.size() == out.peak_bytes.size(),
                    PipelineError, what, ": step ", m.step, " reports ", m.rank_peak_bytes.size(),
                    " ranks' peaks for ", launch.ranks, " ranks");
      for (size_t r = 0; r < out.peak_bytes.size(); ++r) {
        out.peak_bytes[r] =
            std::max(out.peak_bytes[r], m.rank_start_bytes[r] + m.rank_peak_bytes[r]);
      }
      if (m.step >= options.warmup) step_ms.push_back(m.step_ms);
    }
    out.step_ms = median(step_ms);
  }
};

bool fits(const std::vector<int64_t>& peaks, int64_t budget) {
  return std::all_of(peaks.begin(), peaks.end(), [&](int64_t p) { return p <= budget; });
}

void check_plan_options(const BenchPlanOptions& o) {
  PIPEMAT_CHECK(o.warmup >= 0 && o.steps > o.warmup, ConfigError, kWho, ": --steps ", o.steps,
                " must be more than --warmup ", o.warmup);
  PIPEMAT_CHECK(o.shared_speed < 0 || (o.shared_speed > 0 && o.shared_speed <= 1), ConfigError,
                kWho, ": --shared-speed ", o.shared_speed,
                " must be in (0, 1], or below 0 to measure it");
  PIPEMAT_CHECK(o.rounds >= 1, ConfigError, kWho, ": --rounds ", o.rounds, " must be at least 1");
  PIPEMAT_CHECK(o.calibration_steps >= 2, ConfigError, kWho, ": --calibration-steps ",
                o.calibration_steps, " must be at least 2 (the first step is left out)");
  PIPEMAT_CHECK(!o.budgets.empty(), ConfigError, kWho,
                ": give at least one memory budget, e.g. --budgets 24MiB,28MiB");
  PIPEMAT_CHECK(o.transport == "tcp" || o.transport == "mpi", ConfigError, kWho, ": --transport '",
                o.transport,
                "': expected tcp or mpi (each rank its own process, so each rank's peak is its "
                "own)");
}

// The single-process reference's losses, computed with the ranks' threads (their kernels and
// reduction orders) under the tracking allocator the runs use too.
std::vector<double> reference_run_losses(const train::TrainConfig& config, int ranks) {
  const int threads = config.training.threads > 0 ? static_cast<int>(config.training.threads)
                                                  : pp::default_compute_threads(ranks);
  remat::install_tracking_allocator();
  pp::set_compute_threads(threads);  // the ranks' kernels and reduction orders
  std::vector<double> losses;
  for (const pp::StepMetrics& m : train::run_reference(config, nullptr)) losses.push_back(m.loss);
  return losses;
}

// Note [Plan calibration]: the message cost and shared speed of this round's predictions.
void calibrate_round(train::PlanReport& profiled, const BenchPlanOptions& o,
                     const train::LaunchedRun& launch, BenchPlanReport& report) {
  train::CalibrationOptions calibration;
  calibration.steps = o.calibration_steps;
  calibration.launcher = launch.launcher;
  calibration.transport = o.transport;
  calibration.log = launch.log;
  calibration.message_ms = o.message_ms;
  calibration.shared_speed = o.shared_speed;
  const train::Calibration calibrated = train::calibrate_plan(profiled, calibration, kWho);
  report.message_ms.push_back(calibrated.message_ms);
  report.shared_speed.push_back(calibrated.shared_speed);
  report.calibration_step_ms.push_back(calibrated.step_ms);
  report.calibration_predicted_ms.push_back(calibrated.predicted_ms);
}

// Adds round `round`'s run `one` to `total`, the report's row: the medians over the rounds so
// far, the first round's predicted peaks, the largest measured peaks.
void add_round(const BenchPlanRun& one, int round, BenchPlanRun& total) {
  total.round = -1;
  total.round_predicted_step_ms.push_back(one.predicted_step_ms);
  total.round_step_ms.push_back(one.step_ms);
  total.predicted_step_ms = median(total.round_predicted_step_ms);
  total.step_ms = median(total.round_step_ms);
  std::vector<double> errors;
  for (size_t k = 0; k < total.round_step_ms.size(); ++k)
    errors.push_back(total.round_step_ms[k] / total.round_predicted_step_ms[k] - 1);
  total.step_error = median(errors);
  if (round == 0) total.predicted_peak_bytes = one.predicted_peak_bytes;
  total.peak_bytes.resize(one.peak_bytes.size(), 0);
  for (size_t r = 0; r < one.peak_bytes.size(); ++r)
    total.peak_bytes[r] = std::max(total.peak_bytes[r], one.peak_bytes[r]);
  total.losses_equal = total.losses_equal && one.losses_equal;
}

// One run of `config` predicted by `choice` in round `round`, added to `total` (the report's
// row).
void run_predicted(Runner& runner, const plan::PlanProblem& problem, int round,
                   const train::TrainConfig& config, const std::vector<int>& choice,
                   BenchPlanRun& total, const std::function<void(const BenchPlanRun&)>& on_run) {
  const plan::Prediction p = plan::evaluate(problem, choice);
  BenchPlanRun one;
  one.policy = total.policy;
  one.budget = total.budget;
  one.round = round;
  one.predicted_step_ms = p.step;
  for (const auto& r : p.ranks) one.predicted_peak_bytes.push_back(r.peak_bytes);
  runner.run(config, one);
  one.step_error = one.step_ms / one.predicted_step_ms - 1;
  if (on_run) on_run(one);
  add_round(one, round, total);
}

// The plans of the budgets, solved in the first round and run in every round.
struct BudgetPlans {
  std::vector<std::vector<int>> choices;
  std::vector<train::TrainConfig> configs;
};

// First round: solves the plan for `budget` into entry `b` of `plans`; when none fits, the row
// keeps the planner's error (and nothing of it runs).
void solve_budget(const train::PlanReport& profiled, int64_t budget, size_t b, BudgetPlans& plans,
                  BenchPlanBudget& row) {
  row.budget = budget;
  train::PlanReport planned = profiled;
  try {
    train::solve_plan(planned, {budget});
  } catch (const ConfigError& e) {
    row.infeasible = e.what();
  }
  plans.choices[b] = planned.result.best.choice;
  plans.configs[b] = planned.config;
  row.plan.policy = "plan";
  row.plan.budget = budget;
}

// The plan's speedup over a uniform policy: the median over rounds of the paired ratios.
double paired_speedup(const std::vector<double>& uniform, const std::vector<double>& plan) {
  std::vector<double> ratios;
  for (size_t k = 0; k < uniform.size() && k < plan.size(); ++k)
    if (plan[k] > 0) ratios.push_back(uniform[k] / plan[k]);
  return median(ratios);
}

// Per budget: the fastest uniform policy that fits, measured and predicted, and the plan's
// speedup over it.
void compare_with_uniform(BenchPlanReport& report) {
  for (BenchPlanBudget& row : report.budgets) {
    if (!row.infeasible.empty()) continue;
    const BenchPlanRun *best = nullptr, *predicted_best = nullptr;
    for (const BenchPlanRun& u : report.uniform) {
      if (fits(u.peak_bytes, row.budget) && (best == nullptr || u.step_ms < best->step_ms))
        best = &u;
      const bool predicted_fit =
          std::all_of(u.predicted_peak_bytes.begin(), u.predicted_peak_bytes.end(),
                      [&](double p) { return p <= static_cast<double>(row.budget); });
      if (predicted_fit &&
          (predicted_best == nullptr || u.predicted_step_ms < predicted_best->predicted_step_ms))
        predicted_best = &u;
    }
    if (best != nullptr) {
      row.best_uniform = best->policy;
      row.speedup = paired_speedup(best->round_step_ms, row.plan.round_step_ms);
    }
    if (predicted_best != nullptr) {
      row.predicted_best_uniform = predicted_best->policy;
      row.predicted_speedup =
          paired_speedup(predicted_best->round_predicted_step_ms, row.plan.round_predicted_step_ms);
    }
  }
}

}  // namespace

BenchPlanReport run_bench_plan(const BenchPlanOptions& o,
                               const std::function<void(const BenchPlanRun&)>& on_run) {
  check_plan_options(o);
  std::vector<std::string> sets = o.overrides;
  sets.push_back("training.steps=" + std::to_string(o.steps));
  const train::TrainConfig config = train::load_config(o.config, sets);
  const int ranks = static_cast<int>(config.schedule.ranks);
  PIPEMAT_CHECK(ranks >= 2, ConfigError, kWho, ": schedule.ranks is ", ranks,
                "; a plan is per pipeline rank, give 2 or more");

  BenchPlanReport report;
  report.reference_losses = reference_run_losses(config, ranks);

  train::PlanOptions plan_options = o.plan;
  plan_options.budget_bytes.clear();

  const std::string log_pattern = "pipemat-bench-plan-XXXXXX.log";
  const train::TempFile temp_log(log_pattern, kWho, /*keep=*/true);  // named by errors
  Runner runner{o, report.reference_losses, {}};
  runner.launch.launcher = o.launcher.empty() ? train::default_launcher(kWho) : o.launcher;
  runner.launch.ranks = ranks;
  runner.launch.transport = o.transport;
  runner.launch.log = o.log.empty() ? temp_log.path() : o.log;

  std::vector<models::RematPolicyKind> policies;
  BudgetPlans plans{std::vector<std::vector<int>>(o.budgets.size()),
                    std::vector<train::TrainConfig>(o.budgets.size())};
  for (int round = 0; round < o.rounds; ++round) {
    train::PlanReport profiled = train::profile_plan(config, plan_options);
    plan::PlanProblem& problem = profiled.problem;
    problem.budget_bytes.assign(problem.fixed_bytes.size(), 1e300);  // evaluated, not solved
    if (round == 0) {
      report.summary = profiled.summary;
      report.fixed_bytes = problem.fixed_bytes;
      policies = train::uniform_policies(profiled);
      report.uniform.resize(policies.size());
      report.budgets.resize(o.budgets.size());
    }
    calibrate_round(profiled, o, runner.launch, report);
    for (size_t u = 0; u < policies.size(); ++u) {
      report.uniform[u].policy = to_string(policies[u]);
      run_predicted(runner, problem, round, train::uniform_config(profiled, policies[u]),
                    train::uniform_choice(profiled, policies[u]), report.uniform[u], on_run);
    }
    for (size_t b = 0; b < o.budgets.size(); ++b) {
      BenchPlanBudget& row = report.budgets[b];
      if (round == 0) solve_budget(profiled, o.budgets[b], b, plans, row);
      if (!row.infeasible.empty()) continue;
      run_predicted(runner, problem, round, plans.configs[b], plans.choices[b], row.plan, on_run);
    }
  }
  compare_with_uniform(report);
  std::remove(temp_log.path().c_str());
  return report;
}

}  // namespace pipemat::bench
