// The stop signals of `pipemat train` (launch/src/stop_signals.h, Note [Stopping on a signal]),
// each case in a child process of its own: before the training loop first asks, a SIGTERM or
// SIGINT ends the process at once with the signal (a load of minutes is not waited out); once it
// asks, the first signal is a stop request the loop sees and the second ends the process.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <functional>

#include "../../launch/src/stop_signals.h"

namespace pipemat::launch {
namespace {

// Runs `body` in a child with the stop signals installed; returns its wait status.
int status_of(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    install_stop_signals();
    ::_exit(body());
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  return status;
}

TEST(StopSignals, BeforeTheLoopAsksASignalEndsTheProcessAtOnce) {
  for (const int sig : {SIGTERM, SIGINT}) {
    const int status = status_of([sig] {
      ::raise(sig);  // while setting up: loading a checkpoint, reading data
      return 0;      // not reached
    });
    ASSERT_TRUE(WIFSIGNALED(status)) << "signal " << sig << ": status " << status;
    EXPECT_EQ(WTERMSIG(status), sig);
  }
}

TEST(StopSignals, OnceTheLoopAsksTheFirstSignalIsAStopRequestAndTheSecondEndsTheProcess) {
  const int asked = status_of([] {
    if (stop_requested()) return 10;  // nothing came yet
    ::raise(SIGTERM);
    if (!stop_requested() || stop_signal() != SIGTERM) return 11;
    ::raise(SIGINT);  // the second: the default action
    return 12;        // not reached
  });
  ASSERT_TRUE(WIFSIGNALED(asked)) << "status " << asked;
  EXPECT_EQ(WTERMSIG(asked), SIGINT);
}

}  // namespace
}  // namespace pipemat::launch
