// RematReport: fallback names, formatting, sums, and the report of one invocation (memory by
// unique storage, decision counts).

#include <algorithm>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "internal.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/values.h"

namespace pipemat::remat {

const std::vector<std::string>& fallback_names() {
  static const std::vector<std::string> names = {"save_sourced", "unit_input", "leaf",    "inplace",
                                                 "dtype",        "view",       "disabled"};
  return names;
}

int64_t RematReport::fallback_total() const {
  int64_t n = 0;
  for (auto f : fallbacks) n += f;
  return n;
}

std::string RematReport::str() const {
  std::ostringstream os;
  os << "invocations " << invocations << ", handles " << saved_handles << ", SAVE resident "
     << save_resident_bytes << " B, cached outputs " << cached_output_bytes << " B, rederived "
     << rederived_bytes << " B in " << rederived_slots << " slot(s), replayed " << replayed_bytes
     << " B, replay peak " << replay_peak_bytes << " B, replays " << replays << ", early stops "
     << early_stops << ", fallbacks " << fallback_total();
  if (fallback_total() > 0) {
    os << " (";
    bool first = true;
    for (size_t i = 0; i < fallbacks.size(); ++i) {
      if (fallbacks[i] == 0) continue;
      os << (first ? "" : ", ") << fallback_names()[i] << " " << fallbacks[i];
      first = false;
    }
    os << ")";
  }
  return os.str();
}

RematReport& RematReport::operator+=(const RematReport& o) {
  invocations += o.invocations;
  saved_handles += o.saved_handles;
  save_resident_bytes += o.save_resident_bytes;
  cached_output_bytes += o.cached_output_bytes;
  replayed_bytes += o.replayed_bytes;
  rederived_bytes += o.rederived_bytes;
  rederived_slots += o.rederived_slots;
  replay_peak_bytes = std::max(replay_peak_bytes, o.replay_peak_bytes);
  for (size_t i = 0; i < fallbacks.size() && i < o.fallbacks.size(); ++i)
    fallbacks[i] += o.fallbacks[i];
  replays += o.replays;
  early_stops += o.early_stops;
  return *this;
}

namespace detail {

const char* fallback_name(Fallback reason) {
  return fallback_names()[static_cast<size_t>(reason)].c_str();
}

RematReport Invocation::report() const {
  RematReport r;
  r.invocations = 1;
  r.saved_handles = static_cast<int64_t>(std::count_if(
      handles_.begin(), handles_.end(), [](const HandleMeta& m) { return !m.is_marker; }));
  std::vector<at::Tensor> cached;
  for (const auto& [id, fifo] : save_entries_) {
    for (const auto& e : fifo) {
      for_each_tensor_leaf(e.cached_output, "",
                           [&](const std::string&, const at::Tensor& t) { cached.push_back(t); });
    }
  }
  r.cached_output_bytes = storage_bytes(cached);
  std::vector<at::Tensor> replayed = replayed_values_;
  for (const auto& slot : slots_) replayed.push_back(slot.value);
  r.replayed_bytes = storage_bytes(replayed);
  // SAVE-resident bytes: storages kept for the regions' own backward that are still alive and
  // were allocated during this forward (parameters a region saves are not activations).
  std::unordered_set<const c10::StorageImpl*> seen;
  const bool tracked = tracking_allocator_installed();
  for (const auto& [id, fifo] : save_entries_) {
    for (const auto& e : fifo) {
      for (const auto& weak : e.kept) {
        auto storage = weak.lock();
        if (!storage || !seen.insert(storage.get()).second) continue;
        if (tracked && allocation_sequence(storage.get()) < first_allocation_) continue;
        r.save_resident_bytes += static_cast<int64_t>(storage->nbytes());
      }
    }
  }
  std::unordered_set<const c10::StorageImpl*> rederived_storages;
  for (const auto& [id, fifo] : save_entries_) {
    for (const auto& e : fifo) {
      for (int64_t index : e.slots) {
        const SlotRecipe& slot = slots_[index];
        const InputRecord& rec = e.inputs[slot.input];
        ++r.rederived_slots;
        if (slot.cast != at::ScalarType::Undefined) {
          // Note [Rederived casts]: the cast not kept, in its own dtype's bytes.
          int64_t elements = 1;
          for (int64_t d : slot.sizes) elements *= d;
          r.rederived_bytes += elements * static_cast<int64_t>(c10::elementSize(slot.cast));
        } else if (rederived_storages.insert(rec.storage).second) {
          r.rederived_bytes += rec.storage_nbytes;
        }
      }
    }
  }
  r.replay_peak_bytes = replay_peak_bytes_;
  r.fallbacks.assign(fallbacks_.begin(), fallbacks_.end());
  r.replays = replays_;
  r.early_stops = early_stops_;
  return r;
}

}  // namespace detail
}  // namespace pipemat::remat
