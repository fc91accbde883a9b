#pragma once
// Private state of remat: invocations, SAVE entries and the per-thread region context.
//
// What lives where in remat/src (the public headers are listed in remat.h):
//   internal.h, invocation.cpp, replay.cpp, save_regions.cpp, report.cpp   the Invocation (its
//       forward, replay, SAVE entries, rederivation, report) and the per-thread region context
//       (Note [Replay RNG alignment]).
//   region.cpp    run_region: unit forward, SAVE forward and replay, a SAVE body's hooks.
//   saved_hooks.*  the saved-tensor hooks of a unit's forward and of its replay.
//   counters.h + stats.cpp, overhead_clock.*, trace.cpp   counters, overhead clock, debug trace.
//   slots.cpp (the module -> RegionSlot table), containers.cpp, policy.cpp, values.cpp.
// The reaches into LibTorch internals, each in one file with a Note (checked for the LibTorch
// versions the configure step accepts, 2.11 to 2.15):
//   hooks.h / hooks.cpp  the autograd Engine subclass for default saved-tensor hooks
//                        (Note [Saved tensor hooks in pure C++]).
//   any_module.cpp       AnyModule's private content (Note [AnyModule content access]).
//   memory.cpp           the CPU allocator replacement (Note [CPU allocator replacement]).
//   rng.cpp              dispatch key and generator state (Note [LibTorch generator internals]).

#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Optional.h>

#include <array>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/region.h"

namespace pipemat::remat::detail {

using ::pipemat::detail::concat;

// Thrown by the replay pack hook once every needed tensor has been regenerated (early stop).
struct StopReplay {};

// What forward recorded about one replay handle (or a replay marker).
struct HandleMeta {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
  c10::VariableVersion version{c10::VariableVersion::DISABLED};  // shares the tensor's counter
  uint32_t saved_version = 0;
  bool is_marker = false;
  bool alive = true;  // the SavedVariable that owns the handle still exists
};

// The generator state a unit records: the CPU generator's, copied by value (no tensor
// allocation), and in a process that sees a GPU the current CUDA device's (Note [Replay RNG
// alignment]).
struct RngState {
  at::mt19937 engine;
  c10::optional<float> next_float_normal;
  c10::optional<double> next_double_normal;
  c10::DeviceIndex cuda_device = -1;  // -1: the process sees no GPU
  at::Tensor cuda;                    // that device's generator state (Generator::get_state)
};

// The thread's autocast state for the device types a rank computes on (Note [Autocast in
// replay]): enabled and dtype for CPU and CUDA, and whether casts are cached.
struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cache_enabled = true;
};

// What a replay must reproduce of its forward, recorded in one place: at a unit's entry
// (Invocation) and right after each SAVE body, which replay skips (SaveEntry).
struct ForwardModes {
  std::optional<RngState> rng;  // Note [Replay RNG alignment]; empty: the unit drew nothing
  AutocastState autocast;       // Note [Autocast in replay]
};

// Why a saved tensor aliasing a SAVE region input was kept instead of rederived (docs/remat.md).
enum class Fallback {
  kSaveSourced,  // the input is (a view of) another SAVE region's output: replay does not rerun it
  kUnitInput,    // the input is (a view of) a checkpoint-unit input: kept by the unit anyway
  kLeaf,         // the input is a leaf: a parameter, a buffer or a constant
  kInplace,      // the input was modified in place inside the region before it was saved
  kDtype,        // the saved tensor reinterprets the input's storage with another dtype
  kView,         // the saved tensor is a view that cannot be rebuilt from the input
  kDisabled,     // rederivation is switched off (measurement only)
};
static_assert(static_cast<int>(Fallback::kDisabled) + 1 == kNumFallbacks,
              "one RematReport::fallbacks entry per Fallback (invocation.h)");
const char* fallback_name(Fallback reason);

// A direct tensor input of a SAVE region call, as forward saw it.
struct InputRecord {
  std::string path;
  const c10::StorageImpl* storage = nullptr;
  // Holds the StorageImpl object (not its data) so that its address names this storage alone
  // while the entry lives: a freed input's address is not reused by a later tensor.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage_ref;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  uint32_t version = 0;
  int64_t storage_nbytes = 0;
  bool rederivable = false;
  Fallback reason = Fallback::kLeaf;
  // Its gradient edge (the autograd node that made it and which of its outputs it is), to know
  // a cast of it (Note [Rederived casts]); and its version counter.
  const void* grad_fn = nullptr;
  uint32_t output_nr = 0;
  c10::VariableVersion counter{c10::VariableVersion::DISABLED};
};

// One saved tensor of a SAVE region that replay rederives from an input instead of keeping it.
struct SlotRecipe {
  std::string region;
  std::string input_path;
  size_t input = 0;  // index into the entry's inputs
  std::vector<int64_t> sizes, strides;
  int64_t relative_offset = 0;
  bool exact = true;  // the input itself, not a view of it
  // Undefined, or the dtype the saved tensor is a cast of the input to (Note [Rederived casts]).
  at::ScalarType cast = at::ScalarType::Undefined;
  c10::VariableVersion version{c10::VariableVersion::DISABLED};
  uint32_t saved_version = 0;
  at::Tensor value;  // filled by replay
  bool consumed = false;
  bool alive = true;
};

// One forward call of one SAVE region inside one invocation.
struct SaveEntry {
  const RegionSlot* slot = nullptr;
  std::string name;
  std::vector<InputRecord> inputs;
  bool any_rederivable = false;
  std::vector<int64_t> slots;  // indices into the invocation's slots
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> kept;  // saved for real (reports)
  // Output for replay (tensor leaves detached) or, with save_output=false, its leaf count.
  c10::IValue cached_output;
  std::vector<bool> output_requires_grad;
  int64_t leaf_count = 0;
  bool save_output = true;
  ForwardModes modes_after;  // the generator and autocast state right after the body
  bool has_marker = false;
};

class Invocation : public std::enable_shared_from_this<Invocation> {
 public:
  Invocation(InvocationId id, const RegionSlot& unit, RegionBody body,
             std::vector<c10::IValue> inputs);

  const InvocationId& id() const { return id_; }
  const std::string& unit_name() const { return unit_name_; }
  std::string where() const;  // "checkpoint unit 'x' (invocation ...)"

  // --- forward ---
  // Runs the unit body once under the handle hooks. Called once, right after construction.
  c10::IValue run_forward();
  int64_t register_handle(const at::Tensor& saved);
  void register_marker();
  SaveEntry& new_save_entry(const RegionSlot& slot);
  void finish_forward() { forward_done_ = true; }
  const CheckpointOptions& options() const { return options_; }

  // --- replay ---
  void replay();  // idempotent for the current epoch
  void on_replay_pack(const at::Tensor& saved);
  void on_replay_marker();
  SaveEntry& next_replay_entry(const RegionSlot& slot);
  bool replaying() const { return replaying_; }

  // --- SAVE regions and rederivation (docs/remat.md) ---
  void record_save_inputs(SaveEntry& entry, const std::vector<c10::IValue>& args);
  void note_save_output(const SaveEntry& entry, const c10::IValue& output);
  // Zero-element placeholders for the `leaf_count` tensor leaves of a save_output=false region.
  c10::IValue make_placeholders(const SaveEntry& entry);
  void check_unit_output(const c10::IValue& output) const;
  // Slot for `saved` (an alias of entry.inputs[input], or a cast of one) or -1 when it must be
  // kept (fallback).
  int64_t try_rederive(SaveEntry& entry, const at::Tensor& saved);
  void fill_slots(SaveEntry& entry, const std::vector<c10::IValue>& args);
  at::Tensor unpack_slot(int64_t index);
  void slot_released(int64_t index) noexcept;

  // --- backward ---
  at::Tensor unpack(int64_t index);
  void handle_released(int64_t index) noexcept;

  void retain() { retained_ = true; }
  void release() noexcept;
  bool released() const { return released_; }
  RematReport report() const;

 private:
  void check_inputs_unchanged() const;
  // The steps of replay(): reset the replay state and find the early stop; run the body under
  // the replay hooks from the unit's entry generator state (true when it stopped early); check
  // the count of a full replay.
  void start_replay();
  bool run_replay_body();
  void finish_replay(bool stopped_early);
  std::string placeholder_producers() const;
  std::string placeholder_hint() const;
  void abandon_replay(const std::optional<RngState>& rng_outside);
  void ensure_replayed_for_unpack(bool consumed);
  void note_fallback(Fallback reason, const InputRecord& input, const SaveEntry& entry);
  int64_t try_rederive_cast(SaveEntry& entry, const at::Tensor& saved);
  int64_t add_slot(SaveEntry& entry, size_t input, const at::Tensor& saved, bool exact,
                   at::ScalarType cast);

  InvocationId id_;
  std::string unit_name_;
  CheckpointOptions options_;
  RegionBody body_;
  std::vector<c10::IValue> inputs_;
  std::vector<std::pair<c10::VariableVersion, uint32_t>> input_versions_;
  ForwardModes entry_modes_;  // at the unit's entry: what its replay starts from

  std::vector<HandleMeta> handles_;
  std::unordered_map<uint64_t, std::deque<SaveEntry>> save_entries_;
  bool forward_done_ = false;
  int64_t first_allocation_ = 0;  // tracking-allocator sequence at unit entry
  std::vector<SlotRecipe> slots_;
  std::vector<const c10::StorageImpl*> unit_input_storages_;
  std::vector<const c10::StorageImpl*> save_output_storages_;
  std::array<int64_t, kNumFallbacks> fallbacks_{};
  // Note [Placeholder leaf count]: outputs of save_output=false regions seen in forward, and the
  // placeholders handed out in the current replay, with the region that produced them.
  std::vector<std::pair<const c10::StorageImpl*, std::string>> no_cache_outputs_;
  std::vector<std::pair<const c10::TensorImpl*, std::string>> placeholders_;
  int64_t replay_peak_bytes_ = 0;

  // Replay state (Note [Invocation lifetime]).
  std::vector<at::Tensor> replayed_values_;
  std::vector<bool> consumed_;
  std::unordered_map<uint64_t, size_t> replay_cursor_;
  int64_t replay_counter_ = 0;
  int64_t replay_stop_after_ = -1;  // last index replay must produce
  bool replaying_ = false;
  bool replayed_ = false;
  bool retained_ = false;
  bool released_ = false;
  int64_t replays_ = 0;
  int64_t early_stops_ = 0;
};

// --- the per-thread region context --------------------------------------------------------------

enum class ContextKind { kUnitForward, kUnitReplay, kSaveBody };

struct Context {
  ContextKind kind;
  Invocation* invocation;
};

const Context* current_context();

class ContextGuard {
 public:
  ContextGuard(ContextKind kind, Invocation* invocation);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
};

// Next id for a checkpoint-unit call on this thread (scoped or standalone), and the group to join.
InvocationId next_invocation_id(std::shared_ptr<InvocationGroup>* group);
// Adds a checkpoint-unit call to its scope's group. Throws RematError when the group was released.
void join_group(InvocationGroup& group, std::shared_ptr<Invocation> invocation);

// Note [Replay RNG alignment]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Replay must draw the same random numbers as forward. The unit records the CPU generator at
// entry and replay starts from it; each SAVE region records the generator right after its body
// and replay, which skips the body, jumps the generator there, so RECOMPUTE ops after a SAVE
// region (e.g. dropout) see the stream they saw in forward. Replay forks: the generator state
// from before replay is restored afterwards. Access is serialized on the generator's mutex.
// In a process that sees a GPU the current CUDA device's generator is recorded and restored with
// the CPU one (its state is a seed and an offset), so dropout on CUDA replays exactly too; a
// rank computes on one device, which is current while it runs (pp::Pipeline sets it).
RngState cpu_rng_state();
void set_cpu_rng_state(const RngState& state);
bool same_rng_state(const RngState& a, const RngState& b);
// LayerStream scopes this thread has entered so far (Note [Layer streams] in pipemat/remat/rng.h):
// a unit whose forward entered one drew, though the scope restored the generator it found.
uint64_t layer_streams_entered();

// Note [Autocast in replay]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Replay must compute in the dtypes its forward computed in. Autocast (LibTorch's thread-local
// mixed-precision mode: enabled and dtype per device type, a cast cache, a nesting count) is
// recorded with the generator state (ForwardModes): at a unit's entry and after each SAVE body.
// A replay, whichever path starts it (a backward's unpack, a pre-triggered R, a second backward
// over a retained graph), runs the body under exactly the entry state as a fresh autocast
// region (nesting counted; the cast cache cleared when the region ends at nesting 0, so no cast
// of a weight outlives it), never under the replaying thread's ambient state, and jumps to the
// state a skipped SAVE body left, so a region that turns autocast off inside a unit stays off
// in replay. Early stop ends a replay by unwinding the user's forward at its last needed saved
// tensor (StopReplay): the user's own "autocast off" or "grad mode back on" after that point
// never runs. So ReplayRegion restores the replaying thread's autocast state, its nesting and its
// grad mode exactly as it found them, early stop, error or not.
AutocastState current_autocast();
void set_autocast(const AutocastState& state);
// "cpu BFloat16, cuda off" (what errors say of the two states).
std::string describe_autocast(const AutocastState& state);

// Runs what it scopes (a replay) under `recorded` as a fresh autocast region; restores the
// thread's autocast state, nesting and grad mode on destruction (Note [Autocast in replay]).
class ReplayRegion {
 public:
  explicit ReplayRegion(const AutocastState& recorded);
  ~ReplayRegion();
  ReplayRegion(const ReplayRegion&) = delete;
  ReplayRegion& operator=(const ReplayRegion&) = delete;

 private:
  AutocastState outside_;
  int nesting_outside_ = 0;
  bool grad_outside_ = true;
};

// Note [Shared generator detection]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without a ThreadGeneratorScope (Note [Per-thread CPU generators]) every thread draws from
// LibTorch's one process-wide CPU generator. A checkpoint unit that draws there (dropout) while
// a unit of another thread draws there too interleaves their streams: the forward's masks are
// not the ones replay, rewound to the unit's entry state, draws again, and the gradients are
// silently wrong. So each unit forward on that generator, and each replay of a unit whose
// forward drew, is a window registered process-wide with its thread. A unit "drew" when the
// generator's state at its end differs from its entry state (a draw of another thread in the
// window counts too: that is the interleaving), or when it entered a LayerStream (Note [Layer
// streams]), which leaves the state as it found it. When a window that drew closes, every open
// window of another thread is marked with it; a window that drew and was marked throws
// RematError at its close, naming both units and ThreadGeneratorScope: of two overlapping
// windows that drew, the one that closes last reports. A unit that did not draw in forward
// does not touch the generator in replay (no rewind, no SAVE-region jumps; the same numbers on
// one thread, where that rewind was a no-op), so units without randomness never conflict.
// Draws outside checkpoint units (plain dropout on another thread) are not seen.
class SharedGeneratorWindow {
 public:
  // Registers a window of `inv` on this thread when it draws from the process-wide generator
  // (no ThreadGeneratorScope); nothing otherwise.
  explicit SharedGeneratorWindow(const Invocation& inv);
  // Unregisters (no check: the unit is failing anyway).
  ~SharedGeneratorWindow();
  SharedGeneratorWindow(const SharedGeneratorWindow&) = delete;
  SharedGeneratorWindow& operator=(const SharedGeneratorWindow&) = delete;
  // Ends the window; RematError as the Note says. `drew`: the unit drew in it.
  void close(bool drew);

 private:
  const Invocation& inv_;
  uint64_t serial_ = 0;  // 0: not registered
};

// The one cached zero-element tensor every placeholder aliases.
const at::Tensor& placeholder_tensor();
bool is_placeholder(const at::Tensor& t);

// Debug trace of pack / unpack / rederive / fallback decisions (trace.cpp; PIPEMAT_REMAT_TRACE).
bool trace_enabled();
void trace_line(const std::string& line);

}  // namespace pipemat::remat::detail
