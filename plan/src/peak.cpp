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

PeakForms peak_forms(const schedule::Schedule& schedule, int rank,
                     const std::vector<StageBytes>& stage_bytes) {
  using schedule::ActionType;
  PeakForms forms;
  forms.stages = schedule.stages_of(rank);
  const size_t n = forms.stages.size();
  auto local = [&](int stage) {
    return static_cast<size_t>(std::lower_bound(forms.stages.begin(), forms.stages.end(), stage) -
                               forms.stages.begin());
  };
  const StageBytes none;
  auto bytes_of = [&](int stage) -> const StageBytes& {
    return static_cast<size_t>(stage) < stage_bytes.size() ? stage_bytes[stage] : none;
  };
  std::vector<int> resident(n, 0), replay(n, 0);
  double gradients = 0.0;  // of the stages whose first B / W has started
  double held = 0.0;       // what the I passes whose W has not run yet left
  std::vector<bool> has_gradients(n, false);
  // Posted receives: a message may land any time after its receive is posted, so its bytes count
  // from then until the action that takes it is over (F: its input joins the resident bytes).
  double posted = 0.0;
  std::set<std::pair<int, int>> input_posted, gradient_posted;  // (stage, micro-batch)
  // A sent tensor stays until its send has finished: counted through the next compute action
  // (a rank drops finished sends after every action).
  double sending = 0.0;
  using Temporary = PeakForms::Temporary;
  std::set<std::tuple<std::vector<int>, std::vector<int>, double, Temporary, int>> seen;
  for (const schedule::Action& a : schedule.actions[static_cast<size_t>(rank)]) {
    const StageBytes& bytes = bytes_of(a.stage);
    if (a.type == ActionType::kRecvForward) {
      posted += bytes.received_input;
      input_posted.insert({a.stage, a.micro_batch});
      continue;
    }
    if (a.type == ActionType::kRecvBackward) {
      posted += bytes.received_gradient;
      gradient_posted.insert({a.stage, a.micro_batch});
      continue;
    }
    if (a.type == ActionType::kSendForward) {  // what stage s + 1 receives
      sending += bytes_of(a.stage + 1).received_input;
      continue;
    }
    if (a.type == ActionType::kSendBackward) {  // what stage s - 1 receives
      sending += a.stage > 0 ? bytes_of(a.stage - 1).received_gradient : 0.0;
      continue;
    }
    if (!schedule::is_compute(a.type)) continue;
    const size_t s = local(a.stage);
    if (a.type == ActionType::kForward && input_posted.erase({a.stage, a.micro_batch}) > 0) {
      posted -= bytes.received_input;  // now in the stage's resident bytes
    }
    double temporaries = 0.0;  // of I and W; those of F, R and B depend on the layers' choices
    Temporary kind = Temporary::kNone;
    switch (a.type) {
      case ActionType::kForward:
        ++resident[s];
        kind = Temporary::kForward;
        break;
      case ActionType::kRecompute:
        ++replay[s];
        kind = Temporary::kRecompute;
        break;
      case ActionType::kBackward:
      case ActionType::kBackwardWeight:
        if (!has_gradients[s]) {
          // A first B creates the gradients as it goes: at its peak it holds what its
          // measurement says (first_backward_gradients) on top of a later B's temporaries.
          const bool measured =
              a.type == ActionType::kBackward && bytes.first_backward_gradients >= 0;
          temporaries = measured ? bytes.first_backward_gradients - bytes.gradients : 0.0;
          gradients += bytes.gradients;
        }
        has_gradients[s] = true;
        if (a.type == ActionType::kBackward) {
          kind = Temporary::kBackward;
        } else {
          temporaries += bytes.backward_weight;
        }
        break;
      case ActionType::kBackwardInput:
        temporaries = bytes.backward_input;
        break;
      default:
        break;
    }
    const double constant = gradients + held + posted + sending + temporaries;
    sending = 0.0;
    const int stage = kind == Temporary::kNone ? -1 : a.stage;
    if (seen.insert({resident, replay, constant, kind, stage}).second) {
      forms.resident_count.push_back(resident);
      forms.replay_count.push_back(replay);
      forms.constant.push_back(constant);
      forms.temporary.push_back(kind);
      forms.temporary_stage.push_back(stage);
    }
    // What the action frees (or, for I, leaves) at its end.
    if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
        gradient_posted.erase({a.stage, a.micro_batch}) > 0) {
      posted -= bytes.received_gradient;
    }
    switch (a.type) {
      case ActionType::kBackward:
        --resident[s];
        if (replay[s] > 0) --replay[s];
        break;
      case ActionType::kBackwardInput:
        held += bytes.input_held;
        break;
      case ActionType::kBackwardWeight:
        --resident[s];
        if (replay[s] > 0) --replay[s];
        held -= bytes.input_held;
        break;
      default:
        break;
    }
  }
  return forms;
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
