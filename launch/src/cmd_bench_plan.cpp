#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/bench/plan.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/train/config.h"

namespace pipemat::launch {
namespace {

std::string mib(double bytes) { return format_fixed(bytes / (1024.0 * 1024.0), 2); }

std::string error_of(double measured, double predicted) {
  if (predicted <= 0) return "-";
  const double e = (measured / predicted - 1) * 100;
  return (e >= 0 ? "+" : "") + format_fixed(e, 1) + "%";
}

// One row: `round` is the round's number, or "all" for the medians over rounds.
void print_run(const bench::BenchPlanRun& r, const std::string& round) {
  std::string budget = r.budget > 0 ? format_bytes(r.budget) : "-";
  const std::string error =
      (r.step_error >= 0 ? "+" : "") + format_fixed(r.step_error * 100, 1) + "%";
  std::printf("%-5s %-10s %10s %9.1f %9.1f %7s", round.c_str(), r.policy.c_str(), budget.c_str(),
              r.predicted_step_ms, r.step_ms, error.c_str());
  for (size_t k = 0; k < r.peak_bytes.size(); ++k) {
    const double want = k < r.predicted_peak_bytes.size() ? r.predicted_peak_bytes[k] : 0;
    std::printf("  r%zu %s/%s %s", k, mib(want).c_str(),
                mib(static_cast<double>(r.peak_bytes[k])).c_str(),
                error_of(static_cast<double>(r.peak_bytes[k]), want).c_str());
  }
  std::printf("  %s\n", r.losses_equal ? "yes" : "NO");
  std::fflush(stdout);
}

nlohmann::json run_json(const bench::BenchPlanRun& r) {
  return {{"policy", r.policy},
          {"budget_bytes", r.budget},
          {"predicted_step_ms", r.predicted_step_ms},
          {"step_ms", r.step_ms},
          {"round_predicted_step_ms", r.round_predicted_step_ms},
          {"round_step_ms", r.round_step_ms},
          {"step_error", r.step_error},
          {"predicted_peak_bytes", r.predicted_peak_bytes},
          {"peak_bytes", r.peak_bytes},
          {"losses_equal", r.losses_equal}};
}

std::string list_of(const std::vector<double>& values, int digits) {
  std::vector<std::string> parts;
  for (double v : values) parts.push_back(format_fixed(v, digits));
  return join(parts, ", ");
}

// The step model's calibration per round (Note [Plan calibration]).
std::string calibration_text(const bench::BenchPlanReport& r) {
  std::string out = "step model per round: messages " + list_of(r.message_ms, 2) +
                    " ms; shared speed " + list_of(r.shared_speed, 3);
  if (!r.calibration_step_ms.empty() && r.calibration_step_ms.front() > 0) {
    out += "; calibration runs of remat none " + list_of(r.calibration_step_ms, 1) +
           " ms a step, predicted at shared speed 1 " + list_of(r.calibration_predicted_ms, 1) +
           " ms";
  }
  return out;
}

struct BenchPlanFlags {
  bench::BenchPlanOptions bench;
  std::string budgets;
  std::string svg;
  bool json = false;
};

// The predictions' step model and the rounds (Note [Plan calibration]).
void add_bench_plan_calibration_flags(CLI::App& cmd, bench::BenchPlanOptions& o) {
  cmd.add_option("--message-ms", o.message_ms,
                 "Message cost of the predictions, ms (-1: measure it with the calibration run)")
      ->check(CLI::Range(-1.0, 1e6))
      ->capture_default_str();
  cmd.add_option("--shared-speed", o.shared_speed,
                 "A rank's speed while other ranks compute too (-1: measure it with the\n"
                 "calibration run)")
      ->check(CLI::Range(-1.0, 1.0))
      ->capture_default_str();
  cmd.add_option("--calibration-steps", o.calibration_steps,
                 "Steps of the calibration run (remat none, its own job; the first step is left\n"
                 "out)")
      ->check(CLI::Range(int64_t{2}, int64_t{1000}))
      ->capture_default_str();
  cmd.add_option(
         "--rounds", o.rounds,
         "Rounds of profile, calibration and runs (the machine's speed drifts): each run's\n"
         "step and prediction are the medians over rounds")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
}

nlohmann::json bench_plan_json(const bench::BenchPlanReport& report) {
  nlohmann::json out;
  out["summary"] = report.summary;
  out["message_ms"] = report.message_ms;
  out["shared_speed"] = report.shared_speed;
  out["calibration_step_ms"] = report.calibration_step_ms;
  out["calibration_predicted_ms"] = report.calibration_predicted_ms;
  out["fixed_bytes"] = report.fixed_bytes;
  out["reference_losses"] = report.reference_losses;
  for (const auto& u : report.uniform) out["uniform"].push_back(run_json(u));
  for (const auto& b : report.budgets) {
    nlohmann::json row = {{"budget_bytes", b.budget}};
    if (!b.infeasible.empty()) {
      row["infeasible"] = b.infeasible;
    } else {
      row["plan"] = run_json(b.plan);
      row["best_uniform"] = b.best_uniform;
      row["speedup"] = b.speedup;
      row["predicted_best_uniform"] = b.predicted_best_uniform;
      row["predicted_speedup"] = b.predicted_speedup;
    }
    out["budgets"].push_back(row);
  }
  return out;
}

// The tables after the runs: the medians over rounds (with more than one), then per budget the
// plan against the fastest uniform policy that fits.
void print_bench_plan_summary(const bench::BenchPlanReport& report, int rounds) {
  if (rounds > 1) {
    std::printf("medians over the %d rounds (error: the median of the rounds' errors):\n", rounds);
    for (const auto& u : report.uniform) print_run(u, "all");
    for (const auto& b : report.budgets)
      if (b.infeasible.empty()) print_run(b.plan, "all");
  }
  std::printf("\n%s\n%s\n%10s %9s  %-10s %9s %8s  %s\n", report.summary.c_str(),
              calibration_text(report).c_str(), "budget", "plan ms", "best fit", "its ms",
              "speedup", "predicted: best fit, speedup");
  for (const auto& b : report.budgets) {
    if (!b.infeasible.empty()) {
      std::printf("%10s  infeasible: %s\n", format_bytes(b.budget).c_str(), b.infeasible.c_str());
      continue;
    }
    double best_ms = 0;
    for (const auto& u : report.uniform)
      if (u.policy == b.best_uniform) best_ms = u.step_ms;
    std::printf(
        "%10s %9.1f  %-10s %9.1f %7.3fx  %s %.3fx\n", format_bytes(b.budget).c_str(),
        b.plan.step_ms, b.best_uniform.empty() ? "nothing fits" : b.best_uniform.c_str(), best_ms,
        b.speedup,
        b.predicted_best_uniform.empty() ? "nothing fits" : b.predicted_best_uniform.c_str(),
        b.predicted_speedup);
  }
}

void run_bench_plan_command(BenchPlanFlags& f) {
  f.bench.budgets = parse_byte_list(f.budgets, "--budgets", "sizes such as 24MiB,28MiB");
  print_config_warnings(train::load_config(f.bench.config, f.bench.overrides).warnings);
  if (!f.json) {
    std::printf("%-5s %-10s %10s %9s %9s %7s  %s  %s\n", "round", "run", "budget", "pred ms",
                "step ms", "error", "per rank: predicted/measured peak MiB, error", "losses equal");
  }
  const bench::BenchPlanReport report =
      bench::run_bench_plan(f.bench, [&](const bench::BenchPlanRun& r) {
        if (!f.json) print_run(r, std::to_string(r.round + 1));
      });
  if (!f.svg.empty()) {
    std::ofstream file(f.svg);
    file << bench::render_bench_plan_svg(report);
    PIPEMAT_CHECK(file.good(), ConfigError, "--svg: cannot write '", f.svg, "'");
  }
  if (f.json) {
    std::cout << bench_plan_json(report).dump() << std::endl;
    return;
  }
  print_bench_plan_summary(report, f.bench.rounds);
}

}  // namespace

void add_bench_plan_command(CLI::App& bench) {
  auto f = std::make_shared<BenchPlanFlags>();
  auto* cmd = bench.add_subcommand(
      "plan",
      "Does a plan keep its promises? Profiles the config once, then per budget plans it and\n"
      "runs the plan as a multi-process job (pipemat-run), and runs the uniform policies (none,\n"
      "full, selective) on the same schedule. Prints per run the predicted and measured step\n"
      "(median after warm-up) and per rank the predicted / measured peak in MiB (the bytes at the\n"
      "step's start plus its peak above them, max over all steps), and whether every loss equals\n"
      "the single-process reference bitwise; then per budget the fastest uniform policy that fits\n"
      "(measured) and the plan's speedup over it. Example:\n"
      "  pipemat bench plan --config configs/plan-transformer.yaml --budgets 26MiB,30MiB "
      "--svg plan.svg");
  cmd->add_option("--config", f->bench.config, "YAML config (docs/config.md)")->required();
  cmd->add_option("--set", f->bench.overrides, "Override a config key for every run")->take_all();
  cmd->add_option("--budgets", f->budgets,
                  "Memory budgets to plan for, each for every rank: 24MiB,28MiB,32MiB")
      ->required();
  cmd->add_option("--steps", f->bench.steps, "Steps per run, warm-up included")
      ->check(CLI::Range(int64_t{2}, int64_t{1000000}))
      ->capture_default_str();
  cmd->add_option("--warmup", f->bench.warmup, "Steps left out of the step-time medians")
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}))
      ->capture_default_str();
  cmd->add_option("--transport", f->bench.transport, "tcp or mpi")->capture_default_str();
  add_plan_profile_flags(*cmd, f->bench.plan);
  add_bench_plan_calibration_flags(*cmd, f->bench);
  cmd->add_option("--launcher", f->bench.launcher,
                  "pipemat-run to start the runs (default: next to this binary)");
  cmd->add_option("--log", f->bench.log, "Keep the output of the runs in this file");
  cmd->add_option("--svg", f->svg, "Also draw step time vs budget into this SVG file");
  cmd->add_flag("--json", f->json, "Print one JSON object instead of the tables");
  cmd->callback([f] { run_bench_plan_command(*f); });
}

}  // namespace pipemat::launch
