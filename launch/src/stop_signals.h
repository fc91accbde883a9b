#pragma once
// SIGINT and SIGTERM as a stop request for `pipemat train` (Note [Stopping on a signal] in
// pipemat/train/train.h): the first one sets a flag the training loop asks between steps; the
// handler then restores the default action of both, so a second signal ends the process at once.

namespace pipemat::launch {

// Installs the handlers (also over SIGINT ignored at start, as a background job of a
// non-interactive shell has it: the launchers deliver the signal to the ranks on purpose).
// Call once, on the main thread, before the training starts.
void install_stop_signals();

// The signal that asked this process to stop (SIGINT or SIGTERM), or 0. Thread-safe.
int stop_signal();

}  // namespace pipemat::launch
