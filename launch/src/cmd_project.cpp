// `pipemat project`: flags -> ProjectCommandOptions -> render_project_command. No logic here.

#include <fstream>
#include <iostream>
#include <memory>

#include "commands.h"
#include "pipemat/core/error.h"
#include "pipemat/schedule/project.h"

namespace pipemat::launch {

void add_project_command(CLI::App& app) {
  struct Flags {
    schedule::ProjectCommandOptions options;
    std::string output;
  };
  auto f = std::make_shared<Flags>();
  auto& o = f->options;
  auto* cmd = app.add_subcommand(
      "project",
      "Project a pipeline onto more ranks than this machine has: the simulator's step time, "
      "bubble and speedup over one process for each schedule, stage count and micro-batch "
      "count, from per-layer costs and a per-message cost (latency + bytes / bandwidth)");
  cmd->footer(
      "The model is --layers equal layers, split evenly over the stages. --costs takes the\n"
      "per-layer F, I, W (B = I + W unless given) and R, and the per-message comm latency, bw\n"
      "(bytes per time unit) and bytes; `pipemat bench pipeline` prints the ones it measured.\n"
      "Examples:\n"
      "  pipemat project --layers 32 --costs F=1,I=1,W=1,comm=0.1\n"
      "  pipemat project --layers 32 --costs F=0.71,I=0.62,W=0.55,R=0.2,comm=0.1,bw=3e6,"
      "bytes=262144 --recompute pretrigger --format svg --output projection.svg\n"
      "Data x pipeline: --data D1,D2,... runs D replicas of each pipeline, M micro-batches\n"
      "each (D x M per step). After a chunk's last B or W its gradients (G = --grad-bytes per\n"
      "layer x the chunk's layers) are all-reduced over the D replicas, a rank's chunks one\n"
      "after another, beside the rank's remaining compute, each taking\n"
      "2 (D - 1) / D x G / --allreduce-bw + --allreduce-latency (bw in bytes per time unit of\n"
      "--costs). Efficiency = speedup / (D x P).\n"
      "  pipemat project --layers 32 --costs F=1.32,I=0.64,W=1.37,comm=1.48 --schedules zb-v \\\n"
      "    --micro-batches 32 --data 1,2,4,8 --grad-bytes 264192 --allreduce-bw 1e7 \\\n"
      "    --allreduce-latency 0.05\n"
      "Sharded optimizer (--shard-optimizer true): each chunk's exchange is a reduce-scatter,\n"
      "(D - 1) / D x G / bw + latency, and after the rank's compute its parameters are\n"
      "all-gathered, as long again per chunk, unhidden; --state-bytes S adds a state column:\n"
      "layers / P x (2 G + S / D) bytes a rank (S, not S / D, unsharded).\n"
      "  pipemat project --layers 32 --costs F=1.32,I=0.64,W=1.37,comm=1.48 --schedules zb-v \\\n"
      "    --micro-batches 32 --data 1,2,4,8 --grad-bytes 264192 --allreduce-bw 1e7 \\\n"
      "    --state-bytes 528384 --shard-optimizer true\n"
      "See docs/performance.md.");
  cmd->add_option("--layers", o.layers, "Layers of the model (default 32)");
  cmd->add_option("--costs", o.costs,
                  "Per layer F,I,W,B,R and per message comm,bw,bytes, e.g. F=1,I=1,W=1,comm=0.1")
      ->required();
  cmd->add_option("--schedules", o.schedules, "Schedule kinds (default 1f1b,zb-h1,zb-v)")
      ->delimiter(',');
  cmd->add_option("--ranks,--stages", o.ranks,
                  "Pipeline ranks P (default 4,8,16,32; --stages is the old name)")
      ->delimiter(',');
  cmd->add_option("--micro-batches", o.micro_batches,
                  "Micro-batches per step M (default 8,16,32,64)")
      ->delimiter(',');
  cmd->add_option("--virtual", o.virtual_stages, "Chunks per rank of interleaved (default 2)");
  cmd->add_option("--recompute", o.recompute, "none (default) | lazy | pretrigger");
  cmd->add_option("--data", o.data,
                  "Data-parallel replicas D of each pipeline (default 1: no all-reduce)")
      ->delimiter(',');
  cmd->add_option("--grad-bytes", o.grad_bytes,
                  "Gradient bytes of one layer, all-reduced over the D replicas (default 0)");
  cmd->add_option("--allreduce-bw", o.allreduce_bw,
                  "All-reduce bandwidth in bytes per time unit of --costs (e.g. 1e7: 10 GB/s in "
                  "ms); required with --grad-bytes");
  cmd->add_option("--allreduce-latency", o.allreduce_latency,
                  "Time units each all-reduce takes on top of its bytes (default 0)");
  cmd->add_option("--shard-optimizer", o.shard_optimizer,
                  "Model parallel.shard_optimizer: a reduce-scatter per chunk in place of the "
                  "all-reduce, and an all-gather of the parameters after the rank's compute "
                  "(default false)");
  cmd->add_option("--state-bytes", o.state_bytes,
                  "Optimizer state bytes of one layer (AdamW in float32: 2 x --grad-bytes); the "
                  "state column gives a rank's parameters, gradients and its share of this");
  cmd->add_option("--format", o.format, "text (default) | json | svg");
  cmd->add_option("--output", f->output, "Write to this file instead of stdout");
  cmd->callback([f] {
    const std::string doc = schedule::render_project_command(f->options);
    if (f->output.empty()) {
      std::cout << doc;
      return;
    }
    std::ofstream out(f->output, std::ios::binary);
    out << doc;
    PIPEMAT_CHECK(out.good(), ConfigError, "--output ", f->output, ": cannot write the file");
  });
}

}  // namespace pipemat::launch
