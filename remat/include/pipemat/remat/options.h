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
  // skipped SAVE body, so dropout replays identically.
  bool preserve_rng_state = true;
  // Name used in errors and reports; defaults to the module path or the module's type name.
  std::string name;
};

// Note [Placeholder leaf count]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Consecutive SAVE regions all skip their bodies in replay, so the outputs inside a chain
// RECOMPUTE -> SAVE1(false) -> ... -> SAVEn(true) need not survive until backward. A region with
// save_output = false keeps no output: forward records only how many tensor leaves its output
// has, and replay returns that many zero-element placeholders, all aliases of one cached tensor
// (none for 0 leaves, a tensor for 1, a list for n; typed callers get their tuple or vector).
// The count must equal forward's: the placeholders stand exactly where the real leaves stood, so
// the next SAVE region receives the same arguments and the unit's pack/unpack sequence (the
// replay handles and markers) is unchanged. Tensors saved for the region's own backward are kept
// as usual; only the output cache is dropped.
// A placeholder is valid only as a whole argument of the next SAVE region. Every other use is an
// error naming the producing region and the invocation, never a silent wrong number: a
// RECOMPUTE op saving the output (caught in forward), the unit returning it (forward), and in
// replay an op saving a placeholder or failing on its data.

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
