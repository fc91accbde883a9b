#include <iostream>

#include "commands.h"

namespace pipemat::launch {

void add_demo_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("demo", "Train a small model with a checkpoint unit and SAVE regions");
  cmd->callback([] { std::cout << "demo\n"; });
}

}  // namespace pipemat::launch
