#pragma once
// Options of the two region kinds. Plain structs with defaults; validated where they are used.

#include <string>

namespace pipemat::remat {

// A checkpoint unit (RECOMPUTE by default): see checkpoint_wrapper().
struct CheckpointOptions {
  // Stop replay as soon as every tensor the backward still needs has been regenerated; the tail
  // of the forward after the last saved tensor is not re-run.
  bool early_stop = true;
  // Restore the CPU generator state of unit entry for replay, and the state right after each
  // skipped SAVE body (Note [Replay RNG alignment]), so dropout replays identically.
  bool preserve_rng_state = true;
  // Name used in errors and reports; defaults to the module path or the module's type name.
  std::string name;
};

// A SAVE region inside a checkpoint unit: see checkpoint_exclude_wrapper().
struct SaveRegionOptions {
  // Cache the region's output for replay (true), or keep only its tensor-leaf count and return
  // zero-element placeholders in replay (false; only for an output that goes whole, as one
  // argument, straight into the next SAVE region: Note [Placeholder leaf count]).
  bool save_output = true;
  // Name used in errors and reports; defaults to the module path or the module's type name.
  std::string name;
};

}  // namespace pipemat::remat
