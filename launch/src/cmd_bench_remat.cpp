#include <iostream>
#include <memory>

#include "commands.h"
#include "pipemat/models/bench_remat.h"

namespace pipemat::launch {

void add_bench_remat_command(CLI::App& bench) {
  auto o = std::make_shared<models::BenchRematOptions>();
  auto* cmd = bench.add_subcommand(
      "remat",
      "Memory and time of remat modes: none, full (checkpoint every layer), legacy (GEMM as a\n"
      "SAVE region, input kept), rederive (the default: the GEMM input is rederived by replay).\n"
      "Bytes are exact (tracking CPU allocator); times are medians over steps x repetitions.");
  cmd->add_option("--scenario", o->scenario,
                  "rmsnorm-gemm | moe | save-chain | gpt (the main job's decoder blocks, 4 heads, "
                  "sequences of 128)")
      ->capture_default_str();
  cmd->add_option("--layers", o->layers, "Layers (checkpoint units)")->capture_default_str();
  cmd->add_option("--tokens", o->tokens, "Tokens per step")->capture_default_str();
  cmd->add_option("--hidden", o->hidden, "Hidden size")->capture_default_str();
  cmd->add_option("--experts", o->experts, "Experts (moe)")->capture_default_str();
  cmd->add_option("--top-k", o->top_k, "Experts per token (moe)")->capture_default_str();
  cmd->add_option("--steps", o->steps, "Steps per mode and repetition")->capture_default_str();
  cmd->add_option("--repeat", o->repeat, "Repetitions (modes interleave)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of weights and data")->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object instead of a table");
  cmd->callback([o] { models::run_bench_remat(*o, std::cout); });
}

}  // namespace pipemat::launch
