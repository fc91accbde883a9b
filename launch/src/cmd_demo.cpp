#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "commands.h"
#include "pipemat/bench/demo.h"

namespace pipemat::launch {
namespace {

void print_header(const bench::DemoOptions& o) {
  char line[256];
  std::snprintf(line, sizeof(line),
                "pipemat demo: %lld layers of RMSNorm -> GEMM %lldx%lld -> SiLU, %lld tokens\n"
                "remat policy: checkpoint layers.*, exclude layers.*.gemm (SAVE region)\n",
                static_cast<long long>(o.layers), static_cast<long long>(o.hidden),
                static_cast<long long>(o.hidden), static_cast<long long>(o.tokens));
  std::cout << line << std::flush;
}

// One line per step, flushed as the step ends.
void print_step(int64_t step, const bench::DemoStep& s) {
  char line[256];
  const remat::RematCounters& c = s.counters;
  std::snprintf(line, sizeof(line),
                "step %lld  loss %.6f  (no-checkpoint %.6f, %s)  %.1f ms  units %lld  "
                "replays %lld  save bodies %lld  skipped in replay %lld\n",
                static_cast<long long>(step + 1), s.loss, s.reference_loss,
                s.loss == s.reference_loss ? "equal" : "DIFFERENT", s.ms,
                static_cast<long long>(c.unit_calls), static_cast<long long>(c.replays),
                static_cast<long long>(c.save_calls), static_cast<long long>(c.save_skips));
  std::cout << line << std::flush;
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto opts = std::make_shared<bench::DemoOptions>();
  auto* cmd = app.add_subcommand(
      "demo",
      "Train a small model with a checkpoint unit per layer and the GEMM as a SAVE region, next\n"
      "to the same model without checkpointing; print per-step loss and remat counters.");
  cmd->add_option("--layers", opts->layers, "Number of RMSNorm -> GEMM -> SiLU layers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--tokens", opts->tokens, "Tokens per batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--hidden", opts->hidden, "Hidden size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--steps", opts->steps, "Training steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--lr", opts->lr, "SGD learning rate")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "Seed of weights and data")->capture_default_str();
  cmd->callback([opts] {
    print_header(*opts);
    const bench::DemoReport report = bench::run_demo(*opts, print_step);
    std::cout << (report.all_equal ? "pipemat demo: losses and every parameter equal the "
                                     "no-checkpoint run bitwise\n"
                                   : "pipemat demo: MISMATCH against the no-checkpoint run\n");
    if (!report.all_equal) std::exit(1);
  });
}

}  // namespace pipemat::launch
