#pragma once
// SIGINT and SIGTERM as a stop request for `pipemat train` (Note [Stopping on a signal] in
// pipemat/train/train.h): the first one sets a flag the training loop asks between steps; the
// handler then restores the default action of both, so a second signal ends the process at once.
// A signal before the loop first asks ends the process at once.

namespace pipemat::launch {

// Installs the handlers (also over SIGINT ignored at start, as a background job of a
// non-interactive shell has it: the launchers deliver the signal to the ranks on purpose).
// Call once, on the main thread, before the training starts.
void install_stop_signals();

// The signal that asked this process to stop (SIGINT or SIGTERM), or 0. Thread-safe.
int stop_signal();

// The training loop's question between steps (train::StopRequested): whether a stop signal
// came. Until it is first asked, the run is setting up (building the model, reading data,
// loading a checkpoint or weights), where no step boundary would come soon: a signal then ends
// the process at once, with the signal's default action (exit status 128 + its number).
// Thread-safe.
bool stop_requested();

// Back to the default actions of SIGINT and SIGTERM: once a run has failed, a launcher's TERM
// to the other ranks (Note [One error line per failure]) must end this process, not ask it to
// stop at a step boundary it will never reach.
void restore_default_signals();

}  // namespace pipemat::launch
