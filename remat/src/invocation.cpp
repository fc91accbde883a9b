#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include "internal.h"
#include "pipemat/core/error.h"
#include "pipemat/remat/hooks.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/rng.h"
#include "pipemat/remat/stats.h"
#include "pipemat/remat/values.h"

namespace pipemat::remat {

// --- ids, phases, scopes ------------------------------------------------------------------------

std::string InvocationId::str() const {
  std::ostringstream os;
  if (standalone) {
    os << "standalone unit call #" << call;
    return os.str();
  }
  bool first = true;
  auto part = [&](const char* label, int64_t v) {
    if (v < 0) return;
    os << (first ? "" : ", ") << label << " " << v;
    first = false;
  };
  part("step", key.step);
  part("chunk", key.chunk);
  part("micro-batch", key.micro_batch);
  os << (first ? "" : ", ") << "unit call #" << call;
  return os.str();
}

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kForward:
      return "forward";
    case Phase::kReplay:
      return "replay";
    case Phase::kBackward:
      return "backward";
    case Phase::kBackwardInput:
      return "backward I";
    case Phase::kBackwardWeight:
      return "backward W";
  }
  return "?";
}

namespace {
thread_local Phase tls_backward_phase = Phase::kBackward;
thread_local InvocationScope* tls_scope = nullptr;
thread_local int64_t tls_standalone_calls = 0;
thread_local std::vector<detail::Context> tls_contexts;
}  // namespace

PhaseScope::PhaseScope(Phase phase) : previous_(tls_backward_phase) { tls_backward_phase = phase; }
PhaseScope::~PhaseScope() { tls_backward_phase = previous_; }
Phase PhaseScope::current_backward_phase() { return tls_backward_phase; }

InvocationScope::InvocationScope(InvocationKey key)
    : group_(std::make_shared<InvocationGroup>(key)), previous_(tls_scope) {
  tls_scope = this;
}

InvocationScope::~InvocationScope() { tls_scope = previous_; }

class InvocationScopeAccess {
 public:
  static InvocationId next(std::shared_ptr<InvocationGroup>* group) {
    InvocationId id;
    if (tls_scope == nullptr) {
      id.call = tls_standalone_calls++;
      id.standalone = true;
      return id;
    }
    id.key = tls_scope->group_->key();
    id.call = tls_scope->next_call_++;
    id.standalone = false;
    *group = tls_scope->group_;
    return id;
  }
};

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

void InvocationGroup::add(std::shared_ptr<detail::Invocation> invocation) {
  PIPEMAT_CHECK(!released_, RematError, "a checkpoint unit ran under invocation scope of ",
                invocation->id().str(), " after the scope's group was released");
  if (retained_) invocation->retain();
  invocations_.push_back(std::move(invocation));
}

void InvocationGroup::pretrigger() {
  detail::RematCode remat_code;
  PIPEMAT_CHECK(!released_, RematError,
                "pre-triggered replay of a released invocation group (step ", key_.step, ", chunk ",
                key_.chunk, ", micro-batch ", key_.micro_batch,
                "): release() must come after the last backward");
  retain();
  for (auto it = invocations_.rbegin(); it != invocations_.rend(); ++it) (*it)->replay();
}

void InvocationGroup::retain() {
  retained_ = true;
  for (auto& inv : invocations_) inv->retain();
}

void InvocationGroup::release() noexcept {
  for (auto& inv : invocations_) inv->release();
  invocations_.clear();
  released_ = true;
}

RematReport InvocationGroup::report() const {
  RematReport total;
  for (const auto& inv : invocations_) total += inv->report();
  return total;
}

namespace detail {

// --- context ------------------------------------------------------------------------------------

const Context* current_context() { return tls_contexts.empty() ? nullptr : &tls_contexts.back(); }

ContextGuard::ContextGuard(ContextKind kind, Invocation* invocation) {
  tls_contexts.push_back(Context{kind, invocation});
}
ContextGuard::~ContextGuard() { tls_contexts.pop_back(); }

InvocationId next_invocation_id(std::shared_ptr<InvocationGroup>* group) {
  return InvocationScopeAccess::next(group);
}

RngState cpu_rng_state() {
  auto gen = current_cpu_generator();  // Note [Per-thread CPU generators]
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  return RngState{impl->engine(), impl->next_float_normal_sample(),
                  impl->next_double_normal_sample()};
}

void set_cpu_rng_state(const RngState& state) {
  auto gen = current_cpu_generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  impl->set_engine(state.engine);
  impl->set_next_float_normal_sample(state.next_float_normal);
  impl->set_next_double_normal_sample(state.next_double_normal);
}

std::atomic<bool> g_rederivation{true};
namespace {}  // namespace
std::mutex g_trace_mutex;
std::function<void(const std::string&)> g_trace_sink;
std::atomic<bool> g_trace_on{[] {
  const char* env = std::getenv("PIPEMAT_REMAT_TRACE");
  return env != nullptr && env[0] != '\0' && env[0] != '0';
}()};

bool trace_enabled() { return g_trace_on.load(std::memory_order_relaxed); }

void trace_line(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  if (g_trace_sink) {
    g_trace_sink(line);
  } else {
    std::cerr << "[pipemat remat] " << line << "\n";
  }
}

}  // namespace detail

void set_rederivation_enabled(bool enabled) { detail::g_rederivation.store(enabled); }
bool rederivation_enabled() { return detail::g_rederivation.load(); }

void set_trace_sink(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(detail::g_trace_mutex);
  detail::g_trace_on.store(sink != nullptr);
  detail::g_trace_sink = std::move(sink);
}

namespace detail {

const char* fallback_name(Fallback reason) {
  return fallback_names()[static_cast<size_t>(reason)].c_str();
}

int64_t unique_storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (seen.insert(key).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

// --- hooks of a checkpoint unit -----------------------------------------------------------------

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

class UnitHandleFactory final : public HookFactory {
 public:
  explicit UnitHandleFactory(std::shared_ptr<Invocation> inv) : inv_(std::move(inv)) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> make() override {
    return std::make_unique<UnitHandleHooks>(inv_);
  }

 private:
  std::shared_ptr<Invocation> inv_;
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

class ReplayFactory final : public HookFactory {
 public:
  explicit ReplayFactory(Invocation* inv) : inv_(inv) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> make() override {
    return std::make_unique<ReplayHooks>(inv_);
  }

 private:
  Invocation* inv_;
};

}  // namespace

// --- Invocation
// -----------------------------------------------------------------------------------

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
                           const auto& vc = torch::autograd::impl::version_counter(t);
                           input_versions_.emplace_back(vc, vc.current_version());
                           if (t.has_storage()) {
                             unit_input_storages_.push_back(t.storage().unsafeGetStorageImpl());
                           }
                         });
  }
  if (options_.preserve_rng_state) rng_entry_ = cpu_rng_state();
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
  meta.version = torch::autograd::impl::version_counter(saved);
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
  if (replay_stop_after_ < 0) {  // nothing to regenerate
    replayed_ = true;
    return;
  }

  std::optional<RngState> rng_outside;
  if (rng_entry_) {
    rng_outside = cpu_rng_state();
    set_cpu_rng_state(*rng_entry_);
  }
  bool stopped_early = false;
  replaying_ = true;
  const int64_t bytes_before = begin_peak_window();
  if (trace_enabled()) trace_line(concat("replay start: ", where()));
  try {
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
  PIPEMAT_CHECK(meta.dtype == saved.scalar_type() && saved.sizes().equals(meta.sizes), RematError,
                where(), ": saved tensor #", index, " is ", describe_tensor(saved),
                " in replay but was ", c10::toString(meta.dtype), " ", c10::IntArrayRef(meta.sizes),
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

// --- SAVE regions and rederivation
// ----------------------------------------------------------------

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
                           if (t.has_storage()) {
                             rec.storage = t.storage().unsafeGetStorageImpl();
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
    SlotRecipe slot;
    slot.region = entry.name;
    slot.input_path = rec.path;
    slot.input = i;
    slot.sizes = saved.sizes().vec();
    slot.strides = saved.strides().vec();
    slot.relative_offset = saved.storage_offset() - rec.offset;
    slot.exact = exact;
    slot.version = torch::autograd::impl::version_counter(saved);
    slot.saved_version = slot.version.current_version();
    slots_.push_back(std::move(slot));
    const auto index = static_cast<int64_t>(slots_.size()) - 1;
    entry.slots.push_back(index);
    if (trace_enabled()) {
      trace_line(concat("rederive: SAVE region '", entry.name, "' saves ", rec.path,
                        exact ? "" : " (a view)", " as slot #", index, ", ", describe_tensor(saved),
                        " not kept (", where(), ")"));
    }
    return index;
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
    slot.value = slot.exact ? base
                            : base.as_strided(slot.sizes, slot.strides,
                                              base.storage_offset() + slot.relative_offset);
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
  rng_entry_.reset();
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
  r.cached_output_bytes = unique_storage_bytes(cached);
  std::vector<at::Tensor> replayed = replayed_values_;
  for (const auto& slot : slots_) replayed.push_back(slot.value);
  r.replayed_bytes = unique_storage_bytes(replayed);
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
        const InputRecord& rec = e.inputs[slots_[index].input];
        ++r.rederived_slots;
        if (rederived_storages.insert(rec.storage).second) r.rederived_bytes += rec.storage_nbytes;
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
