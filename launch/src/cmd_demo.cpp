#include <cstdlib>
#include <iostream>

#include "commands.h"
#include "pipemat/models/demo.h"

namespace pipemat::launch {

void add_demo_command(CLI::App& app) {
  auto opts = std::make_shared<models::DemoOptions>();
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
    const int rc = models::run_demo(*opts, std::cout);
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace pipemat::launch
