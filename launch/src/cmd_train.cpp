#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/train/config.h"
#include "pipemat/train/train.h"
#include "stop_signals.h"

namespace pipemat::launch {

void add_train_command(CLI::App& app) {
  struct Flags {
    std::string config;
    std::vector<std::string> overrides;
    std::string metrics;
    std::string trace;
    bool reference = false;
    bool print_config = false;
    std::string resume;
    int64_t stop_after = 0;
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "train",
      "Pipeline-parallel training with remat, as the YAML config describes: a byte-level GPT on\n"
      "text (model.kind gpt, configs/default.yaml) or a zoo model on synthetic data.\n"
      "Start one process per pipeline rank: `pipemat-run -n 2 configs/default.yaml` (mpirun),\n"
      "or set transport.kind=local to run every rank as a thread of this process.\n"
      "Prints one progress line per step; --metrics writes one JSON line per step.\n"
      "Exit code: 0; 1 when an error stopped the run; after training finished, 3 when the final\n"
      "checkpoint, 4 when an output file (loss curve, timeline), 5 when the sample failed;\n"
      "6 when the run diverged (a loss or clipped gradient norm not finite; it stops before\n"
      "that step's checkpoint unless training.allow_non_finite=true);\n"
      "130 after SIGINT (Ctrl-C), 143 after SIGTERM: the run stops at the next step boundary,\n"
      "saying the last complete step and checkpoint (a signal before the first step, or a\n"
      "second signal, ends it at once; under\n"
      "mpirun, which sends the ranks SIGTERM, mpirun itself exits 1).");
  cmd->add_option("--config", f->config, "YAML config file (see docs/config.md)")->required();
  cmd->add_option("--set", f->overrides,
                  "Override a config key: --set schedule.kind=zb-v --set training.steps=3")
      ->take_all();
  cmd->add_option("--metrics", f->metrics, "Write per-step JSON lines here (output.metrics)");
  cmd->add_option("--trace", f->trace,
                  "Write every step of every rank as Chrome trace-event JSON here, for Perfetto "
                  "or chrome://tracing (output.trace)");
  cmd->add_flag("--reference", f->reference,
                "Run the same model, data and steps in one process with no pipeline and no "
                "remat: the oracle for correctness");
  cmd->add_option("--resume", f->resume,
                  "Continue a run from a checkpoint: a step-NNNNNN directory, or latest (the "
                  "newest complete one under checkpoint.dir); same as --set checkpoint.resume=");
  cmd->add_option("--stop-after", f->stop_after,
                  "Stop after this many steps (saving a checkpoint with checkpoint.dir) while the "
                  "LR schedule still spans training.steps; --resume continues the run; same as "
                  "--set training.stop_after=")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--print-config", f->print_config, "Print the effective config and exit");
  cmd->callback([f] {
    train::TrainConfig config = train::load_config(f->config, f->overrides);
    print_config_warnings(config.warnings);
    if (!f->metrics.empty()) config.output.metrics = f->metrics;
    if (!f->trace.empty()) config.output.trace = f->trace;
    if (f->stop_after > 0) config.training.stop_after = f->stop_after;
    if (!f->resume.empty()) {
      config.checkpoint.resume = f->resume;
      PIPEMAT_CHECK(f->resume != "latest" || !config.checkpoint.dir.empty(), ConfigError,
                    "--resume latest needs checkpoint.dir (--set checkpoint.dir=DIR), the "
                    "directory the checkpoints were written to");
    }
    if (f->print_config) {
      std::cout << train::config_to_yaml(config);
      return;
    }
    // The reference runs in one process with nothing to coordinate: a signal ends it as usual.
    if (!f->reference) install_stop_signals();
    const int rc = train::run_train(config, f->reference, std::cout, std::cerr,
                                    [] { return stop_requested(); });
    if (rc == train::kInterrupted) {
      // Under mpirun a rank that stopped must not wait in MPI_Finalize for a peer that began the
      // next step and waits on it (Note [Stopping on a signal]): it ends the job, after its line.
      comm::abort_job(128 + stop_signal());
      std::exit(128 + stop_signal());
    }
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace pipemat::launch
