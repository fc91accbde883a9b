#pragma once
// ModuleList and ModuleDict whose children can be declared checkpoint units or SAVE regions.
//
// LibTorch forwards call list children statically (`layers[i]->as<Block>()->forward(x)`), so a
// child cannot be rerouted inside a torch::nn::ModuleList. Declaring the member with the pipemat
// type instead is a one-line change of the member declaration; forward code written in the usual
// forms keeps compiling and now consults each child's declaration:
//
//   pipemat::remat::ModuleList layers{nullptr};       // was: torch::nn::ModuleList layers;
//   layers = register_module("layers", torch::nn::ModuleList(Block(8), Block(8)));
//   for (auto& layer : *layers) x = layer->as<Block>()->forward(x);
//   x = layers[0]->as<Block>()->forward(x);
//
// `as<T>()` returns a ModuleCall<T>, not a raw pointer: `->forward(...)` (or `(...)`) runs the
// child as declared, `.get()` gives the raw module for anything else. The module tree is the
// underlying torch::nn::ModuleList / ModuleDict, unchanged.

#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <memory>
#include <string>
#include <vector>

#include "pipemat/remat/wrappers.h"

namespace pipemat::remat {

// A typed call handle of one child.
template <typename Impl>
class ModuleCall {
 public:
  ModuleCall(std::shared_ptr<Impl> module, std::shared_ptr<RegionSlot> slot)
      : module_(std::move(module)), slot_(std::move(slot)) {}
  template <typename... Args>
  auto forward(Args&&... args) const {
    std::shared_ptr<Impl> impl = module_;
    auto fn = [impl](auto&&... a) { return impl->forward(std::forward<decltype(a)>(a)...); };
    return detail::invoke(*slot_, fn, std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) const {
    return forward(std::forward<Args>(args)...);
  }
  const ModuleCall* operator->() const { return this; }
  Impl* get() const { return module_.get(); }
  explicit operator bool() const { return module_ != nullptr; }

 private:
  std::shared_ptr<Impl> module_;
  std::shared_ptr<RegionSlot> slot_;
};

// One child of a pipemat ModuleList / ModuleDict.
class ModuleRef {
 public:
  explicit ModuleRef(std::shared_ptr<torch::nn::Module> module)
      : module_(std::move(module)), slot_(slot_for(module_, /*interceptable=*/true)) {}

  // `ref->as<Block>()` (holder type) or `ref->as<BlockImpl>()`; throws RematError when the child
  // has another type.
  template <typename T>
  auto as() const {
    using Impl = typename detail::ImplOf<T>::type;
    auto typed = std::dynamic_pointer_cast<Impl>(module_);
    PIPEMAT_CHECK(typed != nullptr, RematError, "module '", module_->name(),
                  "' is not of the requested type");
    return ModuleCall<Impl>(std::move(typed), slot_);
  }
  const ModuleRef* operator->() const { return this; }
  const std::shared_ptr<torch::nn::Module>& ptr() const { return module_; }
  RegionSlot& slot() const { return *slot_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<RegionSlot> slot_;
};

// Drop-in for torch::nn::ModuleList members (see the file comment).
// Marks every child of a ModuleDict as called through pipemat (done when a pipemat ModuleDict is
// assigned, so apply_policy can declare the children before the first forward).
void bind_module_dict(const std::shared_ptr<torch::nn::ModuleDictImpl>& dict);

class ModuleList {
 public:
  ModuleList(std::nullptr_t) {}                                                  // NOLINT
  ModuleList(const torch::nn::ModuleList& list) : list_(list.ptr()) { sync(); }  // NOLINT
  ModuleList(std::shared_ptr<torch::nn::ModuleListImpl> list)                    // NOLINT
      : list_(std::move(list)) {
    sync();
  }
  ModuleList& operator=(std::shared_ptr<torch::nn::ModuleListImpl> list) {
    list_ = std::move(list);
    sync();
    return *this;
  }
  ModuleList& operator=(const torch::nn::ModuleList& list) { return *this = list.ptr(); }

  ModuleList* operator->() { return this; }
  ModuleList& operator*() { return *this; }
  ModuleRef& operator[](size_t index) {
    sync();
    PIPEMAT_CHECK(index < refs_.size(), RematError, "ModuleList index ", index,
                  " is out of range (size ", refs_.size(), ")");
    return refs_[index];
  }
  template <typename M>
  void push_back(M&& module) {
    list_->push_back(std::forward<M>(module));
    sync();
  }
  size_t size() const { return list_ ? list_->size() : 0; }
  bool is_empty() const { return list_ == nullptr || list_->is_empty(); }
  std::vector<ModuleRef>::iterator begin() {
    sync();
    return refs_.begin();
  }
  std::vector<ModuleRef>::iterator end() { return refs_.end(); }
  std::shared_ptr<torch::nn::Module> ptr(size_t index) const { return list_->ptr(index); }
  const std::shared_ptr<torch::nn::ModuleListImpl>& ptr() const { return list_; }

 private:
  void sync();
  std::shared_ptr<torch::nn::ModuleListImpl> list_;
  std::vector<ModuleRef> refs_;
};

// Drop-in for torch::nn::ModuleDict members: `dict["gemm"]->as<Gemm>()->forward(x)`.
class ModuleDict {
 public:
  ModuleDict(std::nullptr_t) {}                                              // NOLINT
  ModuleDict(const torch::nn::ModuleDict& dict) : ModuleDict(dict.ptr()) {}  // NOLINT
  ModuleDict(std::shared_ptr<torch::nn::ModuleDictImpl> dict)                // NOLINT
      : dict_(std::move(dict)) {
    if (dict_) bind_module_dict(dict_);
  }
  ModuleDict& operator=(std::shared_ptr<torch::nn::ModuleDictImpl> dict) {
    dict_ = std::move(dict);
    if (dict_) bind_module_dict(dict_);
    return *this;
  }
  ModuleDict& operator=(const torch::nn::ModuleDict& dict) { return *this = dict.ptr(); }

  ModuleDict* operator->() { return this; }
  ModuleRef operator[](const std::string& key) const;
  void update(
      const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& items) {
    dict_->update(items);
    bind_module_dict(dict_);
  }
  bool contains(const std::string& key) const { return dict_->contains(key); }
  size_t size() const { return dict_ ? dict_->size() : 0; }
  std::vector<std::string> keys() const { return dict_->keys(); }
  const std::shared_ptr<torch::nn::ModuleDictImpl>& ptr() const { return dict_; }

 private:
  std::shared_ptr<torch::nn::ModuleDictImpl> dict_;
};

}  // namespace pipemat::remat
