#include "commands.h"
#include "pipemat/core/error.h"

namespace pipemat::launch {

void add_bench_remat_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("remat", "(not built yet)");
  cmd->callback([] { PIPEMAT_THROW(ConfigError, "pipemat bench remat is not built yet"); });
}

}  // namespace pipemat::launch
