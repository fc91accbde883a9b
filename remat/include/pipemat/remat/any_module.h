#pragma once
// Wrapping type-erased modules in place: torch::nn::AnyModule members and Sequential entries.

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>

#include "pipemat/remat/region.h"

namespace pipemat::remat {

// Reroutes calls through `module` (in place) via its module's RegionSlot and returns the slot.
// Idempotent. The module tree is unchanged: same child, same parameter names.
std::shared_ptr<RegionSlot> make_any_module_region(torch::nn::AnyModule& module);

}  // namespace pipemat::remat
