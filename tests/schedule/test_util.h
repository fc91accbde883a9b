#pragma once
// Helpers shared by the schedule tests.

#include <string>
#include <vector>

#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::schedule::testing {

inline ScheduleOptions options(ScheduleKind kind, int p, int m, int v = 1,
                               RecomputeMode recompute = RecomputeMode::kNone) {
  ScheduleOptions o;
  o.kind = kind;
  o.ranks = p;
  o.micro_batches = m;
  o.virtual_stages = v;
  o.recompute = recompute;
  return o;
}

// Per-rank compute lists as action strings.
inline std::vector<std::vector<std::string>> compute_strings(const Schedule& s) {
  std::vector<std::vector<std::string>> out;
  for (int r = 0; r < s.ranks_count; ++r) out.push_back(format_actions(s.compute_actions(r)));
  return out;
}

inline std::vector<Action> parse_list(const std::vector<std::string>& texts) {
  std::vector<Action> out;
  for (const auto& t : texts) out.push_back(parse_action(t));
  return out;
}

// A compute-only schedule with a plain loop map from explicit per-rank lists.
inline Schedule from_lists(int stages, int micro_batches,
                           const std::vector<std::vector<std::string>>& lists) {
  Schedule s;
  s.kind = ScheduleKind::kImported;
  s.ranks_count = static_cast<int>(lists.size());
  s.stages_count = stages;
  s.micro_batches = micro_batches;
  s.virtual_stages = stages / s.ranks_count;
  s.stage_to_rank = loop_stage_to_rank(s.ranks_count, stages);
  for (const auto& l : lists) s.actions.push_back(parse_list(l));
  return s;
}

}  // namespace pipemat::schedule::testing
