// Invocation's RECOMPUTE path: the unit's forward under the handle hooks, replay (with early
// stop and Note [Replay RNG alignment]), unpack of the handles in backward, and release.

#include <c10/core/GradMode.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "counters.h"
#include "hooks.h"
#include "internal.h"
#include "overhead_clock.h"
#include "pipemat/core/error.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/values.h"
#include "saved_hooks.h"

namespace pipemat::remat::detail {

Invocation::Invocation(InvocationId id, const RegionSlot& unit, RegionBody body,
                       std::vector<c10::IValue> inputs)
    : id_(std::move(id)),
      unit_name_(unit.name()),
      options_(unit.checkpoint_options()),
      body_(std::move(body)),
      inputs_(std::move(inputs)) {}

std::string Invocation::where() const {
  return concat("checkpoint unit '", unit_name_, "' (", id_.str(), ")");
}

c10::IValue Invocation::run_forward() {
  for (size_t i = 0; i < inputs_.size(); ++i) {
    for_each_tensor_leaf(inputs_[i], "args[" + std::to_string(i) + "]",
                         [&](const std::string&, const at::Tensor& t) {
                           const auto& vc = t.unsafeGetTensorImpl()->version_counter();
                           input_versions_.emplace_back(vc, vc.current_version());
                           if (t.has_storage()) {
                             unit_input_storages_.push_back(t.storage().unsafeGetStorageImpl());
                           }
                         });
  }
  std::optional<SharedGeneratorWindow> window;             // Note [Shared generator detection]
  entry_modes_.autocast = current_autocast();              // Note [Autocast in replay]
  const uint64_t layer_streams = layer_streams_entered();  // Note [Layer streams]
  if (options_.preserve_rng_state) {
    window.emplace(*this);
    entry_modes_.rng = cpu_rng_state();
  }
  first_allocation_ = memory_stats().allocations;
  bump(Counter::kUnitCalls);
  c10::IValue out;
  {
    UnitHandleFactory factory(shared_from_this());
    HookScope hooks(&factory);
    ContextGuard context(ContextKind::kUnitForward, this);
    UserCode user;
    out = body_(inputs_);
  }
  if (entry_modes_.rng && layer_streams_entered() == layer_streams &&
      same_rng_state(*entry_modes_.rng, cpu_rng_state())) {
    // Drew nothing: replay leaves the generator alone (Note [Shared generator detection]).
    entry_modes_.rng.reset();
    for (auto& [key, entries] : save_entries_) {
      for (SaveEntry& entry : entries) entry.modes_after.rng.reset();
    }
  }
  if (window) window->close(entry_modes_.rng.has_value());
  check_unit_output(out);
  forward_done_ = true;
  return out;
}

int64_t Invocation::register_handle(const at::Tensor& saved) {
  if (!no_cache_outputs_.empty() && saved.has_storage()) {
    for (const auto& [storage, region] : no_cache_outputs_) {
      PIPEMAT_CHECK(storage != saved.storage().unsafeGetStorageImpl(), RematError,
                    "a RECOMPUTE op in ", where(), " saves the output of SAVE region '", region,
                    "' (", describe_tensor(saved),
                    "), which has save_output = false: replay only has a placeholder for it. "
                    "Pass that output whole to the next SAVE region, or set save_output = true "
                    "(phase: forward)");
    }
  }
  HandleMeta meta;
  meta.dtype = saved.scalar_type();
  meta.sizes = saved.sizes().vec();
  meta.version = saved.unsafeGetTensorImpl()->version_counter();
  meta.saved_version = meta.version.current_version();
  handles_.push_back(std::move(meta));
  bump(Counter::kPacks);
  return static_cast<int64_t>(handles_.size()) - 1;
}

void Invocation::register_marker() {
  HandleMeta meta;
  meta.is_marker = true;
  handles_.push_back(std::move(meta));
}

SaveEntry& Invocation::new_save_entry(const RegionSlot& slot) {
  auto& fifo = save_entries_[slot.id()];
  fifo.emplace_back();
  fifo.back().slot = &slot;
  fifo.back().name = slot.name();
  return fifo.back();
}

void Invocation::check_inputs_unchanged() const {
  size_t k = 0;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    for_each_tensor_leaf(
        inputs_[i], "args[" + std::to_string(i) + "]",
        [&](const std::string& path, const at::Tensor& t) {
          const auto& [counter, version] = input_versions_.at(k++);
          PIPEMAT_CHECK(counter.current_version() == version, RematError, "input ", path, " (",
                        describe_tensor(t), ") of ", where(),
                        " was modified by an inplace operation after the unit's forward: it is "
                        "at version ",
                        counter.current_version(), "; expected version ", version,
                        " instead. Replay needs the inputs as they were; clone the input before "
                        "modifying it (phase: ",
                        phase_name(Phase::kReplay), ")");
        });
  }
}

void Invocation::replay() {
  PIPEMAT_CHECK(!released_, RematError, where(),
                " was released before its backward used it (phase: ",
                phase_name(PhaseScope::current_backward_phase()),
                "); release an invocation group only after its last backward (B, or W)");
  if (replayed_) return;
  PIPEMAT_CHECK(!replaying_, RematError, "recursive replay of ", where());
  PIPEMAT_INTERNAL_ASSERT(forward_done_, "replay before the end of forward of ", where());
  check_inputs_unchanged();
  start_replay();
  if (replay_stop_after_ < 0) {  // nothing to regenerate
    replayed_ = true;
    return;
  }
  const bool stopped_early = run_replay_body();
  finish_replay(stopped_early);
}

void Invocation::start_replay() {
  // Only handles that some SavedVariable still owns need a value; replay may stop right after
  // the last of them (early stop). Markers stand for SAVE regions whose slots replay must fill.
  replay_stop_after_ = -1;
  for (int64_t i = static_cast<int64_t>(handles_.size()) - 1; i >= 0; --i) {
    if (handles_[i].alive || handles_[i].is_marker) {
      replay_stop_after_ = i;
      break;
    }
  }
  replayed_values_.assign(handles_.size(), at::Tensor());
  consumed_.assign(handles_.size(), false);
  for (auto& slot : slots_) {
    slot.value = at::Tensor();
    slot.consumed = false;
  }
  replay_cursor_.clear();
  placeholders_.clear();
  replay_counter_ = 0;
  ++replays_;
  bump(Counter::kReplays);
}

bool Invocation::run_replay_body() {
  std::optional<RngState> rng_outside;
  std::optional<SharedGeneratorWindow> window;  // Note [Shared generator detection]
  if (entry_modes_.rng) {
    window.emplace(*this);
    rng_outside = cpu_rng_state();
    set_cpu_rng_state(*entry_modes_.rng);
  }
  bool stopped_early = false;
  replaying_ = true;
  const int64_t bytes_before = begin_peak_window();
  if (trace_enabled()) trace_line(concat("replay start: ", where()));
  try {
    ReplayRegion region(entry_modes_.autocast);  // Note [Autocast in replay]
    c10::AutoGradMode grad_on(true);
    ReplayFactory factory(this);
    HookScope hooks(&factory);
    ContextGuard context(ContextKind::kUnitReplay, this);
    UserCode user;
    (void)body_(inputs_);
  } catch (const StopReplay&) {
    stopped_early = true;
  } catch (const RematError&) {
    abandon_replay(rng_outside);
    throw;
  } catch (const std::exception& e) {
    abandon_replay(rng_outside);
    if (placeholders_.empty()) throw;
    // Note [Placeholder leaf count]: a placeholder reached an op that reads data.
    PIPEMAT_THROW(RematError, "replay of ", where(), " failed after SAVE region(s) ",
                  placeholder_producers(),
                  " returned placeholders (save_output = false): a "
                  "placeholder must go whole, as one argument, straight into the next SAVE "
                  "region; an op read it instead (phase: replay). The op said: ",
                  e.what());
  }
  replaying_ = false;
  replay_peak_bytes_ = std::max<int64_t>(0, window_peak_bytes() - bytes_before);
  if (rng_outside) set_cpu_rng_state(*rng_outside);
  if (window) window->close(true);
  return stopped_early;
}

void Invocation::finish_replay(bool stopped_early) {
  if (trace_enabled()) {
    trace_line(concat("replay end: ", where(), stopped_early ? " (early stop after #" : " (full, ",
                      replay_counter_, stopped_early ? ")" : " saved)"));
  }
  if (stopped_early) {
    ++early_stops_;
    bump(Counter::kEarlyStops);
  }
  if (!stopped_early && replay_counter_ != static_cast<int64_t>(handles_.size())) {
    replayed_values_.clear();
    replayed_ = false;
    PIPEMAT_THROW(RematError, where(), ": forward saved ", handles_.size(),
                  " tensors for backward but replay saved ", replay_counter_,
                  ". Forward and replay must run the same ops: look for control flow that "
                  "depends on data, on global state or on randomness that is not preserved",
                  placeholder_hint(), " (phase: replay)");
  }
  replayed_ = true;
}

std::string Invocation::placeholder_producers() const {
  std::vector<std::string> names;
  for (const auto& [impl, region] : placeholders_) {
    if (std::find(names.begin(), names.end(), "'" + region + "'") == names.end()) {
      names.push_back("'" + region + "'");
    }
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

std::string Invocation::placeholder_hint() const {
  if (placeholders_.empty()) return "";
  return concat(". Placeholders from SAVE region(s) ", placeholder_producers(),
                " (save_output = false) were handed out in this replay: one was probably read "
                "by an op instead of going whole into the next SAVE region");
}

void Invocation::abandon_replay(const std::optional<RngState>& rng_outside) {
  replaying_ = false;
  replayed_values_.clear();
  for (auto& slot : slots_) slot.value = at::Tensor();
  if (rng_outside) set_cpu_rng_state(*rng_outside);
}

void Invocation::on_replay_pack(const at::Tensor& saved) {
  if (!placeholders_.empty() && is_placeholder(saved)) {
    std::string producer = placeholder_producers();
    for (const auto& [impl, region] : placeholders_) {
      if (impl == saved.unsafeGetTensorImpl()) producer = "'" + region + "'";
    }
    PIPEMAT_THROW(RematError, "a RECOMPUTE op in ", where(),
                  " saves a placeholder returned by SAVE region ", producer,
                  " (save_output = false): the output of such a region must go whole, as one "
                  "argument, straight into the next SAVE region (phase: replay)");
  }
  const int64_t index = replay_counter_++;
  PIPEMAT_CHECK(index < static_cast<int64_t>(handles_.size()), RematError, where(),
                ": replay saved more tensors for backward than forward (", handles_.size(),
                "); forward and replay took different code paths (phase: replay)");
  const HandleMeta& meta = handles_[index];
  PIPEMAT_CHECK(!meta.is_marker, RematError, where(), ": replay saved a tensor (",
                describe_tensor(saved),
                ") where forward passed a SAVE region; forward and "
                "replay took different code paths (phase: replay)");
  PIPEMAT_CHECK(meta.dtype == saved.scalar_type(), RematError, where(), ": saved tensor #", index,
                " is ", describe_tensor(saved), " in replay but was ", c10::toString(meta.dtype),
                " ", c10::IntArrayRef(meta.sizes),
                " in forward: replay computed in another dtype than its forward. Replay runs "
                "under the autocast state of the unit's forward (",
                describe_autocast(entry_modes_.autocast),
                "); an op whose dtype depends on other state (a global, a dtype chosen from data) "
                "differs between the two (phase: replay)");
  PIPEMAT_CHECK(saved.sizes().equals(meta.sizes), RematError, where(), ": saved tensor #", index,
                " is ", describe_tensor(saved), " in replay but was ", c10::toString(meta.dtype),
                " ", c10::IntArrayRef(meta.sizes),
                " in forward; forward and replay must compute the same shapes", placeholder_hint(),
                " (phase: replay)");
  if (meta.alive) replayed_values_[index] = saved;
  if (options_.early_stop && index == replay_stop_after_) throw StopReplay{};
}

void Invocation::on_replay_marker() {
  const int64_t index = replay_counter_++;
  PIPEMAT_CHECK(index < static_cast<int64_t>(handles_.size()) && handles_[index].is_marker,
                RematError, where(),
                ": replay reached a SAVE region at a different point than forward (saved "
                "tensor #",
                index, "); forward and replay took different code paths (phase: replay)");
  if (options_.early_stop && index == replay_stop_after_) throw StopReplay{};
}

SaveEntry& Invocation::next_replay_entry(const RegionSlot& slot) {
  auto it = save_entries_.find(slot.id());
  size_t& cursor = replay_cursor_[slot.id()];
  const size_t available = it == save_entries_.end() ? 0 : it->second.size();
  PIPEMAT_CHECK(cursor < available, RematError, "SAVE region '", slot.name(), "' in ", where(),
                " was called ", cursor + 1, " time(s) in replay but only ", available,
                " time(s) in forward; forward and replay must call SAVE regions in the same "
                "order (phase: replay)");
  return it->second[cursor++];
}

at::Tensor Invocation::unpack(int64_t index) {
  const Phase phase = PhaseScope::current_backward_phase();
  PIPEMAT_CHECK(!released_, RematError, where(), " was released before its backward used it (",
                "phase: ", phase_name(phase),
                "); release an invocation group only after its last backward (B, or W)");
  PIPEMAT_INTERNAL_ASSERT(index >= 0 && index < static_cast<int64_t>(handles_.size()));
  if (!replayed_) check_inputs_unchanged();  // the more useful message when an input changed
  const HandleMeta& meta = handles_[index];
  const uint32_t now = meta.version.current_version();
  PIPEMAT_CHECK(now == meta.saved_version, RematError, "one of the tensors saved for backward in ",
                where(), " (saved tensor #", index, ", ", c10::toString(meta.dtype), " ",
                c10::IntArrayRef(meta.sizes),
                ") has been modified by an inplace operation: it is at version ", now,
                "; expected version ", meta.saved_version,
                " instead. Replay cannot regenerate what backward needs; clone the tensor "
                "before modifying it (phase: ",
                phase_name(phase), ")");
  ensure_replayed_for_unpack(replayed_ && consumed_[index]);
  at::Tensor value = replayed_values_[index];
  PIPEMAT_INTERNAL_ASSERT(value.defined(), "no replayed value for saved tensor #", index, " of ",
                          where());
  if (!retained_) {
    replayed_values_[index] = at::Tensor();
    consumed_[index] = true;
  }
  return value;
}

void Invocation::ensure_replayed_for_unpack(bool consumed) {
  // A value already consumed means a second backward over a retained graph: regenerate again.
  if (replayed_ && !retained_ && consumed) replayed_ = false;
  if (!replayed_) replay();
}

void Invocation::handle_released(int64_t index) noexcept {
  if (index < 0 || index >= static_cast<int64_t>(handles_.size())) return;
  handles_[index].alive = false;
  if (index < static_cast<int64_t>(replayed_values_.size())) replayed_values_[index] = at::Tensor();
}

void Invocation::release() noexcept {
  released_ = true;
  replayed_values_.clear();
  consumed_.clear();
  save_entries_.clear();
  for (auto& slot : slots_) slot.value = at::Tensor();
  inputs_.clear();
  entry_modes_.rng.reset();
}

}  // namespace pipemat::remat::detail
