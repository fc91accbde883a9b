#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/bench/pipeline.h"
#include "pipemat/core/format.h"
#include "pipemat/train/config.h"

namespace pipemat::launch {

namespace {

struct BenchPipelineFlags {
  bench::BenchPipelineOptions bench;
  bool json = false;
};

// With `data` above 1 also the all-reduce columns.
void print_pipeline_header(int64_t data) {
  std::printf("%-6s %-9s %3s %9s %8s %7s %7s %8s %9s %9s %9s %11s  %-12s", "sched", "transport",
              "thr", "step ms", "speedup", "bubble", "sched.b", "sim", "sim+comm", "delay ms",
              "wait ms", "peak", "losses equal");
  if (data > 1) {
    std::printf(" %9s %6s  %-8s %-7s %11s %9s", "allred ms", "hidden", "W tail", "sharded",
                "opt state", "gather ms");
  }
  std::printf("\n");
}

void print_pipeline_row(const bench::BenchPipelineRow& r, int64_t data) {
  std::printf("%-6s %-9s %3d %9.1f %7.2fx %7.3f %7.3f %8.3f %9.3f %9.2f %9.1f %11s  %-12s",
              r.schedule.c_str(), r.transport.c_str(), r.threads, r.step_ms, r.speedup, r.bubble,
              r.schedule_bubble, r.simulated_bubble, r.simulated_bubble_comm, r.message_delay_ms,
              r.recv_wait_ms, format_bytes(r.peak_bytes).c_str(),
              !r.losses_compared ? "-"
              : r.losses_equal   ? "yes"
                                 : "NO");
  if (data > 1 && r.transport != "reference") {
    std::printf(" %9.2f %6.2f  %-8s %-7s %11s %9.2f", r.allreduce_ms, r.allreduce_hidden,
                r.weight_tail ? "buckets" : "in order", r.shard_optimizer ? "yes" : "no",
                format_bytes(r.optimizer_state_bytes).c_str(), r.gather_ms);
  }
  std::printf("\n");
  std::fflush(stdout);
}

nlohmann::json pipeline_row_json(const bench::BenchPipelineRow& r) {
  return {{"schedule", r.schedule},
          {"transport", r.transport},
          {"threads", r.threads},
          {"step_ms", r.step_ms},
          {"speedup", r.speedup},
          {"bubble", r.bubble},
          {"schedule_bubble", r.schedule_bubble},
          {"simulated_bubble", r.simulated_bubble},
          {"simulated_bubble_comm", r.simulated_bubble_comm},
          {"message_delay_ms", r.message_delay_ms},
          {"recv_wait_ms", r.recv_wait_ms},
          {"weight_tail", r.weight_tail},
          {"shard_optimizer", r.shard_optimizer},
          {"optimizer_state_bytes", r.optimizer_state_bytes},
          {"gather_ms", r.gather_ms},
          {"allreduce_ms", r.allreduce_ms},
          {"allreduce_hidden", r.allreduce_hidden},
          {"peak_bytes", r.peak_bytes},
          {"resident_peak_bytes", r.resident_peak_bytes},
          {"loss", r.loss},
          {"layer_costs", r.layer_costs},
          {"losses_equal",
           r.losses_compared ? nlohmann::json(r.losses_equal) : nlohmann::json(nullptr)}};
}

void run_bench_pipeline_command(const BenchPipelineFlags& f) {
  // run_bench_pipeline reads the config once per variant; its warnings are said once here.
  const train::TrainConfig config = train::load_config(f.bench.config, f.bench.overrides);
  const int64_t data = config.parallel.data;
  print_config_warnings(config.warnings);
  if (!f.json) print_pipeline_header(data);
  const auto rows = bench::run_bench_pipeline(f.bench, [&](const bench::BenchPipelineRow& r) {
    if (!f.json) print_pipeline_row(r, data);
  });
  if (f.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) out.push_back(pipeline_row_json(r));
    std::cout << out.dump(2) << "\n";
    return;
  }
  std::printf("\nper-layer costs (ms; comm = the message delay), for `pipemat project --costs`:\n");
  for (const auto& r : rows) {
    if (!r.layer_costs.empty())
      std::printf("%-6s %-9s %s\n", r.schedule.c_str(), r.transport.c_str(), r.layer_costs.c_str());
  }
}

}  // namespace

void add_bench_pipeline_command(CLI::App& bench) {
  auto f = std::make_shared<BenchPipelineFlags>();
  auto* cmd = bench.add_subcommand(
      "pipeline",
      "Does the pipeline pay off? Runs the single-process reference (1 thread, and the default\n"
      "threads) and each schedule x transport of the config (mpi and tcp through pipemat-run,\n"
      "local as threads here), and prints per variant the median step after warm-up, the speedup\n"
      "over the faster reference, the measured bubble, the simulated bubble without and with the\n"
      "measured message delay, the time blocked in receives, the peak bytes, and whether every\n"
      "loss equals the reference bitwise. With parallel.data above 1 also the gradient\n"
      "all-reduce (ms from its first post to its last sum, and the share hidden behind the\n"
      "rank's actions) per --weight-tail, and the optimizer state of the largest rank and the\n"
      "gather of the updated parameters per --shard-optimizer. Examples:\n"
      "  pipemat bench pipeline --config configs/bench.yaml --schedules 1f1b,zb-v\n"
      "  pipemat bench pipeline --config configs/bench.yaml --set parallel.data=2 \\\n"
      "      --schedules zb-h1 --transports mpi --weight-tail true,false\n"
      "  pipemat bench pipeline --config configs/dp-pp.yaml --schedules zb-v \\\n"
      "      --transports mpi --shard-optimizer false,true");
  cmd->add_option("--config", f->bench.config, "YAML config (docs/config.md)")->required();
  cmd->add_option("--set", f->bench.overrides, "Override a config key for every variant")
      ->take_all();
  cmd->add_option("--schedules", f->bench.schedules, "Schedule kinds")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--transports", f->bench.transports, "mpi, tcp, local")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--weight-tail", f->bench.weight_tails,
                  "With parallel.data above 1: parallel.weight_tail of each variant (true, false)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--shard-optimizer", f->bench.shard_optimizers,
                  "With parallel.data above 1: parallel.shard_optimizer of each variant (false, "
                  "true)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--steps", f->bench.steps, "Steps per variant, warm-up included")
      ->check(CLI::Range(int64_t{2}, int64_t{1000000}))
      ->capture_default_str();
  cmd->add_option("--warmup", f->bench.warmup, "Steps left out of the medians")
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}))
      ->capture_default_str();
  cmd->add_option("--launcher", f->bench.launcher,
                  "pipemat-run to start mpi and tcp runs (default: next to this binary)");
  cmd->add_option("--log", f->bench.log, "Keep the output of the mpi and tcp runs in this file");
  cmd->add_flag("--json", f->json, "Print one JSON object instead of the table");
  cmd->callback([f] { run_bench_pipeline_command(*f); });
}

}  // namespace pipemat::launch
