// The per-rank memory model of Note [Plan memory], read off the schedule's action order.

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "internal.h"
#include "pipemat/core/error.h"

namespace pipemat::plan::detail {

void StageSums::add(const Candidate& c) {
  resident += c.resident_bytes;
  replayed += c.replayed_bytes;
  forward += c.forward;
  backward_input += c.backward_input;
  backward_weight += c.backward_weight;
  recompute += c.recompute;
  backward += c.backward > 0 ? c.backward : c.backward_input + c.backward_weight;
  forward_temporary = std::max(forward_temporary, c.forward_temporary_bytes);
  recompute_temporary = std::max(recompute_temporary, c.recompute_temporary_bytes);
  backward_temporary = std::max(backward_temporary, c.backward_temporary_bytes);
}

schedule::CostModel StageSums::costs(double message_cost) const {
  schedule::CostModel c;
  c.forward = forward;
  c.backward_input = backward_input;
  c.backward_weight = backward_weight;
  c.recompute = recompute;
  c.backward = backward;
  c.comm = message_cost;
  return c;
}

namespace {

using schedule::ActionType;
using Temporary = PeakForms::Temporary;

// One pass over a rank's actions, keeping the bytes that are alive before the next action.
class PeakWalk {
 public:
  PeakWalk(const schedule::Schedule& schedule, int rank, const std::vector<StageBytes>& stage_bytes)
      : stage_bytes_(stage_bytes) {
    forms_.stages = schedule.stages_of(rank);
    const size_t n = forms_.stages.size();
    resident_.assign(n, 0);
    replay_.assign(n, 0);
    has_gradients_.assign(n, false);
  }

  PeakForms run(const std::vector<schedule::Action>& actions) {
    for (const schedule::Action& a : actions) {
      if (note_comm(a)) continue;
      if (schedule::is_compute(a.type)) compute(a);
    }
    return std::move(forms_);
  }

 private:
  size_t local(int stage) const {
    return static_cast<size_t>(std::lower_bound(forms_.stages.begin(), forms_.stages.end(), stage) -
                               forms_.stages.begin());
  }
  const StageBytes& bytes_of(int stage) const {
    return static_cast<size_t>(stage) < stage_bytes_.size() ? stage_bytes_[stage] : none_;
  }

  // A RECV or SEND: the bytes it keeps alive; false for any other action.
  bool note_comm(const schedule::Action& a) {
    const StageBytes& bytes = bytes_of(a.stage);
    if (a.type == ActionType::kRecvForward) {
      posted_ += bytes.received_input;
      input_posted_.insert({a.stage, a.micro_batch});
      return true;
    }
    if (a.type == ActionType::kRecvBackward) {
      posted_ += bytes.received_gradient;
      gradient_posted_.insert({a.stage, a.micro_batch});
      return true;
    }
    if (a.type == ActionType::kSendForward) {  // what stage s + 1 receives
      sending_ += bytes_of(a.stage + 1).received_input;
      return true;
    }
    if (a.type == ActionType::kSendBackward) {  // what stage s - 1 receives
      sending_ += a.stage > 0 ? bytes_of(a.stage - 1).received_gradient : 0.0;
      return true;
    }
    return false;
  }

  void compute(const schedule::Action& a) {
    const StageBytes& bytes = bytes_of(a.stage);
    const size_t s = local(a.stage);
    if (a.type == ActionType::kForward && input_posted_.erase({a.stage, a.micro_batch}) > 0) {
      posted_ -= bytes.received_input;  // now in the stage's resident bytes
    }
    double temporaries = 0.0;  // of I and W; those of F, R and B depend on the layers' choices
    const Temporary kind = start(a, s, bytes, temporaries);
    const double constant = gradients_ + held_ + posted_ + sending_ + temporaries;
    sending_ = 0.0;
    record(constant, kind, kind == Temporary::kNone ? -1 : a.stage);
    finish(a, s, bytes);
  }

  // What the action adds at its start; returns the kind of its layer-dependent temporaries.
  Temporary start(const schedule::Action& a, size_t s, const StageBytes& bytes,
                  double& temporaries) {
    switch (a.type) {
      case ActionType::kForward:
        ++resident_[s];
        return Temporary::kForward;
      case ActionType::kRecompute:
        ++replay_[s];
        return Temporary::kRecompute;
      case ActionType::kBackward:
      case ActionType::kBackwardWeight:
        if (!has_gradients_[s]) {
          // A first B creates the gradients as it goes: at its peak it holds what its
          // measurement says (first_backward_gradients) on top of a later B's temporaries.
          const bool measured =
              a.type == ActionType::kBackward && bytes.first_backward_gradients >= 0;
          temporaries = measured ? bytes.first_backward_gradients - bytes.gradients : 0.0;
          gradients_ += bytes.gradients;
        }
        has_gradients_[s] = true;
        if (a.type == ActionType::kBackward) return Temporary::kBackward;
        temporaries += bytes.backward_weight;
        return Temporary::kNone;
      case ActionType::kBackwardInput:
        temporaries = bytes.backward_input;
        return Temporary::kNone;
      default:
        return Temporary::kNone;
    }
  }

  // Adds the form of the current point unless an identical one is already there.
  void record(double constant, Temporary kind, int stage) {
    if (seen_.insert({resident_, replay_, constant, kind, stage}).second) {
      forms_.resident_count.push_back(resident_);
      forms_.replay_count.push_back(replay_);
      forms_.constant.push_back(constant);
      forms_.temporary.push_back(kind);
      forms_.temporary_stage.push_back(stage);
    }
  }

  // What the action frees (or, for I, leaves) at its end.
  void finish(const schedule::Action& a, size_t s, const StageBytes& bytes) {
    if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
        gradient_posted_.erase({a.stage, a.micro_batch}) > 0) {
      posted_ -= bytes.received_gradient;
    }
    switch (a.type) {
      case ActionType::kBackward:
        --resident_[s];
        if (replay_[s] > 0) --replay_[s];
        break;
      case ActionType::kBackwardInput:
        held_ += bytes.input_held;
        break;
      case ActionType::kBackwardWeight:
        --resident_[s];
        if (replay_[s] > 0) --replay_[s];
        held_ -= bytes.input_held;
        break;
      default:
        break;
    }
  }

  const std::vector<StageBytes>& stage_bytes_;
  const StageBytes none_;
  PeakForms forms_;
  std::vector<int> resident_, replay_;
  double gradients_ = 0.0;  // of the stages whose first B / W has started
  double held_ = 0.0;       // what the I passes whose W has not run yet left
  std::vector<bool> has_gradients_;
  // Posted receives: a message may land any time after its receive is posted, so its bytes count
  // from then until the action that takes it is over (F: its input joins the resident bytes).
  double posted_ = 0.0;
  std::set<std::pair<int, int>> input_posted_, gradient_posted_;  // (stage, micro-batch)
  // A sent tensor stays until its send has finished: counted through the next compute action
  // (a rank drops finished sends after every action).
  double sending_ = 0.0;
  std::set<std::tuple<std::vector<int>, std::vector<int>, double, Temporary, int>> seen_;
};

}  // namespace

PeakForms peak_forms(const schedule::Schedule& schedule, int rank,
                     const std::vector<StageBytes>& stage_bytes) {
  return PeakWalk(schedule, rank, stage_bytes).run(schedule.actions[static_cast<size_t>(rank)]);
}

double PeakForms::peak(const std::vector<StageSums>& sums) const {
  double worst = 0.0;
  for (size_t f = 0; f < resident_count.size(); ++f) {
    double bytes = constant[f];
    for (size_t s = 0; s < stages.size(); ++s) {
      const StageSums& sum = sums[stages[s]];
      bytes += resident_count[f][s] * sum.resident + replay_count[f][s] * sum.replayed;
    }
    if (temporary[f] != Temporary::kNone) {
      const StageSums& sum = sums[temporary_stage[f]];
      bytes += temporary[f] == Temporary::kForward     ? sum.forward_temporary
               : temporary[f] == Temporary::kRecompute ? sum.recompute_temporary
                                                       : sum.backward_temporary;
    }
    worst = std::max(worst, bytes);
  }
  return worst;
}

}  // namespace pipemat::plan::detail
