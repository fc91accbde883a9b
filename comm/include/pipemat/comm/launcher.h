#pragma once
// Starting N local processes as the ranks of a tcp job (tests, `pipemat bench p2p --transport
// tcp` without --rank). Each child gets PIPEMAT_RANK, PIPEMAT_WORLD_SIZE and
// PIPEMAT_MASTER=host:port (a free port) in its environment.

#include <chrono>
#include <string>
#include <vector>

namespace pipemat::comm {

struct SpawnOptions {
  int world_size = 2;
  std::string host = "127.0.0.1";
  int port = 0;  // 0: a free port picked by the kernel
  // The program and its arguments. An empty program means this executable (/proc/self/exe).
  std::vector<std::string> argv;
  // The whole job is killed (SIGKILL) after this long.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // After the first rank fails (non-zero exit or signal), the others get this long to finish
  // on their own (they normally see the failure as a CommError), then SIGTERM.
  std::chrono::milliseconds grace{std::chrono::seconds(20)};
};

struct SpawnResult {
  std::vector<int> exit_codes;  // per rank: exit status, or 128 + signal number
  bool timed_out = false;
  bool ok() const;
  // "rank 0: exit 0, rank 1: exit 3" (+ " (timed out)")
  std::string describe() const;
};

// Forks/execs the ranks and waits for all of them. Each rank gets PIPEMAT_RANK,
// PIPEMAT_WORLD_SIZE, PIPEMAT_MASTER and a fresh PIPEMAT_JOB_SECRET (kept from the environment
// when it has one), like pipemat-run. Blocking; not thread-safe with other fork()s in the
// process. Throws CommError if a process cannot be started.
SpawnResult spawn_local_ranks(const SpawnOptions& options);

// A TCP port on `host` that was free when asked (the kernel's choice).
int pick_free_port(const std::string& host = "127.0.0.1");

// Note [Ranks end with their launcher]
// A rank that a launcher started must not outlive it: a stopped rank, or one stuck waiting for a
// dead peer, would run on unseen after the job has ended. mpirun does not wait for a rank it
// kills (Open MPI 4's mpirun sends SIGCONT and SIGTERM, which `pipemat train` takes as a stop
// request at the next step boundary, then SIGKILL, and counts the rank as gone at once), and a
// launcher may itself be killed. So, first thing, a rank asks the kernel for SIGKILL when its
// parent exits (PR_SET_PDEATHSIG; the parent forks from its one thread: pipemat-run is a shell,
// mpirun forks from its main thread), and the launchers wait until their ranks are gone
// (pipemat-run: docs/reliability.md). This applies to a process that
//   - pipemat-run started: PIPEMAT_LAUNCHER_PID names the launcher, which must be the parent; one
//     already gone by then (it died between the fork and this call) ends the rank at once. The
//     variable is removed from the environment, so the rank's own children are not taken for
//     ranks;
//   - Open MPI started (OMPI_COMM_WORLD_SIZE): its parent is mpirun, or orted on another host.
// Any other process (started by hand from a shell, nohup or ssh) is left alone: it may outlive
// the shell. Call it at the start of main, before any thread starts. Linux only; elsewhere it
// does nothing.
void end_with_launcher();

}  // namespace pipemat::comm
