// Invocation's SAVE-region path (docs/remat.md): recording a region's inputs and outputs, the
// placeholders of save_output=false regions (Note [Placeholder leaf count]), fallbacks, and the
// rederivation slots that replay fills and backward unpacks.

#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "counters.h"
#include "internal.h"
#include "pipemat/core/error.h"
#include "pipemat/remat/region.h"
#include "pipemat/remat/values.h"

namespace pipemat::remat {

namespace {
std::atomic<bool> g_rederivation{true};
}  // namespace

void set_rederivation_enabled(bool enabled) { g_rederivation.store(enabled); }
bool rederivation_enabled() { return g_rederivation.load(); }

namespace detail {

void Invocation::record_save_inputs(SaveEntry& entry, const std::vector<c10::IValue>& args) {
  const bool enabled = g_rederivation.load(std::memory_order_relaxed);
  for (size_t i = 0; i < args.size(); ++i) {
    for_each_tensor_leaf(args[i], "args[" + std::to_string(i) + "]",
                         [&](const std::string& path, const at::Tensor& t) {
                           InputRecord rec;
                           rec.path = path;
                           rec.dtype = t.scalar_type();
                           rec.sizes = t.sizes().vec();
                           rec.strides = t.strides().vec();
                           rec.offset = t.storage_offset();
                           rec.version = static_cast<uint32_t>(t._version());
                           rec.counter = t.unsafeGetTensorImpl()->version_counter();
                           rec.grad_fn = t.grad_fn().get();
                           rec.output_nr = static_cast<uint32_t>(t.output_nr());
                           if (t.has_storage()) {
                             rec.storage = t.storage().unsafeGetStorageImpl();
                             rec.storage_ref.emplace(t.storage().getWeakStorageImpl());
                             rec.storage_nbytes = static_cast<int64_t>(t.storage().nbytes());
                           }
                           auto contains = [&](const std::vector<const c10::StorageImpl*>& v) {
                             return std::find(v.begin(), v.end(), rec.storage) != v.end();
                           };
                           if (rec.storage != nullptr && contains(unit_input_storages_)) {
                             rec.reason = Fallback::kUnitInput;
                           } else if (rec.storage != nullptr && contains(save_output_storages_)) {
                             rec.reason = Fallback::kSaveSourced;
                           } else if (rec.storage == nullptr || t.grad_fn() == nullptr) {
                             rec.reason = Fallback::kLeaf;
                           } else if (!enabled) {
                             rec.reason = Fallback::kDisabled;
                           } else {
                             rec.rederivable = true;
                             entry.any_rederivable = true;
                           }
                           entry.inputs.push_back(std::move(rec));
                         });
  }
}

void Invocation::note_save_output(const SaveEntry& entry, const c10::IValue& output) {
  for_each_tensor_leaf(output, "", [&](const std::string&, const at::Tensor& t) {
    if (!t.has_storage()) return;
    save_output_storages_.push_back(t.storage().unsafeGetStorageImpl());
    if (!entry.save_output) {
      no_cache_outputs_.emplace_back(t.storage().unsafeGetStorageImpl(), entry.name);
    }
  });
}

const at::Tensor& placeholder_tensor() {
  static const at::Tensor placeholder = at::empty({0});
  return placeholder;
}

bool is_placeholder(const at::Tensor& t) {
  return t.defined() && t.has_storage() &&
         t.storage().unsafeGetStorageImpl() ==
             placeholder_tensor().storage().unsafeGetStorageImpl();
}

c10::IValue Invocation::make_placeholders(const SaveEntry& entry) {
  bump(Counter::kPlaceholders, entry.leaf_count);
  auto one = [&] {
    at::Tensor p = placeholder_tensor().detach();
    placeholders_.emplace_back(p.unsafeGetTensorImpl(), entry.name);
    return p;
  };
  if (entry.leaf_count == 0) return c10::IValue();
  if (entry.leaf_count == 1) return one();
  c10::List<at::Tensor> list;
  for (int64_t i = 0; i < entry.leaf_count; ++i) list.push_back(one());
  return list;
}

void Invocation::check_unit_output(const c10::IValue& output) const {
  if (no_cache_outputs_.empty()) return;
  for_each_tensor_leaf(output, "output", [&](const std::string& path, const at::Tensor& t) {
    if (!t.has_storage()) return;
    for (const auto& [storage, region] : no_cache_outputs_) {
      PIPEMAT_CHECK(storage != t.storage().unsafeGetStorageImpl(), RematError, where(),
                    " returns (as ", path, ") the output of SAVE region '", region,
                    "', which has save_output = false: replay would only have a placeholder "
                    "for it. The last SAVE region of a chain keeps save_output = true (phase: "
                    "forward)");
    }
  });
}

void Invocation::note_fallback(Fallback reason, const InputRecord& input, const SaveEntry& entry) {
  ++fallbacks_[static_cast<size_t>(reason)];
  if (trace_enabled()) {
    trace_line(concat("fallback ", fallback_name(reason), ": SAVE region '", entry.name, "' keeps ",
                      input.path, " (", where(), ")"));
  }
}

namespace {

// The element-offset range [lo, hi] a layout touches (strides must be non-negative).
bool footprint(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
               int64_t offset, int64_t* lo, int64_t* hi) {
  *lo = offset;
  *hi = offset;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (strides[d] < 0) return false;
    if (sizes[d] == 0) {
      *hi = offset - 1;  // empty
      return true;
    }
    *hi += (sizes[d] - 1) * strides[d];
  }
  return true;
}

// A contiguous layout of `numel` elements.
bool contiguous(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                int64_t numel) {
  int64_t expected = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return expected == numel;
}

}  // namespace

int64_t Invocation::try_rederive(SaveEntry& entry, const at::Tensor& saved) {
  if (!saved.has_storage()) return -1;
  const c10::StorageImpl* storage = saved.storage().unsafeGetStorageImpl();
  for (size_t i = 0; i < entry.inputs.size(); ++i) {
    const InputRecord& rec = entry.inputs[i];
    if (rec.storage != storage) continue;
    if (!rec.rederivable) {
      note_fallback(rec.reason, rec, entry);
      return -1;
    }
    if (saved.scalar_type() != rec.dtype) {
      note_fallback(Fallback::kDtype, rec, entry);
      return -1;
    }
    if (static_cast<uint32_t>(saved._version()) != rec.version) {
      note_fallback(Fallback::kInplace, rec, entry);
      return -1;
    }
    const bool exact = saved.sizes().vec() == rec.sizes && saved.strides().vec() == rec.strides &&
                       saved.storage_offset() == rec.offset;
    if (!exact) {
      int64_t lo, hi, in_lo, in_hi;
      const bool ok =
          footprint(saved.sizes().vec(), saved.strides().vec(), saved.storage_offset(), &lo, &hi) &&
          footprint(rec.sizes, rec.strides, rec.offset, &in_lo, &in_hi) &&
          (hi < lo || (lo >= in_lo && hi <= in_hi));
      if (!ok) {
        note_fallback(Fallback::kView, rec, entry);
        return -1;
      }
    }
    return add_slot(entry, i, saved, exact, at::ScalarType::Undefined);
  }
  return try_rederive_cast(entry, saved);
}

int64_t Invocation::add_slot(SaveEntry& entry, size_t input, const at::Tensor& saved, bool exact,
                             at::ScalarType cast) {
  const InputRecord& rec = entry.inputs[input];
  SlotRecipe slot;
  slot.region = entry.name;
  slot.input_path = rec.path;
  slot.input = input;
  slot.sizes = saved.sizes().vec();
  slot.strides = saved.strides().vec();
  slot.relative_offset = saved.storage_offset() - rec.offset;
  slot.exact = exact;
  slot.cast = cast;
  slot.version = saved.unsafeGetTensorImpl()->version_counter();
  slot.saved_version = slot.version.current_version();
  slots_.push_back(std::move(slot));
  const auto index = static_cast<int64_t>(slots_.size()) - 1;
  entry.slots.push_back(index);
  if (trace_enabled()) {
    trace_line(concat("rederive: SAVE region '", entry.name, "' saves ", rec.path,
                      cast != at::ScalarType::Undefined ? " (a cast)"
                      : exact                           ? ""
                                                        : " (a view)",
                      " as slot #", index, ", ", describe_tensor(saved), " not kept (", where(),
                      ")"));
  }
  return index;
}

// Note [Rederived casts]
// ~~~~~~~~~~~~~~~~~~~~~~
// Under autocast a SAVE region's GEMM does not save its float32 input but autocast's cast of
// it to bf16: another tensor, so no alias of the input, and it would be kept. Such a saved
// tensor is known by its autograd node: a copy (ToCopyBackward0) whose one edge is the gradient
// edge of a rederivable input, with the input's sizes and strides (a cast of the whole input),
// taken while the input was at its recorded version. Replay rederives it by the same recipe
// plus the cast: the replayed input converted to that dtype, bit for bit the forward's cast.
// A GEMM on a 3-d input (at::linear on [batch, tokens, hidden]) saves a [rows, hidden] view of
// the cast instead: a view node (ViewBackward0, UnsafeViewBackward0) over the cast's node. When
// the input is contiguous and the view is all of the cast, contiguous from its start, replay
// casts the replayed input and views it with the saved sizes: the same bits again.
int64_t Invocation::try_rederive_cast(SaveEntry& entry, const at::Tensor& saved) {
  // The node types by dynamic_cast, not Node::name(), which demangles a string on every call
  // (this runs in the pack hook of every saved tensor no storage matched).
  namespace generated = torch::autograd::generated;
  auto node = saved.grad_fn();
  bool viewed = false;
  if (node != nullptr && node->next_edges().size() == 1 &&
      (dynamic_cast<generated::ViewBackward0*>(node.get()) != nullptr ||
       dynamic_cast<generated::UnsafeViewBackward0*>(node.get()) != nullptr)) {
    const torch::autograd::Edge& base = node->next_edge(0);
    if (!base.is_valid()) return -1;
    node = base.function;
    viewed = true;
  }
  if (node == nullptr || dynamic_cast<generated::ToCopyBackward0*>(node.get()) == nullptr) {
    return -1;
  }
  const torch::autograd::Edge& edge = node->next_edge(0);
  if (!edge.is_valid()) return -1;
  for (size_t i = 0; i < entry.inputs.size(); ++i) {
    const InputRecord& rec = entry.inputs[i];
    if (rec.grad_fn != edge.function.get() || rec.output_nr != edge.input_nr) continue;
    if (!rec.rederivable) {
      note_fallback(rec.reason, rec, entry);
      return -1;
    }
    if (rec.counter.current_version() != rec.version) {
      note_fallback(Fallback::kInplace, rec, entry);
      return -1;
    }
    const bool whole = viewed ? saved.is_contiguous() && saved.storage_offset() == 0 &&
                                    contiguous(rec.sizes, rec.strides, saved.numel())
                              : saved.sizes().vec() == rec.sizes &&
                                    saved.strides().vec() == rec.strides &&
                                    saved.storage_offset() == 0;
    if (!whole) {
      note_fallback(Fallback::kView, rec, entry);
      return -1;
    }
    return add_slot(entry, i, saved, /*exact=*/!viewed, saved.scalar_type());
  }
  return -1;
}

void Invocation::fill_slots(SaveEntry& entry, const std::vector<c10::IValue>& args) {
  if (entry.slots.empty()) return;
  std::vector<std::pair<std::string, at::Tensor>> leaves;
  for (size_t i = 0; i < args.size(); ++i) {
    for_each_tensor_leaf(
        args[i], "args[" + std::to_string(i) + "]",
        [&](const std::string& path, const at::Tensor& t) { leaves.emplace_back(path, t); });
  }
  for (int64_t index : entry.slots) {
    SlotRecipe& slot = slots_[index];
    const InputRecord& rec = entry.inputs[slot.input];
    const at::Tensor* replayed = nullptr;
    for (const auto& [path, t] : leaves) {
      if (path == rec.path) replayed = &t;
    }
    PIPEMAT_CHECK(replayed != nullptr, RematError, "SAVE region '", entry.name, "' in ", where(),
                  ": input ", rec.path,
                  " was a tensor in forward but is missing in replay; "
                  "forward and replay must pass the same inputs (phase: replay)");
    const at::Tensor& t = *replayed;
    PIPEMAT_CHECK(t.scalar_type() == rec.dtype && t.sizes().vec() == rec.sizes &&
                      t.strides().vec() == rec.strides && t.storage_offset() == rec.offset,
                  RematError, "SAVE region '", entry.name, "' in ", where(), ": input ", rec.path,
                  " has a different layout in replay (", c10::toString(t.scalar_type()), " ",
                  t.sizes(), " strides ", t.strides(), " offset ", t.storage_offset(),
                  ") than in forward (", c10::toString(rec.dtype), " ", c10::IntArrayRef(rec.sizes),
                  " strides ", c10::IntArrayRef(rec.strides), " offset ", rec.offset,
                  "); its saved data was not kept, so backward cannot proceed (phase: replay)");
    if (!slot.alive) continue;
    at::Tensor base = t.detach();
    if (slot.cast != at::ScalarType::Undefined) {
      // Note [Rederived casts]: the whole input cast, then, for a view of the cast, viewed.
      slot.value = base.to(slot.cast);
      if (!slot.exact) slot.value = slot.value.view(slot.sizes);
    } else {
      slot.value = slot.exact ? base
                              : base.as_strided(slot.sizes, slot.strides,
                                                base.storage_offset() + slot.relative_offset);
    }
    slot.consumed = false;
    if (trace_enabled()) {
      trace_line(concat("fill slot #", index, " of SAVE region '", entry.name, "' from replayed ",
                        rec.path, " (", where(), ")"));
    }
  }
}

at::Tensor Invocation::unpack_slot(int64_t index) {
  const Phase phase = PhaseScope::current_backward_phase();
  PIPEMAT_INTERNAL_ASSERT(index >= 0 && index < static_cast<int64_t>(slots_.size()));
  PIPEMAT_CHECK(!released_, RematError, where(),
                " was released before the backward of SAVE "
                "region '",
                slots_[index].region, "' used its rederived input ", slots_[index].input_path,
                " (phase: ", phase_name(phase),
                "); release an invocation group only after its last backward (B, or W)");
  if (!replayed_) check_inputs_unchanged();
  {
    const SlotRecipe& slot = slots_[index];
    const uint32_t now = slot.version.current_version();
    PIPEMAT_CHECK(now == slot.saved_version, RematError, "input ", slot.input_path,
                  " of SAVE region '", slot.region, "' in ", where(),
                  ", saved for backward, has been modified by an inplace operation: it is at "
                  "version ",
                  now, "; expected version ", slot.saved_version,
                  " instead. Clone it before modifying it (phase: ", phase_name(phase), ")");
  }
  ensure_replayed_for_unpack(replayed_ && slots_[index].consumed);
  SlotRecipe& slot = slots_[index];
  PIPEMAT_INTERNAL_ASSERT(slot.value.defined(), "replay did not fill slot #", index, " (",
                          slot.input_path, " of SAVE region '", slot.region, "') of ", where());
  at::Tensor value = slot.value;
  if (!retained_) {
    slot.value = at::Tensor();
    slot.consumed = true;
  }
  if (trace_enabled()) {
    trace_line(concat("unpack slot #", index, " of SAVE region '", slot.region, "' (", where(),
                      ", phase: ", phase_name(phase), ")"));
  }
  return value;
}

void Invocation::slot_released(int64_t index) noexcept {
  if (index < 0 || index >= static_cast<int64_t>(slots_.size())) return;
  slots_[index].alive = false;
  slots_[index].value = at::Tensor();
}

}  // namespace detail
}  // namespace pipemat::remat
