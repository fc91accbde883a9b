#include "pipemat/remat/containers.h"

namespace pipemat::remat {

void ModuleList::sync() {
  if (!list_) {
    refs_.clear();
    return;
  }
  if (refs_.size() == list_->size()) return;
  refs_.clear();
  refs_.reserve(list_->size());
  for (size_t i = 0; i < list_->size(); ++i) refs_.emplace_back(list_->ptr(i));
}

ModuleRef ModuleDict::operator[](const std::string& key) const {
  PIPEMAT_CHECK(dict_ != nullptr, RematError, "ModuleDict is empty (nullptr)");
  PIPEMAT_CHECK(dict_->contains(key), RematError, "ModuleDict has no key '", key, "'");
  return ModuleRef((*dict_)[key]);
}

void bind_module_dict(const std::shared_ptr<torch::nn::ModuleDictImpl>& dict) {
  for (const auto& module : dict->values()) slot_for(module, /*interceptable=*/true);
}

}  // namespace pipemat::remat
