// The `pipemat` binary: CLI11 subcommands over the library. Every user-facing failure is a
// pipemat::Error; it is printed as one `pipemat: error: ...` line and the exit code is 1.

#include <cstdlib>
#include <exception>
#include <iostream>

#include "commands.h"
#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{
      "pipemat: pipeline-parallel training for LibTorch with declarative selective recompute.\n"
      "Run `pipemat <command> --help` for the flags of one command."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "pipemat 0.1.0");
  pipemat::launch::add_demo_command(app);
  pipemat::launch::add_train_command(app);
  pipemat::launch::add_schedule_command(app);
  auto* bench =
      app.add_subcommand("bench", "Benchmarks that print measured numbers (JSON with --json)");
  bench->require_subcommand(1);
  pipemat::launch::add_bench_remat_command(*bench);
  pipemat::launch::add_bench_p2p_command(*bench);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "pipemat: error: " << e.what() << "\n" << std::flush;
    // Under mpirun a failed rank ends the job: its peers may wait on it, or be stuck, and
    // MPI_Finalize would wait for them (docs/comm.md, "Failures").
    pipemat::comm::abort_job(1);
    return 1;
  }
  return 0;
}
