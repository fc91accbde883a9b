// torch::nn::AnyModule and Sequential entries as remat regions.
//
// Sequential calls its children through AnyModule's type-erased forward, so wrapping a child in
// place means giving its AnyModule a different erased callee: a RegionPlaceholder that runs the
// original callee as `slot` declares. The module tree is untouched (same registered child, same
// parameter names); only the call path changes.

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <tuple>

#include "internal.h"
#include "pipemat/core/error.h"
#include "pipemat/remat/any_module.h"
#include "pipemat/remat/wrappers.h"

namespace pipemat::remat {
namespace {

// Note [AnyModule content access]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// AnyModule exposes no way to install a custom erased callee. Explicit template instantiation
// may name private members (C++17 [temp.explicit]/14), which gives one well-defined access path
// to the private `AnyModule::content_` (a unique_ptr<AnyModulePlaceholder>); this file is the
// only user. It relies on two details of LibTorch: that private member's name and type, and
// AnyModulePlaceholder's virtuals (forward, ptr, copy, clone_module), which RegionPlaceholder
// overrides. Both are the same in every LibTorch the configure step accepts (2.11 to 2.15, Note
// [Finding LibTorch] in cmake/PipematTorch.cmake); check them before widening that range.
// Nothing else in pipemat reaches into LibTorch privates this way.
using ContentPtr = std::unique_ptr<torch::nn::AnyModulePlaceholder> torch::nn::AnyModule::*;
struct ContentTag {
  friend ContentPtr content_member(ContentTag);
};
template <ContentPtr Member>
struct ContentAccess {
  friend ContentPtr content_member(ContentTag) { return Member; }
};
template struct ContentAccess<&torch::nn::AnyModule::content_>;

std::unique_ptr<torch::nn::AnyModulePlaceholder>& content_of(torch::nn::AnyModule& any) {
  return any.*content_member(ContentTag{});
}

// --- AnyValue <-> IValue ----------------------------------------------------------------------
// Types with an exact IValue form convert to it (their tensors become visible leaves); anything
// else travels as an opaque capsule holding the AnyValue itself.

struct AnyBox : torch::CustomClassHolder {
  explicit AnyBox(torch::nn::AnyValue v) : value(std::move(v)) {}
  torch::nn::AnyValue value;
};

using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

c10::IValue any_to_ivalue(torch::nn::AnyValue&& v) {
  if (auto* t = v.try_get<at::Tensor>()) return *t;
  if (auto* t = v.try_get<std::vector<at::Tensor>>()) return to_ivalue(*t);
  if (auto* t = v.try_get<T2>()) return to_ivalue(*t);
  if (auto* t = v.try_get<T3>()) return to_ivalue(*t);
  return c10::IValue::make_capsule(c10::make_intrusive<AnyBox>(std::move(v)));
}

torch::nn::AnyValue ivalue_to_any(const c10::IValue& v) {
  if (v.isCapsule()) {
    auto box = c10::static_intrusive_pointer_cast<AnyBox>(v.toCapsule());
    return box->value;
  }
  if (v.isTensor()) return torch::nn::AnyValue(v.toTensor());
  if (v.isTensorList()) return torch::nn::AnyValue(v.toTensorVector());
  if (v.isTuple()) {
    const auto n = v.toTupleRef().elements().size();
    if (n == 2) return torch::nn::AnyValue(from_ivalue<T2>(v));
    if (n == 3) return torch::nn::AnyValue(from_ivalue<T3>(v));
  }
  PIPEMAT_THROW(InternalError, "AnyModule region: cannot convert value back to AnyValue");
}

class RegionPlaceholder final : public torch::nn::AnyModulePlaceholder {
 public:
  RegionPlaceholder(torch::nn::AnyModule inner, std::shared_ptr<RegionSlot> slot)
      : torch::nn::AnyModulePlaceholder(inner.type_info()),
        inner_(std::move(inner)),
        slot_(std::move(slot)) {}

  torch::nn::AnyValue forward(std::vector<torch::nn::AnyValue>&& arguments) override {
    const auto kind = slot_->kind();
    if (kind == RegionSlot::Kind::kPlain ||
        (kind == RegionSlot::Kind::kSave && !inside_checkpoint_unit())) {
      return content_of(inner_)->forward(std::move(arguments));
    }
    std::vector<c10::IValue> values;
    values.reserve(arguments.size());
    for (auto& a : arguments) values.push_back(any_to_ivalue(std::move(a)));
    torch::nn::AnyModule inner = inner_;  // shares the module; kept alive by the body
    RegionBody body = [inner](const std::vector<c10::IValue>& args) mutable {
      std::vector<torch::nn::AnyValue> any_args;
      any_args.reserve(args.size());
      for (const auto& a : args) any_args.push_back(ivalue_to_any(a));
      return any_to_ivalue(content_of(inner)->forward(std::move(any_args)));
    };
    return ivalue_to_any(run_region(*slot_, std::move(values), std::move(body)));
  }

  std::shared_ptr<torch::nn::Module> ptr() override { return inner_.ptr(); }

  std::unique_ptr<torch::nn::AnyModulePlaceholder> copy() const override {
    return std::make_unique<RegionPlaceholder>(inner_, slot_);
  }

  std::unique_ptr<torch::nn::AnyModulePlaceholder> clone_module(
      c10::optional<torch::Device> device) const override {
    torch::nn::AnyModule cloned = inner_.clone(device);
    auto slot = slot_for(cloned.ptr(), /*interceptable=*/true);
    *slot = *slot_;
    return std::make_unique<RegionPlaceholder>(std::move(cloned), std::move(slot));
  }

  const torch::nn::AnyModule& inner() const { return inner_; }

 private:
  torch::nn::AnyModule inner_;
  std::shared_ptr<RegionSlot> slot_;
};

}  // namespace

std::shared_ptr<RegionSlot> make_any_module_region(torch::nn::AnyModule& module) {
  PIPEMAT_CHECK(!module.is_empty(), RematError,
                "cannot wrap an empty torch::nn::AnyModule; assign a module to it first");
  auto& content = content_of(module);
  if (auto* region = dynamic_cast<RegionPlaceholder*>(content.get())) {
    return slot_for(region->inner().ptr(), /*interceptable=*/true);
  }
  auto slot = slot_for(module.ptr(), /*interceptable=*/true);
  torch::nn::AnyModule inner;
  content_of(inner) = std::move(content);
  content = std::make_unique<RegionPlaceholder>(std::move(inner), slot);
  return slot;
}

torch::nn::AnyModule checkpoint_wrapper(const torch::nn::AnyModule& module,
                                        const CheckpointOptions& options) {
  torch::nn::AnyModule out = module;
  make_any_module_region(out)->declare_checkpoint(options);
  return out;
}

torch::nn::AnyModule checkpoint_exclude_wrapper(const torch::nn::AnyModule& module,
                                                const SaveRegionOptions& options) {
  torch::nn::AnyModule out = module;
  make_any_module_region(out)->declare_save(options);
  return out;
}

}  // namespace pipemat::remat
