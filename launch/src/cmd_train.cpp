#include "commands.h"
#include "pipemat/core/error.h"

namespace pipemat::launch {

void add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "(not built yet)");
  cmd->callback([] { PIPEMAT_THROW(ConfigError, "pipemat train is not built yet"); });
}

}  // namespace pipemat::launch
