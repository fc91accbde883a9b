#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/models/config.h"
#include "pipemat/models/train.h"

namespace pipemat::launch {

void add_train_command(CLI::App& app) {
  struct Flags {
    std::string config;
    std::vector<std::string> overrides;
    std::string metrics;
    bool reference = false;
    bool print_config = false;
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "train",
      "Pipeline-parallel training of a zoo model with remat, as the YAML config describes.\n"
      "Start one process per pipeline rank: `pipemat-run -n 2 configs/default.yaml` (mpirun),\n"
      "or set transport.kind=local to run every rank as a thread of this process.\n"
      "Prints one progress line per step; --metrics writes one JSON line per step.");
  cmd->add_option("--config", f->config, "YAML config file (see docs/config.md)")->required();
  cmd->add_option("--set", f->overrides,
                  "Override a config key: --set schedule.kind=zb-v --set training.steps=3")
      ->take_all();
  cmd->add_option("--metrics", f->metrics, "Write per-step JSON lines here (output.metrics)");
  cmd->add_flag("--reference", f->reference,
                "Run the same model, data and steps in one process with no pipeline and no "
                "remat: the oracle for correctness");
  cmd->add_flag("--print-config", f->print_config, "Print the effective config and exit");
  cmd->callback([f] {
    models::TrainConfig config = models::load_config(f->config, f->overrides);
    if (!f->metrics.empty()) config.output.metrics = f->metrics;
    if (f->print_config) {
      std::cout << models::config_to_yaml(config);
      return;
    }
    const int rc = models::run_train(config, f->reference, std::cout);
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace pipemat::launch
