#include "commands.h"
#include "pipemat/core/error.h"

namespace pipemat::launch {

void add_schedule_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("schedule", "(not built yet)");
  cmd->callback([] { PIPEMAT_THROW(ConfigError, "pipemat schedule is not built yet"); });
}

}  // namespace pipemat::launch
