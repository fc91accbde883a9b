#pragma once
// Everything a model author needs from remat.
//
// The public headers of remat (installed; none of it includes torch/csrc):
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
