#pragma once
// The core of remat: how one wrapped callable runs, as a checkpoint unit, a SAVE region, or
// plainly. Typed front-ends (wrappers.h, through run_typed_region()) and the AnyModule adapter
// convert to and from IValues and call run_region(); nothing else decides checkpoint behaviour.

#include <ATen/core/ivalue.h>
#include <c10/util/FunctionRef.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/remat/options.h"

namespace pipemat::remat {

// What one wrapped module or callable is declared as. Shared by every handle that calls the same
// module instance (holders, wrapped AnyModules, Sequential entries) and changed by the
// declarative API (checkpoint_wrapper, checkpoint_exclude_wrapper, apply_policy) at
// construction time, never during a forward.
class RegionSlot {
 public:
  enum class Kind { kPlain, kCheckpoint, kSave };

  explicit RegionSlot(std::string default_name)
      : name_(std::make_shared<const std::string>(std::move(default_name))) {}

  Kind kind() const { return kind_; }
  const std::string& name() const { return *name_; }
  const std::shared_ptr<const std::string>& shared_name() const { return name_; }
  const CheckpointOptions& checkpoint_options() const { return checkpoint_; }
  const SaveRegionOptions& save_options() const { return save_; }

  // Declares the callable a checkpoint unit / a SAVE region / plain. Throws RematError when the
  // slot already has the other kind (conflicting declarations).
  void declare_checkpoint(const CheckpointOptions& options);
  void declare_save(const SaveRegionOptions& options);
  void reset();
  void set_name(std::string name) { name_ = std::make_shared<const std::string>(std::move(name)); }

  // Process-unique id; keys the FIFO of SAVE entries inside an invocation.
  uint64_t id() const { return id_; }

 private:
  Kind kind_ = Kind::kPlain;
  std::shared_ptr<const std::string> name_;
  CheckpointOptions checkpoint_;
  SaveRegionOptions save_;
  uint64_t id_ = next_id();
  static uint64_t next_id();
};

using RegionBody = std::function<c10::IValue(const std::vector<c10::IValue>& args)>;

// Runs `body(args)` as `slot` declares. For a checkpoint unit the body is kept (with the args)
// for replay, so it must stay callable until the invocation is released.
c10::IValue run_region(const RegionSlot& slot, std::vector<c10::IValue> args, RegionBody body);

// run_region for the typed front-ends (wrappers.h), with the conversion between C++ values and
// IValues inside it, so that host_overhead_ns() counts it as remat's own time: `prepare` fills
// the arguments and returns the body, `finish` takes the region's result. Both are called on this
// thread before run_typed_region returns; an exception from either or from the region propagates.
void run_typed_region(const RegionSlot& slot,
                      c10::function_ref<RegionBody(std::vector<c10::IValue>& args)> prepare,
                      c10::function_ref<void(const c10::IValue& result)> finish);

// Rederivation of RECOMPUTE-sourced SAVE inputs (docs/remat.md) is always on; this process-wide
// switch exists only so benchmarks can measure the "legacy" behaviour that keeps those inputs.
void set_rederivation_enabled(bool enabled);
bool rederivation_enabled();

// Debug trace of pack / unpack / rederive / fallback decisions, one line per event, to `sink`
// (nullptr: off). Also switched on by the environment variable PIPEMAT_REMAT_TRACE=1 (stderr).
void set_trace_sink(std::function<void(const std::string&)> sink);

// True while this thread runs the forward or the replay of a checkpoint unit (a SAVE wrapper is
// transparent otherwise, and typed wrappers skip the IValue conversion).
bool inside_checkpoint_unit();

}  // namespace pipemat::remat
