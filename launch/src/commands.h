#pragma once
// Each subcommand of the `pipemat` binary lives in its own cmd_<name>.cpp and registers itself
// here. A command parses flags into its module's options struct and calls the library; it holds
// no logic of its own.

#include <CLI/CLI.hpp>

namespace pipemat::launch {

void add_demo_command(CLI::App& app);

}  // namespace pipemat::launch
