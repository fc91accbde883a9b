#include "pipemat/remat/region.h"

#include <c10/core/GradMode.h>

#include <atomic>

#include "counters.h"
#include "hooks.h"
#include "internal.h"
#include "overhead_clock.h"
#include "pipemat/core/error.h"
#include "pipemat/remat/values.h"

namespace pipemat::remat {

uint64_t RegionSlot::next_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

void RegionSlot::declare_checkpoint(const CheckpointOptions& options) {
  PIPEMAT_CHECK(kind_ != Kind::kSave, RematError, "'", *name_,
                "' is already a SAVE region (checkpoint_exclude_wrapper); it cannot also be a "
                "checkpoint unit. Remove one of the two declarations");
  kind_ = Kind::kCheckpoint;
  checkpoint_ = options;
  if (!options.name.empty()) set_name(options.name);
}

void RegionSlot::declare_save(const SaveRegionOptions& options) {
  PIPEMAT_CHECK(kind_ != Kind::kCheckpoint, RematError, "'", *name_,
                "' is already a checkpoint unit (checkpoint_wrapper); it cannot also be a SAVE "
                "region. Remove one of the two declarations");
  PIPEMAT_CHECK(
      kind_ != Kind::kSave || save_.save_output == options.save_output, RematError, "'", *name_,
      "' is already a SAVE region with save_output = ", save_.save_output ? "true" : "false",
      "; it cannot also be declared with "
      "save_output = ",
      options.save_output ? "true" : "false");
  kind_ = Kind::kSave;
  save_ = options;
  if (!options.name.empty()) set_name(options.name);
}

void RegionSlot::reset() {
  kind_ = Kind::kPlain;
  checkpoint_ = {};
  save_ = {};
}

bool inside_checkpoint_unit() {
  const auto* ctx = detail::current_context();
  return ctx != nullptr && ctx->kind != detail::ContextKind::kSaveBody;
}

namespace detail {
namespace {

// SAVE body: a saved tensor that is (a verifiable view of) a RECOMPUTE-sourced direct input of
// the region becomes a slot that replay fills (docs/remat.md); every other saved tensor is kept for
// real (detached, so a saved output does not own its grad_fn) with its version, checked at
// unpack (Note [Saved tensor hooks in pure C++]).
class SaveHooks final : public torch::autograd::SavedVariableHooks {
 public:
  SaveHooks(std::shared_ptr<Invocation> inv, SaveEntry* entry,
            std::shared_ptr<const std::string> region)
      : inv_(std::move(inv)), entry_(entry), region_(std::move(region)) {}
  ~SaveHooks() override {
    if (slot_ >= 0) inv_->slot_released(slot_);
  }
  void call_pack_hook(const at::Tensor& tensor) override {
    RematCode remat_code;
    if (!entry_->inputs.empty()) {
      slot_ = inv_->try_rederive(*entry_, tensor);
      if (slot_ >= 0) {
        entry_ = nullptr;  // the entry may be released before this handle
        return;
      }
    }
    kept_ = tensor.detach();
    version_ = static_cast<uint32_t>(kept_._version());
    if (kept_.has_storage()) entry_->kept.push_back(kept_.storage().getWeakStorageImpl());
    entry_ = nullptr;
    bump(Counter::kSaveKept);
  }
  at::Tensor call_unpack_hook() override {
    RematCode remat_code;
    if (slot_ >= 0) return inv_->unpack_slot(slot_);
    const auto now = static_cast<uint32_t>(kept_._version());
    PIPEMAT_CHECK(now == version_, RematError,
                  "one of the tensors saved for backward by SAVE "
                  "region '",
                  *region_, "' in ", inv_->where(), ", ", describe_tensor(kept_),
                  ", has been modified by an inplace operation: it is at version ", now,
                  "; expected version ", version_,
                  " instead. Clone the tensor before modifying it in place (phase: ",
                  phase_name(PhaseScope::current_backward_phase()), ")");
    return kept_;
  }

 private:
  std::shared_ptr<Invocation> inv_;
  SaveEntry* entry_;
  int64_t slot_ = -1;
  at::Tensor kept_;
  uint32_t version_ = 0;
  std::shared_ptr<const std::string> region_;
};

class SaveFactory final : public HookFactory {
 public:
  SaveFactory(std::shared_ptr<Invocation> inv, SaveEntry* entry,
              std::shared_ptr<const std::string> where)
      : inv_(std::move(inv)), entry_(entry), where_(std::move(where)) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> make() override {
    return std::make_unique<SaveHooks>(inv_, entry_, where_);
  }

 private:
  std::shared_ptr<Invocation> inv_;
  SaveEntry* entry_;
  std::shared_ptr<const std::string> where_;
};

c10::IValue run_unit(const RegionSlot& slot, std::vector<c10::IValue> args, RegionBody body) {
  const Context* ctx = current_context();
  if (ctx != nullptr) {
    PIPEMAT_THROW(RematError, "checkpoint unit '", slot.name(), "' was called inside ",
                  ctx->kind == ContextKind::kSaveBody ? "a SAVE region of " : "",
                  ctx->invocation->where(),
                  ": nested checkpoint units are not supported. Declare only the outer or only "
                  "the inner module as a checkpoint unit");
  }
  if (!c10::GradMode::is_enabled()) {
    // Nothing will be saved for backward: no hooks, no invocation, no replay.
    UserCode user;
    return body(args);
  }
  std::shared_ptr<InvocationGroup> group;
  InvocationId id = next_invocation_id(&group);
  auto inv = std::make_shared<Invocation>(std::move(id), slot, std::move(body), std::move(args));
  c10::IValue out = inv->run_forward();
  if (group) join_group(*group, inv);
  return out;
}

// Forward of a SAVE region inside a checkpoint unit: run the body once, keep what its own
// backward saves, cache its output (or its leaf count) in the invocation.
c10::IValue run_save_forward(Invocation& inv, const RegionSlot& slot,
                             const std::vector<c10::IValue>& args, const RegionBody& body) {
  SaveEntry& entry = inv.new_save_entry(slot);
  entry.save_output = slot.save_options().save_output;
  inv.record_save_inputs(entry, args);
  c10::IValue out;
  {
    SaveFactory factory(inv.shared_from_this(), &entry, slot.shared_name());
    HookScope hooks(&factory);
    ContextGuard context(ContextKind::kSaveBody, &inv);
    UserCode user;
    out = body(args);
  }
  bump(Counter::kSaveCalls);
  if (inv.options().preserve_rng_state) entry.modes_after.rng = cpu_rng_state();
  entry.modes_after.autocast = current_autocast();  // Note [Autocast in replay]
  if (entry.save_output) {
    entry.cached_output = map_tensor_leaves(out, [&](const at::Tensor& t) {
      entry.output_requires_grad.push_back(t.requires_grad());
      return t.detach();
    });
  } else {
    entry.leaf_count = count_tensor_leaves(out);
    bump(Counter::kOutputLeaves, entry.leaf_count);
  }
  inv.note_save_output(entry, out);
  if (!entry.slots.empty()) {
    // Replay must reach this region to fill its slots even when nothing after it saves a
    // tensor: a marker in the handle sequence keeps early stop from ending replay before it.
    entry.has_marker = true;
    inv.register_marker();
  }
  return out;
}

// Replay of a SAVE region: the body is skipped; the cached output is handed on with the
// requires_grad it had, so the RECOMPUTE ops after it record the same saved tensors as in
// forward (Note [Replay RNG alignment] and Note [Autocast in replay]: the generator and autocast
// are moved to where the body left them).
c10::IValue run_save_replay(Invocation& inv, const RegionSlot& slot,
                            const std::vector<c10::IValue>& args) {
  SaveEntry& entry = inv.next_replay_entry(slot);
  bump(Counter::kSaveSkips);
  inv.fill_slots(entry, args);
  if (entry.modes_after.rng) set_cpu_rng_state(*entry.modes_after.rng);
  set_autocast(entry.modes_after.autocast);  // Note [Autocast in replay]
  if (entry.has_marker) inv.on_replay_marker();
  if (!entry.save_output) return inv.make_placeholders(entry);
  size_t leaf = 0;
  return map_tensor_leaves(entry.cached_output, [&](const at::Tensor& t) {
    if (!entry.output_requires_grad[leaf++]) return t;
    return t.detach().requires_grad_(true).view_as(t);
  });
}

}  // namespace
}  // namespace detail

c10::IValue run_region(const RegionSlot& slot, std::vector<c10::IValue> args, RegionBody body) {
  detail::RematCode remat_code;
  switch (slot.kind()) {
    case RegionSlot::Kind::kPlain: {
      detail::UserCode user;
      return body(args);
    }
    case RegionSlot::Kind::kCheckpoint:
      return detail::run_unit(slot, std::move(args), std::move(body));
    case RegionSlot::Kind::kSave: {
      const detail::Context* ctx = detail::current_context();
      // Outside a unit a SAVE wrapper is transparent; inside another SAVE body it is inert.
      if (ctx == nullptr || ctx->kind == detail::ContextKind::kSaveBody) {
        detail::UserCode user;
        return body(args);
      }
      if (ctx->kind == detail::ContextKind::kUnitForward) {
        return detail::run_save_forward(*ctx->invocation, slot, args, body);
      }
      return detail::run_save_replay(*ctx->invocation, slot, args);
    }
  }
  return body(args);
}

void run_typed_region(const RegionSlot& slot,
                      c10::function_ref<RegionBody(std::vector<c10::IValue>& args)> prepare,
                      c10::function_ref<void(const c10::IValue& result)> finish) {
  detail::RematCode remat_code;
  std::vector<c10::IValue> args;
  RegionBody body = prepare(args);
  finish(run_region(slot, std::move(args), std::move(body)));
}

}  // namespace pipemat::remat
