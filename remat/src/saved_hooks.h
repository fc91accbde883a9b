#pragma once
// The saved-tensor hook factories of a checkpoint unit's forward and of its replay
// (Note [Saved tensor hooks in pure C++]). The hooks themselves live in saved_hooks.cpp.

#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <memory>
#include <utility>

#include "hooks.h"
#include "internal.h"

namespace pipemat::remat::detail {

// Forward of a unit: every tensor a RECOMPUTE op saves becomes a replay handle of `inv`.
class UnitHandleFactory final : public HookFactory {
 public:
  explicit UnitHandleFactory(std::shared_ptr<Invocation> inv) : inv_(std::move(inv)) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> make() override;

 private:
  std::shared_ptr<Invocation> inv_;
};

// Replay of a unit: every saved tensor is handed to `inv` as the value of the next handle.
class ReplayFactory final : public HookFactory {
 public:
  explicit ReplayFactory(Invocation* inv) : inv_(inv) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> make() override;

 private:
  Invocation* inv_;
};

}  // namespace pipemat::remat::detail
