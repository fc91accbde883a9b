#pragma once
// The core of remat: how one wrapped callable runs, as a checkpoint unit, a SAVE region, or
// plainly. Typed front-ends (wrappers.h) and the AnyModule adapter convert to and from IValues
// and call run_region(); nothing else decides checkpoint behaviour.

#include <ATen/core/ivalue.h>

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

// Rederivation of RECOMPUTE-sourced SAVE inputs (SPEC 2.4) is always on; this process-wide switch
// exists only so benchmarks can measure the "legacy" behaviour that keeps those inputs.
void set_rederivation_enabled(bool enabled);
bool rederivation_enabled();

// Debug trace of pack / unpack / rederive / fallback decisions, one line per event, to `sink`
// (nullptr: off). Also switched on by the environment variable PIPEMAT_REMAT_TRACE=1 (stderr).
void set_trace_sink(std::function<void(const std::string&)> sink);

// Host time this thread spent in remat's own code (wrappers, hooks, replay bookkeeping; not the
// wrapped bodies, not autograd), in nanoseconds since the last reset. Measured by switching a
// thread-local clock between "remat" and "user code" at every boundary.
int64_t host_overhead_ns();
void reset_host_overhead();

namespace detail {
// RAII markers of the two clock states; they nest in any order.
class RematCode {
 public:
  RematCode();
  ~RematCode();
  RematCode(const RematCode&) = delete;
  RematCode& operator=(const RematCode&) = delete;

 private:
  bool previous_;
};
class UserCode {
 public:
  UserCode();
  ~UserCode();
  UserCode(const UserCode&) = delete;
  UserCode& operator=(const UserCode&) = delete;

 private:
  bool previous_;
};
}  // namespace detail

// True while this thread runs the forward or the replay of a checkpoint unit (a SAVE wrapper is
// transparent otherwise, and typed wrappers skip the IValue conversion).
bool inside_checkpoint_unit();

}  // namespace pipemat::remat
