// The process-wide table from module instance to its RegionSlot.

#include <mutex>
#include <unordered_map>

#include "pipemat/remat/wrappers.h"

namespace pipemat::remat {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<RegionSlot> slot;
  bool interceptable = false;
};

std::mutex g_mutex;
std::unordered_map<const torch::nn::Module*, Entry> g_slots;

// A dead module's address can be reused by a new module: an entry only counts while its weak
// pointer still points to a live module at that address.
Entry* live_entry(const torch::nn::Module* module) {
  auto it = g_slots.find(module);
  if (it == g_slots.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) {
    g_slots.erase(it);
    return nullptr;
  }
  return &it->second;
}

}  // namespace

std::shared_ptr<RegionSlot> slot_for(const std::shared_ptr<torch::nn::Module>& module,
                                     bool interceptable) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Entry* entry = live_entry(module.get());
  if (entry == nullptr) {
    Entry fresh;
    fresh.module = module;
    fresh.slot = std::make_shared<RegionSlot>(module->name());
    entry = &(g_slots[module.get()] = std::move(fresh));
  }
  entry->interceptable = entry->interceptable || interceptable;
  return entry->slot;
}

std::shared_ptr<RegionSlot> find_slot(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Entry* entry = live_entry(module);
  return entry ? entry->slot : nullptr;
}

bool slot_is_interceptable(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Entry* entry = live_entry(module);
  return entry != nullptr && entry->interceptable;
}

}  // namespace pipemat::remat
