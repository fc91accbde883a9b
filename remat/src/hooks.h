#pragma once
// Saved-tensor hooks for pure C++ programs. Private to remat: it exposes LibTorch's
// torch/csrc SavedVariableHooks, and only remat's own checkpoint units and SAVE regions push
// hooks; users see their effect through the wrappers (wrappers.h), never the hooks.
//
// Note [Saved tensor hooks in pure C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autograd builds a SavedVariable for every tensor an op keeps for its backward. Its constructor
// asks `Engine::get_default_engine().get_default_saved_variable_hooks()` for hooks; the base
// Engine returns nullptr and only the Python engine overrides it (reading Python callables from
// at::SavedTensorDefaultHooks). LibTorch has no C++ API for default hooks, so pipemat installs an
// Engine subclass whose override reads a thread-local stack of HookFactory objects, and makes it
// the default engine with `set_default_engine_stub`. hooks.cpp is the one place that does so. The
// Engine's virtuals and SavedVariable's behaviour below are internals, checked for every LibTorch
// the configure step accepts (2.11 to 2.15, Note [Finding LibTorch] in cmake/PipematTorch.cmake).
//
// Consequences every caller must keep in mind:
//  * Installation is process-wide and idempotent (install_saved_tensor_hooks()); it happens on
//    the first HookScope or wrapper construction, before any backward that needs hooks. With an
//    empty stack the engine behaves exactly like the base engine (one TLS read per saved tensor).
//  * The stack is thread-local and is not carried to autograd worker threads. CPU backward runs
//    on the calling thread; replay pushes its own hooks explicitly, so nothing depends on it.
//  * A SavedVariable with hooks skips autograd's in-place version check (SavedVariable::unpack
//    only checks `if (!hooks_)`). Every hook pipemat installs records the tensor's version at pack
//    time and checks it at unpack time itself, with an error that names the region.
//  * The pack hook runs under NoGradGuard and receives `data.detach()` for saved inputs but the
//    tensor itself for saved outputs; a hook that keeps a tensor keeps `t.detach()` so the saved
//    output does not own its own grad_fn (a reference cycle through the graph).

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <memory>

namespace pipemat::remat {

// Produces one SavedVariableHooks object per saved tensor while it is on top of the stack.
// make() runs inside the SavedVariable constructor: it must not throw for ordinary tensors.
class HookFactory {
 public:
  virtual ~HookFactory() = default;
  virtual std::unique_ptr<torch::autograd::SavedVariableHooks> make() = 0;
};

// Installs the hooking autograd engine once per process. Safe to call from any thread, any
// number of times. Throws RematError if another engine stub replaced ours (e.g. Python loaded).
void install_saved_tensor_hooks();

// RAII: pushes `factory` on this thread's hook stack for the scope's lifetime. The innermost
// scope wins (hooks shadow, they do not compose). Non-copyable; pops in its destructor.
class HookScope {
 public:
  explicit HookScope(HookFactory* factory);
  ~HookScope();
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  HookFactory* factory_;
};

}  // namespace pipemat::remat
