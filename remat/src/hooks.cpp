#include "hooks.h"

#include <torch/csrc/autograd/engine.h>

#include <mutex>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat::remat {
namespace {

thread_local std::vector<HookFactory*> tls_hook_stack;

// See Note [Saved tensor hooks in pure C++].
class HookingEngine final : public torch::autograd::Engine {
 public:
  HookingEngine() = default;
  ~HookingEngine() override { stop(); }

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (tls_hook_stack.empty()) return nullptr;
    return tls_hook_stack.back()->make();
  }
};

torch::autograd::Engine& hooking_engine() {
  // Leaked on purpose: the engine owns worker threads that may outlive static destruction.
  static auto* engine = new HookingEngine();
  return *engine;
}

}  // namespace

void install_saved_tensor_hooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    hooking_engine();
    torch::autograd::set_default_engine_stub(&hooking_engine);
  });
  PIPEMAT_CHECK(&torch::autograd::Engine::get_default_engine() == &hooking_engine(), RematError,
                "the autograd default engine was replaced after pipemat installed its saved-tensor "
                "hooks (is the Python engine loaded in this process?); pipemat's checkpointing "
                "needs its own engine. See Note [Saved tensor hooks in pure C++].");
}

HookScope::HookScope(HookFactory* factory) : factory_(factory) {
  install_saved_tensor_hooks();
  tls_hook_stack.push_back(factory_);
}

HookScope::~HookScope() {
  // Scopes nest strictly (RAII), so the top is ours.
  if (!tls_hook_stack.empty() && tls_hook_stack.back() == factory_) tls_hook_stack.pop_back();
}

}  // namespace pipemat::remat
