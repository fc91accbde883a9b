// `pipemat schedule`: flags -> ScheduleCommandOptions -> run_schedule_command. No logic here.

#include <iostream>

#include "commands.h"
#include "pipemat/schedule/command.h"

namespace pipemat::launch {

void add_schedule_command(CLI::App& app) {
  auto options = std::make_shared<schedule::ScheduleCommandOptions>();
  auto* cmd = app.add_subcommand(
      "schedule",
      "Generate, validate and simulate a pipeline schedule, and print it as a text timeline, a "
      "torch CSV, JSON or an SVG picture");
  cmd->footer(
      "Examples:\n"
      "  pipemat schedule --kind 1f1b --stages 4 --micro-batches 8\n"
      "  pipemat schedule --kind interleaved --stages 4 --micro-batches 8 --virtual 2 --format json\n"
      "  pipemat schedule --kind zb-v --stages 4 --micro-batches 8 --format svg --output zbv.svg\n"
      "  pipemat schedule --kind 1f1b --stages 4 --micro-batches 8 --recompute pretrigger "
      "--costs F=1,B=2,R=1,comm=0.5\n"
      "  pipemat schedule --import torch_schedule.csv --format text\n"
      "bubble_ratio = 1 - sum(busy) / (ranks * makespan). See docs/schedules.md.");
  cmd->add_option("--kind", options->kind,
                  "Schedule: gpipe, 1f1b, interleaved (V chunks per rank), zb-h1, zb-h2, zb-v "
                  "(two chunks per rank in a V). Required unless --import is given")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"}));
  cmd->add_option("--stages", options->stages,
                  "Number of pipeline ranks P (with --virtual V there are P*V model stages)");
  cmd->add_option("--micro-batches", options->micro_batches, "Micro-batches per step M");
  cmd->add_option("--virtual", options->virtual_stages,
                  "Model chunks (stages) per rank V for interleaved; zb-v always uses 2")
      ->default_val(1);
  cmd->add_option("--recompute", options->recompute,
                  "Recompute placement: none (keep activations), lazy (replay inside B/I), "
                  "pretrigger (R action before B/I, overlapping the gradient receive)")
      ->default_val("none")
      ->check(CLI::IsMember({"none", "lazy", "pretrigger"}));
  cmd->add_option("--costs", options->costs,
                  "Cost model, any subset of F=1,I=1,W=1,B=2,R=1,comm=0 (B defaults to I+W, R to "
                  "0 without recompute and to F with it; comm is the per-message latency)");
  cmd->add_option("--import", options->import_path,
                  "Read a torch.distributed.pipelining CSV schedule (one row of actions per rank, "
                  "compute-only or with comms) instead of generating one; it is validated");
  cmd->add_option("--format", options->format, "Output: text, csv (torch CSV), json or svg")
      ->default_val("text")
      ->check(CLI::IsMember({"text", "csv", "json", "svg"}));
  cmd->add_option("--output", options->output, "Write to this file instead of stdout");
  cmd->add_flag("--with-comms", options->with_comms,
                "List the lowered SEND_F/RECV_F/SEND_B/RECV_B actions too (text, csv, json)");
  cmd->callback([options] { schedule::run_schedule_command(*options, std::cout); });
}

}  // namespace pipemat::launch
