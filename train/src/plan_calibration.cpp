// Note [Plan calibration] (train/plan.h): the two numbers of the step model that belong to the
// machine and the transport, measured on a short run of the job itself.

#include <cstdio>
#include <optional>

#include "pipemat/core/error.h"
#include "pipemat/core/stats.h"
#include "pipemat/train/launched_run.h"
#include "pipemat/train/plan.h"

namespace pipemat::train {
namespace {

// The shared speed in [0.2, 1] at which `problem` predicts `step_ms` for `choice`: 1 when the
// prediction at full speed is no faster than the run, 0.2 when even that is faster.
double fit_shared_speed(plan::PlanProblem problem, const std::vector<int>& choice, double step_ms) {
  const auto predicted = [&](double s) {
    problem.shared_speed = s;
    return plan::evaluate(problem, choice).step;
  };
  double lo = 0.2, hi = 1.0;
  if (predicted(hi) >= step_ms) return hi;
  if (predicted(lo) <= step_ms) return lo;
  for (int i = 0; i < 40; ++i) {
    const double mid = (lo + hi) / 2;
    (predicted(mid) > step_ms ? lo : hi) = mid;  // the prediction falls as the speed grows
  }
  return (lo + hi) / 2;
}

}  // namespace

Calibration calibrate_plan(PlanReport& report, const CalibrationOptions& o,
                           const std::string& who) {
  PIPEMAT_CHECK(o.message_ms < 0 || o.message_ms <= 1e6, ConfigError, who, ": a message cost of ",
                o.message_ms, " ms is out of range");
  PIPEMAT_CHECK(o.shared_speed < 0 || (o.shared_speed > 0 && o.shared_speed <= 1), ConfigError, who,
                ": a shared speed of ", o.shared_speed,
                " is out of range; give one in (0, 1], or measure it");
  Calibration c;
  c.message_ms = o.message_ms;
  c.shared_speed = o.shared_speed;
  plan::PlanProblem& problem = report.problem;
  if (o.message_ms < 0 || o.shared_speed < 0) {
    PIPEMAT_CHECK(o.steps >= 2, ConfigError, who, ": a calibration run of ", o.steps,
                  " steps measures nothing (its first step is left out); give at least 2");
    PIPEMAT_CHECK(o.transport == "mpi" || o.transport == "tcp", ConfigError, who, ": transport '",
                  o.transport, "' for the calibration run; expected mpi or tcp");
    TrainConfig config = uniform_config(report, models::RematPolicyKind::kNone);
    config.training.steps = o.steps;
    const TempFile yaml("pipemat-plan-calibration-XXXXXX.yaml", who);
    write_config_file(config, yaml.path(), who);
    std::optional<TempFile> temp_log;  // kept when the run fails: the error names it
    if (o.log.empty()) temp_log.emplace("pipemat-plan-calibration-XXXXXX.log", who, true);
    LaunchedRun job;
    job.launcher = o.launcher.empty() ? default_launcher(who) : o.launcher;
    // With parallel.data, the whole job: its step has the replicas' gradient all-reduce and
    // their share of the cores in it, which the fitted speed then carries.
    job.ranks = static_cast<int>(config.schedule.ranks * config.parallel.data);
    job.transport = o.transport;
    job.config = yaml.path();
    job.overrides = measured_run_overrides();
    job.log = temp_log ? temp_log->path() : o.log;
    const std::vector<pp::StepMetrics> got =
        run_launched(job, o.steps, who + ": the calibration run (remat none)");
    if (temp_log) std::remove(temp_log->path().c_str());
    std::vector<double> delays, step_ms;
    for (const pp::StepMetrics& m : got) {
      if (m.step < 1) continue;
      delays.push_back(m.message_delay_ms);
      step_ms.push_back(m.step_ms);
    }
    if (c.message_ms < 0) c.message_ms = median(delays);
    c.steps = o.steps;
    c.step_ms = median(step_ms);
    problem.message_cost = c.message_ms;
    problem.shared_speed = 1;
    const std::vector<int> none = uniform_choice(report, models::RematPolicyKind::kNone);
    c.predicted_ms = plan::evaluate(problem, none).step;
    if (c.shared_speed < 0) c.shared_speed = fit_shared_speed(problem, none, c.step_ms);
  }
  problem.message_cost = c.message_ms;
  problem.shared_speed = c.shared_speed;
  return c;
}

}  // namespace pipemat::train
