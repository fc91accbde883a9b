#include "stop_signals.h"

#include <atomic>
#include <csignal>

namespace pipemat::launch {
namespace {

// Lock-free, so reading and writing it in a signal handler is async-signal-safe.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);
// Set once the training loop asks for stop requests: before that (building the model, reading
// the data, loading a checkpoint or weights) nothing would ask, so a signal ends the process.
std::atomic<bool> g_loop_asks{false};
static_assert(std::atomic<bool>::is_always_lock_free);

void set_action(int sig, void (*handler)(int)) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // the transports' system calls go on; the loop asks the flag
  sigaction(sig, &action, nullptr);
}

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  g_stop_signal.compare_exchange_strong(none, sig);
  // The second signal, of either kind, takes the default action: the process ends at once.
  set_action(SIGINT, SIG_DFL);
  set_action(SIGTERM, SIG_DFL);
  // Before the loop asks (a load may take minutes): this one too, as soon as the handler
  // returns (the signal is blocked while it runs).
  if (!g_loop_asks.load()) ::raise(sig);
}

}  // namespace

void install_stop_signals() {
  set_action(SIGINT, on_stop_signal);
  set_action(SIGTERM, on_stop_signal);
}

int stop_signal() { return g_stop_signal.load(); }

bool stop_requested() {
  g_loop_asks.store(true);
  return g_stop_signal.load() != 0;
}

void restore_default_signals() {
  set_action(SIGINT, SIG_DFL);
  set_action(SIGTERM, SIG_DFL);
}

}  // namespace pipemat::launch
