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
}

schedule::CostModel StageSums::costs(double message_cost) const {
  schedule::CostModel c;
  c.forward = forward;
  c.backward_input = backward_input;
  c.backward_weight = backward_weight;
  c.recompute = recompute;
  c.comm = message_cost;
  return c;
}

PeakForms peak_forms(const schedule::Schedule& schedule, int rank,
                     const std::vector<double>& gradient_bytes,
                     const std::vector<double>& backward_bytes) {
  PeakForms forms;
  forms.stages = schedule.stages_of(rank);
  const size_t n = forms.stages.size();
  auto local = [&](int stage) {
    return static_cast<size_t>(std::lower_bound(forms.stages.begin(), forms.stages.end(), stage) -
                               forms.stages.begin());
  };
  std::vector<int> resident(n, 0), replay(n, 0);
  double gradients = 0.0;  // of the stages whose first B / W has started
  std::vector<bool> has_gradients(n, false);
  // A micro-batch's replay is freed by its B or I; its resident bytes by its B or W.
  std::set<std::tuple<std::vector<int>, std::vector<int>, double>> seen;
  for (const schedule::Action& a : schedule.compute_actions(rank)) {
    const size_t s = local(a.stage);
    switch (a.type) {
      case schedule::ActionType::kForward:
        ++resident[s];
        break;
      case schedule::ActionType::kRecompute:
        ++replay[s];
        break;
      case schedule::ActionType::kBackward:
      case schedule::ActionType::kBackwardWeight:
        if (!has_gradients[s] && static_cast<size_t>(a.stage) < gradient_bytes.size()) {
          gradients += gradient_bytes[static_cast<size_t>(a.stage)];
        }
        has_gradients[s] = true;
        break;
      default:
        break;
    }
    double temporaries = 0.0;
    const bool backward = a.type == schedule::ActionType::kBackward ||
                          a.type == schedule::ActionType::kBackwardInput ||
                          a.type == schedule::ActionType::kBackwardWeight;
    if (backward && static_cast<size_t>(a.stage) < backward_bytes.size()) {
      temporaries = backward_bytes[static_cast<size_t>(a.stage)];
    }
    if (seen.insert({resident, replay, gradients + temporaries}).second) {
      forms.resident_count.push_back(resident);
      forms.replay_count.push_back(replay);
      forms.constant.push_back(gradients + temporaries);
    }
    switch (a.type) {
      case schedule::ActionType::kBackward:
        --resident[s];
        if (replay[s] > 0) --replay[s];
        break;
      case schedule::ActionType::kBackwardInput:
        if (replay[s] > 0) --replay[s];
        break;
      case schedule::ActionType::kBackwardWeight:
        --resident[s];
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
    worst = std::max(worst, bytes);
  }
  return worst;
}

}  // namespace pipemat::plan::detail
