// The saved-tensor hooks of a checkpoint unit: forward keeps handles, replay hands the
// regenerated values to the invocation (Note [Saved tensor hooks in pure C++]).

#include "saved_hooks.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "overhead_clock.h"

namespace pipemat::remat::detail {
namespace {

// Forward: a RECOMPUTE op saved a tensor. Keep only a handle (index + metadata); replay
// regenerates the tensor when backward unpacks the handle.
class UnitHandleHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit UnitHandleHooks(std::shared_ptr<Invocation> inv) : inv_(std::move(inv)) {}
  ~UnitHandleHooks() override {
    if (index_ >= 0) inv_->handle_released(index_);
  }
  void call_pack_hook(const at::Tensor& tensor) override {
    RematCode remat_code;
    index_ = inv_->register_handle(tensor);
  }
  at::Tensor call_unpack_hook() override {
    RematCode remat_code;
    return inv_->unpack(index_);
  }

 private:
  std::shared_ptr<Invocation> inv_;
  int64_t index_ = -1;
};

// Replay: each saved tensor is the regenerated value of the forward handle with the same index.
// The replay graph itself stays usable (the hook hands the value back on unpack).
class ReplayHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit ReplayHooks(Invocation* inv) : inv_(inv) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    RematCode remat_code;
    value_ = tensor.detach();
    inv_->on_replay_pack(value_);
  }
  at::Tensor call_unpack_hook() override { return value_; }

 private:
  Invocation* inv_;
  at::Tensor value_;
};

}  // namespace

std::unique_ptr<torch::autograd::SavedVariableHooks> UnitHandleFactory::make() {
  return std::make_unique<UnitHandleHooks>(inv_);
}

std::unique_ptr<torch::autograd::SavedVariableHooks> ReplayFactory::make() {
  return std::make_unique<ReplayHooks>(inv_);
}

}  // namespace pipemat::remat::detail
