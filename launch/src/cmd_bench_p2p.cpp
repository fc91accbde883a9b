#include "commands.h"
#include "pipemat/core/error.h"

namespace pipemat::launch {

void add_bench_p2p_command(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("p2p", "(not built yet)");
  cmd->callback([] { PIPEMAT_THROW(ConfigError, "pipemat bench p2p is not built yet"); });
}

}  // namespace pipemat::launch
