#pragma once
// Invocations: the owners of all remat state.
//
// Note [Invocation lifetime]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every forward call of a checkpoint unit creates one Invocation. It owns the unit's inputs (for
// replay), the RNG states, the SAVE regions' cached outputs and leaf counts, the rederivation
// slots and the replay results. Nothing is shared between invocations, so many micro-batches of
// the same wrappers can be in flight and be replayed in any order.
//
// The autograd graph keeps an invocation alive through the saved-tensor handles it created;
// when backward frees the graph (or the graph is dropped) the invocation and everything it holds
// are freed. Lazy replay (the default) is started by the first unpack in backward, and each
// replayed tensor is dropped as soon as backward has unpacked it. A pipeline runtime instead
// opens an InvocationScope per (step, virtual stage, micro-batch), pre-triggers the replay of the
// group (schedule action R) so that it overlaps communication, runs one fused backward or I then
// W (both unpack the same retained replay), and releases the group after its last backward.
//
// Threading: an invocation is used by one thread at a time (the thread that runs its stage).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pipemat::remat {

// Which micro-batch of which step and virtual stage a forward belongs to. -1 = not set.
struct InvocationKey {
  int64_t step = -1;
  int64_t stage = -1;  // model stage (the global index: with V chunks per rank, one of P x V)
  int64_t micro_batch = -1;
};

struct InvocationId {
  InvocationKey key;
  int64_t call = 0;        // index of the checkpoint-unit call within the scope (or process)
  bool standalone = true;  // made outside any InvocationScope
  // "step 3, stage 0, micro-batch 2, unit call #1" or "standalone unit call #17".
  std::string str() const;
};

enum class Phase { kForward, kReplay, kBackward, kBackwardInput, kBackwardWeight };
const char* phase_name(Phase phase);

// Labels the backward work on this thread for diagnostics (e.g. kBackwardInput during I).
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;
  static Phase current_backward_phase();

 private:
  Phase previous_;
};

// Number of reasons a saved tensor that aliases a SAVE input is kept (see fallback_names()).
constexpr int kNumFallbacks = 7;

// Memory and decision counts of one invocation (or a sum of them). Bytes are counted by unique
// storage, so a tensor that is both cached and saved is counted once.
struct RematReport {
  int64_t invocations = 0;
  int64_t saved_handles = 0;        // tensors RECOMPUTE ops saved as replay handles
  int64_t save_resident_bytes = 0;  // kept for SAVE regions' own backward
  int64_t cached_output_bytes = 0;  // SAVE outputs cached for replay
  int64_t replayed_bytes = 0;       // replay results currently held
  int64_t rederived_bytes = 0;      // SAVE inputs not kept thanks to rederivation (docs/remat.md)
  int64_t rederived_slots = 0;
  int64_t replay_peak_bytes = 0;  // allocator peak above the start of replay (tracking allocator)
  int64_t replays = 0;
  int64_t early_stops = 0;
  // Saved tensors kept although they alias a SAVE input, by reason (see fallback_names()).
  std::vector<int64_t> fallbacks = std::vector<int64_t>(kNumFallbacks, 0);
  int64_t fallback_total() const;
  std::string str() const;
  RematReport& operator+=(const RematReport& other);
};

// Names of RematReport::fallbacks entries, in order: save_sourced, unit_input, leaf, inplace,
// dtype, view, disabled.
const std::vector<std::string>& fallback_names();

// The checkpoint-unit calls made inside one InvocationScope. Non-copyable: it owns them.
class InvocationGroup {
 public:
  explicit InvocationGroup(InvocationKey key);
  ~InvocationGroup();
  InvocationGroup(const InvocationGroup&) = delete;
  InvocationGroup& operator=(const InvocationGroup&) = delete;

  const InvocationKey& key() const { return key_; }
  size_t size() const;

  // Replays every invocation of the group now (schedule action R), last unit first, and keeps
  // the results until release(): later backward passes (B, or I then W) unpack them without
  // replaying again. Replaying an already replayed invocation does nothing.
  void pretrigger();
  // Keeps replay results across several backward passes (I then W) without replaying now; the
  // first unpack replays lazily.
  void retain();
  // Frees every tensor the group's invocations hold. An unpack after release is an error naming
  // the invocation. Idempotent; never throws.
  void release() noexcept;
  bool released() const { return released_; }

  RematReport report() const;

 private:
  struct Invocations;                  // the unit calls themselves
  friend class InvocationGroupAccess;  // the unit wrapper adds its calls

  InvocationKey key_;
  std::unique_ptr<Invocations> invocations_;
  bool retained_ = false;
  bool released_ = false;
};

// RAII: every checkpoint-unit call on this thread while the scope is alive joins its group and
// gets an id with this key. Scopes nest; the innermost wins. Non-copyable.
class InvocationScope {
 public:
  explicit InvocationScope(InvocationKey key);
  ~InvocationScope();
  InvocationScope(const InvocationScope&) = delete;
  InvocationScope& operator=(const InvocationScope&) = delete;

  const std::shared_ptr<InvocationGroup>& group() const { return group_; }

 private:
  std::shared_ptr<InvocationGroup> group_;
  InvocationScope* previous_;
  int64_t next_call_ = 0;
  friend class InvocationScopeAccess;
};

}  // namespace pipemat::remat
