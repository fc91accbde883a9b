// Ids, phases and scopes of checkpoint-unit calls, invocation groups (what the public
// invocation.h declares), and the per-thread region context (ContextGuard, next_invocation_id).

#include "pipemat/remat/invocation.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "internal.h"
#include "overhead_clock.h"
#include "pipemat/core/error.h"

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
  part("stage", key.stage);
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

struct InvocationGroup::Invocations {
  std::vector<std::shared_ptr<detail::Invocation>> list;
};

InvocationGroup::InvocationGroup(InvocationKey key)
    : key_(key), invocations_(std::make_unique<Invocations>()) {}

InvocationGroup::~InvocationGroup() = default;

size_t InvocationGroup::size() const { return invocations_->list.size(); }

class InvocationGroupAccess {
 public:
  static void add(InvocationGroup& group, std::shared_ptr<detail::Invocation> invocation) {
    PIPEMAT_CHECK(!group.released_, RematError, "a checkpoint unit ran under invocation scope of ",
                  invocation->id().str(), " after the scope's group was released");
    if (group.retained_) invocation->retain();
    group.invocations_->list.push_back(std::move(invocation));
  }
};

void InvocationGroup::pretrigger() {
  detail::RematCode remat_code;
  PIPEMAT_CHECK(!released_, RematError,
                "pre-triggered replay of a released invocation group (step ", key_.step, ", stage ",
                key_.stage, ", micro-batch ", key_.micro_batch,
                "): release() must come after the last backward");
  retain();
  auto& list = invocations_->list;
  for (auto it = list.rbegin(); it != list.rend(); ++it) (*it)->replay();
}

void InvocationGroup::retain() {
  retained_ = true;
  for (auto& inv : invocations_->list) inv->retain();
}

void InvocationGroup::release() noexcept {
  for (auto& inv : invocations_->list) inv->release();
  invocations_->list.clear();
  released_ = true;
}

RematReport InvocationGroup::report() const {
  RematReport total;
  for (const auto& inv : invocations_->list) total += inv->report();
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

void join_group(InvocationGroup& group, std::shared_ptr<Invocation> invocation) {
  InvocationGroupAccess::add(group, std::move(invocation));
}

}  // namespace detail
}  // namespace pipemat::remat
