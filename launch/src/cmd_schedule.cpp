// `pipemat schedule`: flags -> ScheduleCommandOptions -> run_schedule_command. No logic here;
// values are checked by the library so that every bad value is a pipemat error (exit code 1).

#include <iostream>
#include <memory>

#include "commands.h"
#include "pipemat/schedule/command.h"

namespace pipemat::launch {
namespace {

struct ScheduleFlags {
  schedule::ScheduleCommandOptions options;
  std::string ranks = "0", micro_batches = "0", virtual_stages = "1";
};

}  // namespace

void add_schedule_command(CLI::App& app) {
  auto flags = std::make_shared<ScheduleFlags>();
  auto& o = flags->options;
  auto* cmd = app.add_subcommand(
      "schedule",
      "Generate, validate and simulate a pipeline schedule; print it as a text timeline, a torch "
      "CSV, JSON or an SVG picture");
  cmd->footer(
      "Examples:\n"
      "  pipemat schedule --kind 1f1b --ranks 4 --micro-batches 8\n"
      "  pipemat schedule --kind interleaved --ranks 4 --micro-batches 8 --virtual 2 --format "
      "json\n"
      "  pipemat schedule --kind zb-v --ranks 4 --micro-batches 8 --format svg --output zbv.svg\n"
      "  pipemat schedule --kind 1f1b --ranks 4 --micro-batches 8 --recompute pretrigger "
      "--costs F=1,B=2,R=1,comm=0.5\n"
      "  pipemat schedule --import torch_schedule.csv --format text\n"
      "bubble_ratio = 1 - sum(busy) / (ranks * makespan); peak_activations counts micro-batches\n"
      "whose F ran and whose last B/W did not. See docs/schedules.md.");
  cmd->add_option("--kind", o.kind,
                  "gpipe | 1f1b | interleaved (V chunks per rank) | zb-h1 | zb-h2 | zb-v (two "
                  "chunks per rank in a V). Required unless --import is given")
      ->type_name("KIND");
  cmd->add_option("--ranks,--stages", flags->ranks,
                  "Number of pipeline ranks P (with --virtual V there are P*V model stages)")
      ->type_name("P");
  cmd->add_option("--micro-batches", flags->micro_batches, "Micro-batches per step M")
      ->type_name("M");
  cmd->add_option("--virtual", flags->virtual_stages,
                  "Model chunks per rank V for interleaved (default 1); zb-v always uses 2")
      ->type_name("V");
  cmd->add_option("--recompute", o.recompute,
                  "none (keep activations, default) | lazy (replay inside B/I, after the gradient "
                  "arrives) | pretrigger (R action before B/I that overlaps the gradient receive)")
      ->type_name("MODE");
  cmd->add_option("--costs", o.costs,
                  "Cost model, any subset of F=1,I=1,W=1,B=2,R=1,comm=0. B defaults to I+W; R to 0 "
                  "without recompute and to F with it; comm is the latency of one message")
      ->type_name("K=V,...");
  cmd->add_option("--import", o.import_path,
                  "Read a torch.distributed.pipelining CSV (one row of actions per rank, "
                  "compute-only or with comms) instead of generating; it is validated")
      ->type_name("FILE.csv");
  cmd->add_option("--format", o.format, "text (default) | csv (torch CSV) | json | svg")
      ->type_name("FORMAT");
  cmd->add_option("--output", o.output, "Write to this file instead of stdout")->type_name("FILE");
  cmd->add_flag("--with-comms", o.with_comms,
                "Also list the lowered SEND_F/RECV_F/SEND_B/RECV_B actions (text, csv, json)");
  cmd->callback([flags] {
    auto options = flags->options;
    options.ranks = schedule::parse_int_flag("--ranks", flags->ranks);
    options.micro_batches = schedule::parse_int_flag("--micro-batches", flags->micro_batches);
    options.virtual_stages = schedule::parse_int_flag("--virtual", flags->virtual_stages);
    schedule::run_schedule_command(options, std::cout);
  });
}

}  // namespace pipemat::launch
