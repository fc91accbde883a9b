// The `pipemat` binary: CLI11 subcommands over the library. Every user-facing failure is a
// pipemat::Error; it is printed as one `pipemat: error: ...` line and the exit code is 1.

#include <c10/util/Exception.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <thread>

#include "commands.h"
#include "pipemat/comm/launcher.h"
#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/compute.h"
#include "pipemat/train/train.h"
#include "stop_signals.h"

namespace {

// Note [One error line per failure]
// Under a launcher every rank parses the same command line and config, so a ConfigError (or
// any error before the job is joined) is normally everyone's: rank 0 reports it, and another
// rank first waits a moment, in which the launcher ends it when rank 0 has failed too (mpirun
// on MPI_Abort or on rank 0's exit, pipemat-run on the first exit). Only when nothing ended it
// (the failure was its own, e.g. a file missing on its host) does it report, naming itself.
// Any other failure after joining is the failing rank's: it reports at once, naming itself,
// and ends the job.
constexpr auto kQuietWait = std::chrono::seconds(3);

// Returns whether this rank waited for rank 0 to report a shared failure.
bool leave_it_to_rank0(bool shared) {
  const pipemat::comm::JobStatus job = pipemat::comm::job_status();
  if (!(shared || !job.joining) || job.launcher_rank <= 0) return false;
  std::this_thread::sleep_for(kQuietWait);
  return true;
}

// Returns the exit code: 1, or kDivergedExitCode for a diverged run.
int report_failure(const std::exception& e) {
  pipemat::launch::restore_default_signals();  // the launcher may end this rank while it waits
  const pipemat::comm::JobStatus job = pipemat::comm::job_status();
  const bool diverged = dynamic_cast<const pipemat::train::DivergedError*>(&e) != nullptr;
  const int code = diverged ? pipemat::train::kDivergedExitCode : 1;
  // A diverged run is every rank's at the same step, like a ConfigError.
  const bool waited =
      leave_it_to_rank0(diverged || dynamic_cast<const pipemat::ConfigError*>(&e) != nullptr);
  // LibTorch's errors carry a C++ backtrace in what(): the line keeps the message alone.
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  const char* what = torch_error != nullptr ? torch_error->what_without_backtrace() : e.what();
  const bool names_a_rank = std::strncmp(what, "rank ", 5) == 0;
  // One write for the whole line: ranks started as local processes share the terminal.
  std::string line = "pipemat: error: ";
  if (job.launcher_rank >= 0 && (job.joining || waited) && !names_a_rank) {
    line += "rank " + std::to_string(job.launcher_rank) + ": ";
  }
  line += what;
  line += "\n";
  std::cerr << line << std::flush;
  // Under mpirun a failed rank ends the job: its peers may wait on it, or be stuck, and
  // MPI_Finalize would wait for them (docs/comm.md, "Failures").
  pipemat::comm::abort_job(code);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  pipemat::comm::end_with_launcher();  // Note [Ranks end with their launcher]
  pipemat::pp::retain_freed_memory();  // Note [Freed memory stays in the process]
  // A write past the file-size limit (ulimit -f) fails with EFBIG and is reported with the file
  // it was for, instead of killing the process with SIGXFSZ half-way through a checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{
      "pipemat: pipeline-parallel training for LibTorch with declarative selective recompute.\n"
      "Run `pipemat <command> --help` for the flags of one command."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "pipemat 0.1.0");
  pipemat::launch::add_demo_command(app);
  pipemat::launch::add_train_command(app);
  pipemat::launch::add_config_command(app);
  pipemat::launch::add_generate_command(app);
  pipemat::launch::add_export_command(app);
  pipemat::launch::add_checkpoint_command(app);
  pipemat::launch::add_prepare_command(app);
  pipemat::launch::add_schedule_command(app);
  pipemat::launch::add_project_command(app);
  pipemat::launch::add_plan_command(app);
  auto* bench =
      app.add_subcommand("bench", "Benchmarks that print measured numbers (JSON with --json)");
  bench->require_subcommand(1);
  pipemat::launch::add_bench_remat_command(*bench);
  pipemat::launch::add_bench_p2p_command(*bench);
  pipemat::launch::add_bench_soak_command(*bench);
  pipemat::launch::add_bench_pipeline_command(*bench);
  pipemat::launch::add_bench_plan_command(*bench);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != 0) leave_it_to_rank0(true);
    return app.exit(e);
  } catch (const std::exception& e) {
    return report_failure(e);
  }
  return 0;
}
