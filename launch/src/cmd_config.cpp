// `pipemat config`: what the YAML config accepts, from the loader's own field table.

#include <iostream>
#include <memory>

#include "commands.h"
#include "pipemat/train/config.h"

namespace pipemat::launch {

void add_config_command(CLI::App& app) {
  auto keys = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand(
      "config",
      "What a training config (YAML) may hold, from the loader's field table.\n"
      "--keys prints the key tables of docs/config.md (type, default, allowed values, meaning\n"
      "of every key, one section per first part); the test suite checks that the document's\n"
      "rows are these.");
  cmd->add_flag("--keys", *keys, "Print every key's table row, by section (Markdown)")->required();
  cmd->callback([keys] { std::cout << train::config_key_tables(); });
}

}  // namespace pipemat::launch
