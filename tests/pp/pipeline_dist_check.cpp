// The user model of user_model.h trained through the public pp API under a real multi-process
// transport: `mpiexec -n N pipeline_dist_check --schedule 1f1b|zb-v|... --steps S`. Every rank
// runs the plain single-process loop itself and compares its losses, gradient norms and the
// parameters of its own stages after every step bitwise. Prints "N passed, N failed" per rank
// and exits non-zero on any difference or error, and when it checked nothing. With --memory it
// also trains with four times the micro-batches and requires every rank's step peak (its own
// process, the tracking allocator) to stay within two messages: a schedule bounds what a rank
// holds in flight, so nothing may pile up per micro-batch (sent tensors, the data halves a rank
// does not read).

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "pipemat/comm/transport.h"
#include "pipemat/remat/memory.h"
#include "pipemat/schedule/schedule.h"
#include "user_model.h"
#include "user_pipeline.h"

int main(int argc, char** argv) {
  user_model::PipelineCase c;
  std::string kind = "1f1b";
  CLI::App app{"The user model trained through the pp API under mpiexec, checked bitwise."};
  app.add_option("--schedule", kind, "Schedule kind (1f1b, zb-v, gpipe, zb-h1, ...)")->required();
  app.add_option("--steps", c.steps, "Training steps")->required()->check(CLI::Range(1, 1000));
  bool memory = false;
  app.add_flag("--memory", memory,
               "Also require the same step peak (within two messages) with 4x the micro-batches");
  CLI11_PARSE(app, argc, argv);
  if (memory) pipemat::remat::install_tracking_allocator();
  try {
    c.kind = pipemat::schedule::parse_schedule_kind(kind);
    pipemat::comm::TransportOptions options;
    options.kind = pipemat::comm::TransportKind::kMpi;
    auto transport = pipemat::comm::make_transport(pipemat::comm::resolve_options(options));
    c.ranks = transport->world_size();
    c.micro_batches = 2 * c.ranks;
    const auto run = user_model::run_rank(*transport, c);
    const auto plain = user_model::plain_training(c.blocks, c.micro_batches, c.steps);
    auto diffs = user_model::differences(run, plain, transport->rank());
    size_t checked = 2 * run.losses.size();
    for (const auto& ps : run.params) checked += ps.size();
    if (memory) {
      // Four times the micro-batches: what piles up per micro-batch grows by 3 M messages, while
      // the timing of the peer's receives (a send still in flight at the peak) moves the peak by
      // at most a message or two of the last step's activations.
      user_model::PipelineCase more_batches = c;
      more_batches.micro_batches = 4 * c.micro_batches;
      const auto more = user_model::run_rank(*transport, more_batches);
      ++checked;
      const int64_t message = user_model::kBatch * user_model::seq_len(c.steps - 1) *
                              user_model::kHidden * static_cast<int64_t>(sizeof(float));
      // Each action's bytes (one process per rank): it peaks at or above its start, at or under
      // the step's peak, and some action (a forward) allocates.
      bool allocates = false;
      for (const auto& [start, peak] : run.action_bytes) {
        allocates = allocates || peak > start;
        if (peak < start || peak > run.peak_bytes.back()) {
          diffs.push_back("rank " + std::to_string(transport->rank()) + ": an action's bytes " +
                          std::to_string(start) + " at its start, " + std::to_string(peak) +
                          " at its peak, step peak " + std::to_string(run.peak_bytes.back()));
        }
      }
      ++checked;
      if (!allocates) diffs.push_back("no action's peak is above its start");
      if (more.peak_bytes.back() > run.peak_bytes.back() + 2 * message) {
        diffs.push_back("rank " + std::to_string(transport->rank()) + ": step peak " +
                        std::to_string(more.peak_bytes.back()) + " bytes with " +
                        std::to_string(more_batches.micro_batches) + " micro-batches, " +
                        std::to_string(run.peak_bytes.back()) + " with " +
                        std::to_string(c.micro_batches) + " (more than 2 messages of " +
                        std::to_string(message) + " bytes apart)");
      }
    }
    for (const auto& d : diffs) std::fprintf(stderr, "%s\n", d.c_str());
    transport->barrier();
    std::printf("rank %d (%s, %d ranks): %zu passed, %zu failed\n", transport->rank(),
                pipemat::schedule::to_string(c.kind), c.ranks, checked - diffs.size(),
                diffs.size());
    if (checked == 0) {
      std::fprintf(stderr, "pipeline_dist_check: rank %d checked nothing\n", transport->rank());
      return 1;
    }
    return diffs.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_dist_check: error: %s\n", e.what());
    return 1;
  }
}
