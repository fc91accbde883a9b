#include "pipemat/models/bench_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "bench_run.h"
#include "pipemat/core/error.h"
#include "pipemat/models/config.h"
#include "pipemat/models/plan.h"
#include "pipemat/models/train.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/memory.h"

namespace pipemat::models {
namespace {

constexpr const char* kWho = "bench plan";

struct Runner {
  const BenchPlanOptions& options;
  const std::vector<double>& reference_losses;
  bench::LaunchedRun launch;

  // Writes `config` to a temporary YAML file and runs it as a job; fills the measured fields.
  void run(const TrainConfig& config, BenchPlanRun& out) {
    const bench::TempFile yaml("pipemat-bench-plan-XXXXXX.yaml", kWho);
    {
      std::ofstream file(yaml.path());
      file << config_to_yaml(config);
      PIPEMAT_CHECK(file.good(), ConfigError, kWho, ": cannot write ", yaml.path());
    }
    bench::LaunchedRun job = launch;
    job.config = yaml.path();
    const std::string what =
        std::string(kWho) + ": the " + out.policy +
        (out.budget > 0 ? " run for " + std::to_string(out.budget) + " bytes" : " run");
    const std::vector<pp::StepMetrics> steps = bench::run_launched(job, options.steps, what);
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
    out.step_ms = bench::median(step_ms);
  }
};

// Note [Measured message delay] of a short run of `config`: the median over its steps after the
// first.
double calibrate_message_ms(const Runner& runner, TrainConfig config, int64_t steps) {
  config.training.steps = steps;
  const bench::TempFile yaml("pipemat-bench-plan-XXXXXX.yaml", kWho);
  {
    std::ofstream file(yaml.path());
    file << config_to_yaml(config);
    PIPEMAT_CHECK(file.good(), ConfigError, kWho, ": cannot write ", yaml.path());
  }
  bench::LaunchedRun job = runner.launch;
  job.config = yaml.path();
  const std::vector<pp::StepMetrics> got =
      bench::run_launched(job, steps, std::string(kWho) + ": the calibration run");
  std::vector<double> delays;
  for (const pp::StepMetrics& m : got)
    if (m.step >= 1) delays.push_back(m.message_delay_ms);
  return bench::median(delays);
}

bool fits(const std::vector<int64_t>& peaks, int64_t budget) {
  return std::all_of(peaks.begin(), peaks.end(), [&](int64_t p) { return p <= budget; });
}

}  // namespace

BenchPlanReport run_bench_plan(const BenchPlanOptions& o,
                               const std::function<void(const BenchPlanRun&)>& on_run) {
  PIPEMAT_CHECK(o.warmup >= 0 && o.steps > o.warmup, ConfigError, kWho, ": --steps ", o.steps,
                " must be more than --warmup ", o.warmup);
  PIPEMAT_CHECK(o.calibration_steps >= 2, ConfigError, kWho, ": --calibration-steps ",
                o.calibration_steps, " must be at least 2 (the first step is left out)");
  PIPEMAT_CHECK(!o.budgets.empty(), ConfigError, kWho,
                ": give at least one memory budget, e.g. --budgets 24MiB,28MiB");
  PIPEMAT_CHECK(o.transport == "tcp" || o.transport == "mpi", ConfigError, kWho, ": --transport '",
                o.transport,
                "': expected tcp or mpi (each rank its own process, so each rank's peak is its "
                "own)");
  std::vector<std::string> sets = o.overrides;
  sets.push_back("training.steps=" + std::to_string(o.steps));
  const TrainConfig config = load_config(o.config, sets);
  const int ranks = static_cast<int>(config.schedule.ranks);
  PIPEMAT_CHECK(ranks >= 2, ConfigError, kWho, ": schedule.ranks is ", ranks,
                "; a plan is per pipeline rank, give 2 or more");

  BenchPlanReport report;
  const int threads = config.training.threads > 0 ? static_cast<int>(config.training.threads)
                                                  : pp::default_compute_threads(ranks);
  remat::install_tracking_allocator();
  pp::set_compute_threads(threads);  // the ranks' kernels and reduction orders
  for (const pp::StepMetrics& m : run_reference(config, nullptr))
    report.reference_losses.push_back(m.loss);

  PlanOptions plan_options = o.plan;
  plan_options.budget_bytes.clear();
  PlanReport profiled = profile_plan(config, plan_options);
  report.summary = profiled.summary;
  report.fixed_bytes = profiled.problem.fixed_bytes;

  const std::string log_pattern = "pipemat-bench-plan-XXXXXX.log";
  const bench::TempFile temp_log(log_pattern, kWho, /*keep=*/true);  // named by errors
  Runner runner{o, report.reference_losses, {}};
  runner.launch.launcher = o.launcher.empty() ? bench::default_launcher(kWho) : o.launcher;
  runner.launch.ranks = ranks;
  runner.launch.transport = o.transport;
  runner.launch.log = o.log.empty() ? temp_log.path() : o.log;

  report.message_ms = o.message_ms;
  if (o.message_ms < 0) {
    report.message_ms = calibrate_message_ms(
        runner, uniform_config(profiled, RematPolicyKind::kNone), o.calibration_steps);
    report.message_calibrated = true;
  }
  profiled.problem.message_cost = report.message_ms;

  // The uniform predictions do not depend on the budget; solve_plan sets them before it solves.
  PlanReport uniform_report = profiled;
  try {
    solve_plan(uniform_report, {o.budgets.front()});
  } catch (const ConfigError&) {
  }
  for (const UniformPrediction& u : uniform_report.uniform) {
    BenchPlanRun run;
    run.policy = u.policy;
    run.predicted_step_ms = u.prediction.step;
    for (const auto& r : u.prediction.ranks) run.predicted_peak_bytes.push_back(r.peak_bytes);
    runner.run(uniform_config(profiled, *parse_remat_policy(u.policy)), run);
    if (on_run) on_run(run);
    report.uniform.push_back(run);
  }

  for (int64_t budget : o.budgets) {
    BenchPlanBudget row;
    row.budget = budget;
    PlanReport planned = profiled;
    try {
      solve_plan(planned, {budget});
    } catch (const ConfigError& e) {
      row.infeasible = e.what();
      report.budgets.push_back(row);
      continue;
    }
    row.plan.policy = "plan";
    row.plan.budget = budget;
    row.plan.predicted_step_ms = planned.result.best.step;
    for (const auto& r : planned.result.best.ranks)
      row.plan.predicted_peak_bytes.push_back(r.peak_bytes);
    runner.run(planned.config, row.plan);
    if (on_run) on_run(row.plan);
    double best = 0, predicted_best = 0;
    for (size_t u = 0; u < report.uniform.size(); ++u) {
      const BenchPlanRun& run = report.uniform[u];
      if (fits(run.peak_bytes, budget) && (best == 0 || run.step_ms < best)) {
        best = run.step_ms;
        row.best_uniform = run.policy;
      }
      const plan::Prediction& p = planned.uniform[u].prediction;
      if (p.fits() && (predicted_best == 0 || p.step < predicted_best)) {
        predicted_best = p.step;
        row.predicted_best_uniform = run.policy;
      }
    }
    if (best > 0 && row.plan.step_ms > 0) row.speedup = best / row.plan.step_ms;
    if (predicted_best > 0) row.predicted_speedup = predicted_best / row.plan.predicted_step_ms;
    report.budgets.push_back(row);
  }
  std::remove(temp_log.path().c_str());
  return report;
}

}  // namespace pipemat::models
