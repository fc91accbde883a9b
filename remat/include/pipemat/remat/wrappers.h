#pragma once
// The declarative API: wrap modules and callables as checkpoint units or SAVE regions without
// editing any forward.
//
//   model->block = checkpoint_wrapper(model->block);            // checkpoint unit
//   block->gemm  = checkpoint_exclude_wrapper(block->gemm);      // SAVE region
//
// Typed members must be declared through the holder `Remat<H>` (a one-line change of the member
// declaration, e.g. `torch::nn::Linear gemm{nullptr};` -> `Remat<torch::nn::Linear>
// gemm{nullptr};`) because C++ binds `gemm(x)` statically: Remat<H>::operator() consults the
// declaration at each call. Children of torch::nn::Sequential and torch::nn::AnyModule members are
// wrapped in place (apply_policy() or the AnyModule overloads). Plain callables are wrapped into
// RegionFn.
//
// Every handle of one module instance shares one RegionSlot (looked up by module address), so a
// declaration made through any handle, or by apply_policy() on the module tree, is seen by all.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "pipemat/core/error.h"
#include "pipemat/remat/options.h"
#include "pipemat/remat/region.h"
#include "pipemat/remat/values.h"

namespace pipemat::remat {

// The slot of a module instance, created on first use. `interceptable` marks that the module is
// called through a pipemat handle (so a declaration takes effect); apply_policy() refuses to
// declare modules nobody calls through a handle.
std::shared_ptr<RegionSlot> slot_for(const std::shared_ptr<torch::nn::Module>& module,
                                     bool interceptable);
// The slot of a module instance, or nullptr when it has none.
std::shared_ptr<RegionSlot> find_slot(const torch::nn::Module* module);
bool slot_is_interceptable(const torch::nn::Module* module);

template <typename H>
class Remat;

namespace detail {

template <typename Fn, typename... A, size_t... I>
c10::IValue call_with_ivalues(const Fn& fn, const std::vector<c10::IValue>& args,
                              std::index_sequence<I...>) {
  using R = decltype(fn(std::declval<A>()...));
  static_assert(!std::is_void_v<R>, "pipemat remat: a wrapped callable must return a value");
  return to_ivalue(fn(from_ivalue<A>(args[I])...));
}

// Runs `fn(args...)` as `slot` declares. Plain calls and SAVE regions outside a checkpoint unit
// call `fn` directly (no conversion); otherwise arguments and result go through IValues.
// `fn` is copied into the body when the slot is a checkpoint unit (the body outlives the call).
template <typename Fn, typename... Args>
auto invoke(const RegionSlot& slot, const Fn& fn, Args&&... args)
    -> decltype(fn(std::forward<Args>(args)...)) {
  using R = decltype(fn(std::forward<Args>(args)...));
  if (slot.kind() == RegionSlot::Kind::kPlain ||
      (slot.kind() == RegionSlot::Kind::kSave && !inside_checkpoint_unit())) {
    return fn(std::forward<Args>(args)...);
  }
  std::optional<std::decay_t<R>> result;
  run_typed_region(
      slot,
      [&](std::vector<c10::IValue>& values) -> RegionBody {
        values.reserve(sizeof...(Args));
        (values.push_back(to_ivalue(std::decay_t<Args>(args))), ...);
        return [fn](const std::vector<c10::IValue>& v) {
          return call_with_ivalues<Fn, std::decay_t<Args>...>(fn, v,
                                                              std::index_sequence_for<Args...>{});
        };
      },
      [&](const c10::IValue& out) { result.emplace(from_ivalue<std::decay_t<R>>(out)); });
  return std::move(*result);
}

template <typename T, typename = void>
struct is_module_holder : std::false_type {};
template <typename T>
struct is_module_holder<T, std::void_t<typename T::ContainedType>>
    : std::is_base_of<torch::nn::ModuleHolder<typename T::ContainedType>, T> {};

template <typename T>
struct is_remat : std::false_type {};
template <typename H>
struct is_remat<Remat<H>> : std::true_type {};

// The module class behind a holder type (torch::nn::Linear -> LinearImpl) or the class itself.
template <typename T, typename = void>
struct ImplOf {
  using type = T;
};
template <typename T>
struct ImplOf<T, std::void_t<typename T::ContainedType>> {
  using type = typename T::ContainedType;
};

template <typename T>
constexpr bool is_plain_callable_v =
    !is_module_holder<T>::value && !is_remat<T>::value && !std::is_same_v<T, torch::nn::AnyModule>;

}  // namespace detail

// Holder for a typed module member whose calls consult its remat declaration.
// `H` is a LibTorch module holder type such as torch::nn::Linear or a TORCH_MODULE of yours.
template <typename H>
class Remat {
 public:
  using Holder = H;
  using Impl = typename H::ContainedType;

  Remat(std::nullptr_t) {}                        // NOLINT: mirrors ModuleHolder's empty state
  Remat(const H& holder) { bind(holder.ptr()); }  // NOLINT: one-line member change
  Remat(std::shared_ptr<Impl> impl) { bind(std::move(impl)); }  // NOLINT
  Remat& operator=(const H& holder) {
    bind(holder.ptr());
    return *this;
  }
  Remat& operator=(std::shared_ptr<Impl> impl) {  // what register_module() returns
    bind(std::move(impl));
    return *this;
  }

  // Calls the module: plainly, as a checkpoint unit, or as a SAVE region.
  template <typename... Args>
  auto operator()(Args&&... args) {
    PIPEMAT_CHECK(impl_ != nullptr, RematError,
                  "called an empty pipemat::remat::Remat holder; assign a module to it first");
    std::shared_ptr<Impl> impl = impl_;
    auto fn = [impl](auto&&... a) { return impl->forward(std::forward<decltype(a)>(a)...); };
    return detail::invoke(*slot_, fn, std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto forward(Args&&... args) {
    return (*this)(std::forward<Args>(args)...);
  }

  Impl* operator->() const { return impl_.get(); }
  Impl& operator*() const { return *impl_; }
  const std::shared_ptr<Impl>& ptr() const { return impl_; }
  H holder() const { return H(impl_); }
  bool is_empty() const { return impl_ == nullptr; }
  RegionSlot& slot() const { return *slot_; }

 private:
  void bind(std::shared_ptr<Impl> impl) {
    impl_ = std::move(impl);
    slot_ = impl_ ? slot_for(impl_, /*interceptable=*/true) : nullptr;
  }
  std::shared_ptr<Impl> impl_;
  std::shared_ptr<RegionSlot> slot_;
};

// A plain callable with a remat declaration.
template <typename Fn>
class RegionFn {
 public:
  RegionFn(Fn fn, std::shared_ptr<RegionSlot> slot) : fn_(std::move(fn)), slot_(std::move(slot)) {}
  template <typename... Args>
  auto operator()(Args&&... args) const {
    return detail::invoke(*slot_, fn_, std::forward<Args>(args)...);
  }
  RegionSlot& slot() const { return *slot_; }

 private:
  Fn fn_;
  std::shared_ptr<RegionSlot> slot_;
};

// --- checkpoint_wrapper
// ---------------------------------------------------------------------------

// Declares the module a checkpoint unit (non-reentrant activation checkpoint: RECOMPUTE by
// default, with SAVE regions inside excluded from replay). Returns a handle of the same module.
template <typename H>
Remat<H> checkpoint_wrapper(const Remat<H>& module, const CheckpointOptions& options = {}) {
  PIPEMAT_CHECK(!module.is_empty(), RematError, "checkpoint_wrapper: the module holder is empty");
  module.slot().declare_checkpoint(options);
  return module;
}
template <typename H, typename = std::enable_if_t<detail::is_module_holder<H>::value>>
Remat<H> checkpoint_wrapper(const H& module, const CheckpointOptions& options = {}) {
  PIPEMAT_CHECK(!module.is_empty(), RematError, "checkpoint_wrapper: the module holder is empty");
  return checkpoint_wrapper(Remat<H>(module), options);
}
torch::nn::AnyModule checkpoint_wrapper(const torch::nn::AnyModule& module,
                                        const CheckpointOptions& options = {});

// Declares the module a SAVE region: excluded from replay, its own saved tensors kept, its output
// cached for replay (save_output = true) or reduced to placeholders (false).
template <typename H>
Remat<H> checkpoint_exclude_wrapper(const Remat<H>& module, const SaveRegionOptions& options = {}) {
  PIPEMAT_CHECK(!module.is_empty(), RematError,
                "checkpoint_exclude_wrapper: the module holder is empty");
  module.slot().declare_save(options);
  return module;
}
template <typename H, typename = std::enable_if_t<detail::is_module_holder<H>::value>>
Remat<H> checkpoint_exclude_wrapper(const H& module, const SaveRegionOptions& options = {}) {
  PIPEMAT_CHECK(!module.is_empty(), RematError,
                "checkpoint_exclude_wrapper: the module holder is empty");
  return checkpoint_exclude_wrapper(Remat<H>(module), options);
}
torch::nn::AnyModule checkpoint_exclude_wrapper(const torch::nn::AnyModule& module,
                                                const SaveRegionOptions& options = {});

// Plain callables (lambdas, std::function, function objects).
template <typename Fn, typename = std::enable_if_t<detail::is_plain_callable_v<Fn>>,
          typename = void>
RegionFn<Fn> checkpoint_wrapper(Fn fn, const CheckpointOptions& options = {}) {
  auto slot = std::make_shared<RegionSlot>(options.name.empty() ? "callable" : options.name);
  slot->declare_checkpoint(options);
  return RegionFn<Fn>(std::move(fn), std::move(slot));
}
template <typename Fn, typename = std::enable_if_t<detail::is_plain_callable_v<Fn>>,
          typename = void>
RegionFn<Fn> checkpoint_exclude_wrapper(Fn fn, const SaveRegionOptions& options = {}) {
  auto slot = std::make_shared<RegionSlot>(options.name.empty() ? "callable" : options.name);
  slot->declare_save(options);
  return RegionFn<Fn>(std::move(fn), std::move(slot));
}

}  // namespace pipemat::remat
