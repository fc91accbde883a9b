#pragma once
// Everything a model author needs from remat.
//
// What lives where in remat
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Public (include/pipemat/remat/, installed; none of it includes torch/csrc):
//   wrappers.h    checkpoint_wrapper / checkpoint_exclude_wrapper, the Remat<H> member holder,
//                 RegionFn for plain callables, the module -> RegionSlot lookup.
//   containers.h  ModuleList / ModuleDict drop-ins whose children can be declared.
//   any_module.h  wrapping torch::nn::AnyModule members and Sequential entries in place.
//   policy.h      apply_policy: declarations by module path (from code or YAML).
//   options.h     CheckpointOptions, SaveRegionOptions (Note [Placeholder leaf count]).
//   region.h      RegionSlot and run_region, the one place that decides checkpoint behaviour;
//                 the rederivation and trace switches.
//   invocation.h  invocation keys, scopes and groups (schedule action R), RematReport
//                 (Note [Invocation lifetime]).
//   stats.h       per-thread counters and host overhead.
//   memory.h      the tracking CPU allocator: current / peak bytes.
//   rng.h         per-thread CPU generators (Note [Per-thread CPU generators]).
//   values.h      IValue conversion of region inputs and outputs; tensor-leaf walks.
// Private (src/):
//   internal.h, invocation.cpp, replay.cpp, save_regions.cpp, report.cpp   the Invocation (its
//       forward, replay, SAVE entries, rederivation, report) and the per-thread region context
//       (Note [Replay RNG alignment]).
//   region.cpp    run_region: unit forward, SAVE forward and replay, a SAVE body's hooks.
//   saved_hooks.*  the saved-tensor hooks of a unit's forward and of its replay.
//   counters.h + stats.cpp, overhead_clock.*, trace.cpp   counters, overhead clock, debug trace.
//   slots.cpp (the module -> RegionSlot table), containers.cpp, policy.cpp, values.cpp.
// The reaches into LibTorch internals, each in one file with a Note (checked for the LibTorch
// versions the configure step accepts, 2.11 to 2.15):
//   hooks.h / hooks.cpp  the autograd Engine subclass for default saved-tensor hooks
//                        (Note [Saved tensor hooks in pure C++]).
//   any_module.cpp       AnyModule's private content (Note [AnyModule content access]).
//   memory.cpp           the CPU allocator replacement (Note [CPU allocator replacement]).
//   rng.cpp              dispatch key and generator state (Note [LibTorch generator internals]).
// tests/public_headers.sh (ctest Headers.*) fails when a public header includes torch/csrc or
// declares detail:: internals (header-only template and macro machinery excepted: wrappers.h,
// core/error.h, pp/pipeline.h).
#include "pipemat/remat/any_module.h"
#include "pipemat/remat/containers.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/options.h"
#include "pipemat/remat/policy.h"
#include "pipemat/remat/region.h"
#include "pipemat/remat/rng.h"
#include "pipemat/remat/stats.h"
#include "pipemat/remat/values.h"
#include "pipemat/remat/wrappers.h"
