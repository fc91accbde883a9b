// validate_schedule: per-rank, per-stage rules, then a simulated run for cross-rank deadlock.

#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::schedule {
namespace {

constexpr int kUnseen = -1;

// Where each action of a (stage, micro-batch) sits in its rank's list.
struct Seen {
  int f = kUnseen, b = kUnseen, i = kUnseen, w = kUnseen, r = kUnseen;
  int send_f = kUnseen, recv_f = kUnseen, send_b = kUnseen, recv_b = kUnseen;
  int backward() const { return b != kUnseen ? b : i; }
};

[[noreturn]] void fail(int rank, const std::string& action, const std::string& where,
                       const char* rule, const std::string& detail, const std::string& fix) {
  PIPEMAT_THROW(ScheduleError, "invalid schedule: rank ", rank, ", action ", action, " (", where,
                "): rule '", rule, "' broken: ", detail, ". ", fix);
}

std::string at(int position) { return "position " + std::to_string(position); }

class Validator {
 public:
  explicit Validator(const Schedule& s) : schedule_(s) {}

  void run() {
    check_shape();
    comms_ = schedule_.has_comms();
    seen_.assign(static_cast<size_t>(schedule_.stages_count) * schedule_.micro_batches, Seen{});
    for (int r = 0; r < schedule_.ranks_count; ++r) {
      const auto& list = schedule_.actions[r];
      for (int k = 0; k < static_cast<int>(list.size()); ++k) check_action(r, k, list[k]);
    }
    check_complete();
  }

 private:
  Seen& seen(int stage, int mb) {
    return seen_[static_cast<size_t>(stage) * schedule_.micro_batches + mb];
  }

  void check_shape() {
    PIPEMAT_CHECK(schedule_.ranks_count >= 1 &&
                      static_cast<int>(schedule_.actions.size()) == schedule_.ranks_count,
                  ScheduleError, "invalid schedule: expected one action list per rank (",
                  schedule_.ranks_count, " ranks), found ", schedule_.actions.size(), " lists.");
    PIPEMAT_CHECK(schedule_.micro_batches >= 1, ScheduleError,
                  "invalid schedule: micro_batches must be >= 1, found ", schedule_.micro_batches,
                  ".");
    PIPEMAT_CHECK(
        schedule_.stages_count >= 1 &&
            static_cast<int>(schedule_.stage_to_rank.size()) == schedule_.stages_count,
        ScheduleError, "invalid schedule: stage_to_rank must name a rank for each of the ",
        schedule_.stages_count, " stages, found ", schedule_.stage_to_rank.size(), " entries.");
    PIPEMAT_CHECK(static_cast<long long>(schedule_.stages_count) * schedule_.micro_batches <=
                      kMaxStageMicroBatches,
                  ScheduleError, "invalid schedule: ", schedule_.stages_count, " stages x ",
                  schedule_.micro_batches, " micro-batches is more than the ",
                  kMaxStageMicroBatches, " (stage, micro-batch) pairs pipemat handles.");
    for (int st = 0; st < schedule_.stages_count; ++st) {
      PIPEMAT_CHECK(
          schedule_.stage_to_rank[st] >= 0 && schedule_.stage_to_rank[st] < schedule_.ranks_count,
          ScheduleError, "invalid schedule: stage_to_rank[", st,
          "] = ", schedule_.stage_to_rank[st], " is not a rank in [0, ", schedule_.ranks_count,
          ").");
    }
  }

  bool cross_prev(int stage, int rank) const {
    return stage > 0 && schedule_.rank_of(stage - 1) != rank;
  }
  bool cross_next(int stage, int rank) const {
    return stage < schedule_.stages_count - 1 && schedule_.rank_of(stage + 1) != rank;
  }

  // F(stage, mb) must come earlier on this rank; says whether it is missing or just late.
  void require_forward(int r, int k, const Action& a, const Seen& sn, const char* rule) {
    if (sn.f != kUnseen) return;
    const auto& list = schedule_.actions[r];
    const Action f{a.stage, ActionType::kForward, a.micro_batch};
    for (int later = k + 1; later < static_cast<int>(list.size()); ++later) {
      if (list[later] == f) {
        fail(r, format_action(a), at(k), rule,
             format_action(a) + " runs before " + format_action(f) + " (at position " +
                 std::to_string(later) + ")",
             "Move " + format_action(f) + " ahead of it.");
      }
    }
    fail(r, format_action(a), at(k), "missing F",
         "stage " + std::to_string(a.stage) + " never runs F for micro-batch " +
             std::to_string(a.micro_batch),
         "Add " + format_action(f) + " on rank " + std::to_string(r) + " before " +
             format_action(a) + ".");
  }

  void duplicate(int r, int k, const Action& a, int first) {
    fail(r, format_action(a), at(k), "duplicate micro-batch",
         format_action(a) + " appears twice on stage " + std::to_string(a.stage) +
             " (first at position " + std::to_string(first) + ")",
         "Each micro-batch runs each pass once per stage; remove one of them.");
  }

  void check_action(int r, int k, const Action& a) {
    check_placement(r, k, a);
    Seen& sn = seen(a.stage, a.micro_batch);
    switch (a.type) {
      case ActionType::kForward:
        check_forward(r, k, a, sn);
        break;
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
        check_backward(r, k, a, sn);
        break;
      case ActionType::kBackwardWeight:
        check_weight(r, k, a, sn);
        break;
      case ActionType::kRecompute:
        check_recompute(r, k, a, sn);
        break;
      case ActionType::kSendForward:
      case ActionType::kSendBackward:
        check_send(r, k, a, sn);
        break;
      case ActionType::kRecvForward:
      case ActionType::kRecvBackward:
        check_recv(r, k, a, sn);
        break;
    }
  }

  // The action names a stage and micro-batch of the schedule, on the rank that holds the stage.
  void check_placement(int r, int k, const Action& a) {
    const std::string text = format_action(a);
    if (a.stage < 0 || a.stage >= schedule_.stages_count || a.micro_batch < 0 ||
        a.micro_batch >= schedule_.micro_batches) {
      fail(r, text, at(k), "action in range",
           "stage must be in [0, " + std::to_string(schedule_.stages_count) +
               ") and micro-batch in [0, " + std::to_string(schedule_.micro_batches) + ")",
           "Fix the action or the schedule's stage / micro-batch counts.");
    }
    if (schedule_.rank_of(a.stage) != r) {
      fail(r, text, at(k), "stage-to-rank consistency",
           "stage " + std::to_string(a.stage) + " belongs to rank " +
               std::to_string(schedule_.rank_of(a.stage)) + ", not rank " + std::to_string(r),
           "Every action of a stage must be on the rank that holds the stage.");
    }
  }

  void check_forward(int r, int k, const Action& a, Seen& sn) {
    if (sn.f != kUnseen) duplicate(r, k, a, sn.f);
    if (comms_ && cross_prev(a.stage, r) && sn.recv_f == kUnseen) {
      fail(r, format_action(a), at(k), "RECV before consumer",
           "its input comes from rank " + std::to_string(schedule_.rank_of(a.stage - 1)) +
               " but no " + format_action({a.stage, ActionType::kRecvForward, a.micro_batch}) +
               " was posted before it",
           "Post the receive ahead of the forward (lower_communication does).");
    }
    sn.f = k;
  }

  // B or I.
  void check_backward(int r, int k, const Action& a, Seen& sn) {
    require_forward(r, k, a, sn, "F before B/I");
    if (sn.b != kUnseen) duplicate(r, k, a, sn.b);
    if (sn.i != kUnseen) {
      if (a.type == ActionType::kBackwardInput) duplicate(r, k, a, sn.i);
      fail(r, format_action(a), at(k), "B or I+W",
           "micro-batch " + std::to_string(a.micro_batch) + " of stage " + std::to_string(a.stage) +
               " already ran I at position " + std::to_string(sn.i),
           "Use either one B or an I followed by a W per micro-batch, not both.");
    }
    if (comms_ && cross_next(a.stage, r) && sn.recv_b == kUnseen) {
      fail(r, format_action(a), at(k), "RECV before consumer",
           "its output gradient comes from rank " + std::to_string(schedule_.rank_of(a.stage + 1)) +
               " but no " + format_action({a.stage, ActionType::kRecvBackward, a.micro_batch}) +
               " was posted before it",
           "Post the receive ahead of the backward (lower_communication does).");
    }
    (a.type == ActionType::kBackward ? sn.b : sn.i) = k;
  }

  void check_weight(int r, int k, const Action& a, Seen& sn) {
    const std::string text = format_action(a);
    if (sn.w != kUnseen) duplicate(r, k, a, sn.w);
    if (sn.b != kUnseen) {
      fail(r, text, at(k), "B or I+W",
           "micro-batch " + std::to_string(a.micro_batch) + " of stage " + std::to_string(a.stage) +
               " already ran a full B at position " + std::to_string(sn.b),
           "A W only follows an I; drop the W or split the B into I + W.");
    }
    if (sn.i == kUnseen) {
      fail(r, text, at(k), "I before W",
           "W of micro-batch " + std::to_string(a.micro_batch) + " on stage " +
               std::to_string(a.stage) + " runs before its I",
           "Move " + format_action({a.stage, ActionType::kBackwardInput, a.micro_batch}) +
               " ahead of " + text + ".");
    }
    sn.w = k;
  }

  void check_recompute(int r, int k, const Action& a, Seen& sn) {
    require_forward(r, k, a, sn, "F before R");
    if (sn.r != kUnseen) duplicate(r, k, a, sn.r);
    if (sn.backward() != kUnseen) {
      fail(r, format_action(a), at(k), "R before B/I",
           "the recompute runs after the backward of the same micro-batch (position " +
               std::to_string(sn.backward()) + ")",
           "Place R between the F and the B / I of the micro-batch.");
    }
    sn.r = k;
  }

  // SEND_F or SEND_B.
  void check_send(int r, int k, const Action& a, Seen& sn) {
    const std::string text = format_action(a);
    const bool fwd = a.type == ActionType::kSendForward;
    if (!(fwd ? cross_next(a.stage, r) : cross_prev(a.stage, r))) {
      fail(r, text, at(k), "no comm for local hand-off",
           std::string("stage ") + std::to_string(a.stage) + " has no " +
               (fwd ? "next" : "previous") + " stage on another rank",
           "Remove the SEND; adjacent stages on one rank hand over in memory.");
    }
    int& slot = fwd ? sn.send_f : sn.send_b;
    if (slot != kUnseen) duplicate(r, k, a, slot);
    const int producer = fwd ? sn.f : sn.backward();
    if (producer == kUnseen) {
      fail(r, text, at(k), "SEND after producer",
           std::string("it sends the ") + (fwd ? "output of F" : "input gradient of B/I") +
               " before that pass ran",
           "Move the SEND after the pass that produces it.");
    }
    slot = k;
  }

  // RECV_F or RECV_B.
  void check_recv(int r, int k, const Action& a, Seen& sn) {
    const std::string text = format_action(a);
    const bool fwd = a.type == ActionType::kRecvForward;
    if (!(fwd ? cross_prev(a.stage, r) : cross_next(a.stage, r))) {
      fail(r, text, at(k), "no comm for local hand-off",
           std::string("stage ") + std::to_string(a.stage) + " has no " +
               (fwd ? "previous" : "next") + " stage on another rank",
           "Remove the RECV; adjacent stages on one rank hand over in memory.");
    }
    int& slot = fwd ? sn.recv_f : sn.recv_b;
    if (slot != kUnseen) duplicate(r, k, a, slot);
    const int consumer = fwd ? sn.f : sn.backward();
    if (consumer != kUnseen) {
      fail(r, text, at(k), "RECV before consumer",
           "the pass that consumes it already ran at position " + std::to_string(consumer),
           "Move the RECV ahead of that pass.");
    }
    slot = k;
  }

  void check_complete() {
    for (int st = 0; st < schedule_.stages_count; ++st) {
      const int r = schedule_.rank_of(st);
      for (int mb = 0; mb < schedule_.micro_batches; ++mb) {
        const Seen& sn = seen(st, mb);
        auto missing = [&](ActionType t, const char* rule, const std::string& detail,
                           const std::string& fix) {
          fail(r, format_action({st, t, mb}), "missing", rule, detail, fix);
        };
        if (sn.f == kUnseen) {
          missing(
              ActionType::kForward, "missing F",
              "stage " + std::to_string(st) + " never runs F for micro-batch " + std::to_string(mb),
              "Every stage runs F once for each of the " + std::to_string(schedule_.micro_batches) +
                  " micro-batches.");
        }
        if (sn.backward() == kUnseen) {
          missing(ActionType::kBackward, "B or I+W",
                  "stage " + std::to_string(st) +
                      " never runs a backward (B or I) for micro-batch " + std::to_string(mb),
                  "Add a B, or an I and a W, after its F.");
        }
        if (sn.i != kUnseen && sn.w == kUnseen) {
          missing(ActionType::kBackwardWeight, "B or I+W",
                  "micro-batch " + std::to_string(mb) + " of stage " + std::to_string(st) +
                      " ran I but never W",
                  "Add the W after the I, or fuse them into one B.");
        }
        if (!comms_) continue;
        auto need = [&](bool needed, int slot, ActionType t, const char* rule) {
          if (needed && slot == kUnseen) {
            missing(t, rule, "the cross-rank transfer has no " + std::string(action_type_code(t)),
                    "Lower the compute schedule with lower_communication.");
          }
        };
        need(cross_next(st, r), sn.send_f, ActionType::kSendForward, "SEND after producer");
        need(cross_prev(st, r), sn.recv_f, ActionType::kRecvForward, "RECV before consumer");
        need(cross_prev(st, r), sn.send_b, ActionType::kSendBackward, "SEND after producer");
        need(cross_next(st, r), sn.recv_b, ActionType::kRecvBackward, "RECV before consumer");
      }
    }
  }

  const Schedule& schedule_;
  bool comms_ = false;
  std::vector<Seen> seen_;
};

}  // namespace

void validate_schedule(const Schedule& schedule) {
  Validator(schedule).run();
  simulate(schedule, CostModel{});  // throws on cross-rank deadlock
}

}  // namespace pipemat::schedule
