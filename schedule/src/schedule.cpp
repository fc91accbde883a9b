// Schedule value type, names, stage maps, and the passes insert R / lower / strip / build.

#include "pipemat/schedule/schedule.h"

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::schedule {

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kZeroBubbleH1:
      return "zb-h1";
    case ScheduleKind::kZeroBubbleH2:
      return "zb-h2";
    case ScheduleKind::kZeroBubbleV:
      return "zb-v";
    case ScheduleKind::kImported:
      return "imported";
  }
  return "?";
}

const char* to_string(RecomputeMode mode) {
  switch (mode) {
    case RecomputeMode::kNone:
      return "none";
    case RecomputeMode::kLazy:
      return "lazy";
    case RecomputeMode::kPretrigger:
      return "pretrigger";
  }
  return "?";
}

const char* to_string(StageLayout layout) {
  switch (layout) {
    case StageLayout::kLoop:
      return "loop";
    case StageLayout::kV:
      return "v";
    case StageLayout::kCustom:
      return "custom";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& text) {
  for (ScheduleKind k :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
        ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
    if (text == to_string(k)) return k;
  }
  PIPEMAT_THROW(ConfigError, "--kind '", text,
                "' is not a schedule; expected one of gpipe, 1f1b, interleaved, zb-h1, zb-h2, "
                "zb-v (or --import FILE.csv for a torch schedule).");
}

RecomputeMode parse_recompute_mode(const std::string& text) {
  for (RecomputeMode m : {RecomputeMode::kNone, RecomputeMode::kLazy, RecomputeMode::kPretrigger}) {
    if (text == to_string(m)) return m;
  }
  PIPEMAT_THROW(ConfigError, "--recompute '", text,
                "' is not a recompute placement; expected none, lazy or pretrigger.");
}

std::vector<int> loop_stage_to_rank(int ranks, int stages) {
  PIPEMAT_INTERNAL_ASSERT(ranks > 0 && stages >= 0);
  std::vector<int> map(stages);
  for (int s = 0; s < stages; ++s) map[s] = s % ranks;
  return map;
}

std::vector<int> v_stage_to_rank(int ranks) {
  std::vector<int> map(static_cast<size_t>(ranks) * 2);
  for (int r = 0; r < ranks; ++r) {
    map[r] = r;
    map[2 * ranks - 1 - r] = r;
  }
  return map;
}

int Schedule::rank_of(int stage) const {
  PIPEMAT_CHECK(stage >= 0 && stage < static_cast<int>(stage_to_rank.size()), ScheduleError,
                "stage ", stage, " is outside the schedule's ", stage_to_rank.size(), " stages");
  return stage_to_rank[stage];
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(stage_to_rank.size()); ++s) {
    if (stage_to_rank[s] == rank) out.push_back(s);
  }
  return out;
}

bool Schedule::is_local_handoff(int from, int to) const {
  if (std::abs(from - to) != 1) return false;
  if (from < 0 || to < 0 || from >= stages_count || to >= stages_count) return false;
  return rank_of(from) == rank_of(to);
}

bool Schedule::has_comms() const {
  for (const auto& list : actions) {
    for (const Action& a : list) {
      if (is_comm(a.type)) return true;
    }
  }
  return false;
}

std::vector<Action> Schedule::compute_actions(int rank) const {
  std::vector<Action> out;
  for (const Action& a : actions.at(rank)) {
    if (is_compute(a.type)) out.push_back(a);
  }
  return out;
}

Action matching_action(const Action& comm) {
  switch (comm.type) {
    case ActionType::kSendForward:
      return {comm.stage + 1, ActionType::kRecvForward, comm.micro_batch};
    case ActionType::kRecvForward:
      return {comm.stage - 1, ActionType::kSendForward, comm.micro_batch};
    case ActionType::kSendBackward:
      return {comm.stage - 1, ActionType::kRecvBackward, comm.micro_batch};
    case ActionType::kRecvBackward:
      return {comm.stage + 1, ActionType::kSendBackward, comm.micro_batch};
    default:
      PIPEMAT_THROW(ScheduleError, "matching_action: ", format_action(comm),
                    " is a compute action; only SEND_F, RECV_F, SEND_B and RECV_B have a peer.");
  }
}

int peer_rank(const Schedule& schedule, const Action& comm) {
  return schedule.rank_of(matching_action(comm).stage);
}

int message_id(const Schedule& schedule, const Action& comm) {
  const Action other = matching_action(comm);
  const bool forward =
      comm.type == ActionType::kSendForward || comm.type == ActionType::kRecvForward;
  const bool sending =
      comm.type == ActionType::kSendForward || comm.type == ActionType::kSendBackward;
  const int sender_stage = sending ? comm.stage : other.stage;
  return ((forward ? 0 : schedule.stages_count) + sender_stage) * schedule.micro_batches +
         comm.micro_batch;
}

namespace {

bool is_backward_pass(ActionType t) {
  return t == ActionType::kBackward || t == ActionType::kBackwardInput;
}

}  // namespace

Schedule insert_recompute(Schedule schedule, RecomputeMode mode) {
  bool has_r = false;
  for (const auto& list : schedule.actions) {
    for (const Action& a : list) has_r = has_r || a.type == ActionType::kRecompute;
  }
  PIPEMAT_CHECK(!has_r || mode == RecomputeMode::kPretrigger, ScheduleError,
                "the schedule already holds R (recompute) actions, which only the 'pretrigger' "
                "placement has, but recompute '",
                to_string(mode),
                "' was asked for. Use --recompute pretrigger, or remove the R actions.");
  schedule.recompute = mode;
  if (mode != RecomputeMode::kPretrigger) return schedule;
  for (auto& list : schedule.actions) {
    std::vector<Action> out;
    out.reserve(list.size() + list.size() / 2);
    std::vector<std::pair<int, int>> has_recompute;
    for (const Action& a : list) {
      if (a.type == ActionType::kRecompute) has_recompute.emplace_back(a.stage, a.micro_batch);
    }
    for (const Action& a : list) {
      if (is_backward_pass(a.type)) {
        const std::pair<int, int> key{a.stage, a.micro_batch};
        if (std::find(has_recompute.begin(), has_recompute.end(), key) == has_recompute.end()) {
          out.push_back({a.stage, ActionType::kRecompute, a.micro_batch});
          has_recompute.push_back(key);
        }
      }
      out.push_back(a);
    }
    list = std::move(out);
  }
  return schedule;
}

Schedule lower_communication(const Schedule& schedule) {
  if (schedule.has_comms()) return schedule;
  Schedule out = schedule;
  const int stages = schedule.stages_count;
  for (int r = 0; r < schedule.ranks_count; ++r) {
    const auto& list = schedule.actions[r];
    const int n = static_cast<int>(list.size());
    std::vector<std::vector<Action>> before(n + 1), after(n);
    for (int j = 0; j < n; ++j) {
      const Action& a = list[j];
      const int s = a.stage, i = a.micro_batch;
      std::optional<Action> recv;
      if (a.type == ActionType::kForward && s > 0 && schedule.rank_of(s - 1) != r) {
        recv = Action{s, ActionType::kRecvForward, i};
      }
      if (is_backward_pass(a.type) && s < stages - 1 && schedule.rank_of(s + 1) != r) {
        recv = Action{s, ActionType::kRecvBackward, i};
      }
      if (recv) {
        // Post one compute action ahead of the consumer, skipping its own pre-triggered R, so
        // the transfer overlaps that compute (and the replay). A gradient receive never goes
        // ahead of the micro-batch's own F on this stage.
        int k = j - 1;
        while (k >= 0 && list[k].type == ActionType::kRecompute && list[k].stage == s &&
               list[k].micro_batch == i) {
          --k;
        }
        int pos = std::max(k, 0);
        // Keep a pre-triggered R glued to its B / I: post ahead of the R instead.
        while (pos > 0 && list[pos - 1].type == ActionType::kRecompute &&
               is_backward_pass(list[pos].type) && list[pos - 1].stage == list[pos].stage &&
               list[pos - 1].micro_batch == list[pos].micro_batch) {
          --pos;
        }
        if (recv->type == ActionType::kRecvBackward) {
          for (int f = 0; f < j; ++f) {
            if (list[f].type == ActionType::kForward && list[f].stage == s &&
                list[f].micro_batch == i && pos <= f) {
              pos = f + 1;
            }
          }
        }
        before[pos].push_back(*recv);
      }
      if (a.type == ActionType::kForward && s < stages - 1 && schedule.rank_of(s + 1) != r) {
        after[j].push_back({s, ActionType::kSendForward, i});
      }
      if (is_backward_pass(a.type) && s > 0 && schedule.rank_of(s - 1) != r) {
        after[j].push_back({s, ActionType::kSendBackward, i});
      }
    }
    auto& lowered = out.actions[r];
    lowered.clear();
    for (int j = 0; j < n; ++j) {
      lowered.insert(lowered.end(), before[j].begin(), before[j].end());
      lowered.push_back(list[j]);
      lowered.insert(lowered.end(), after[j].begin(), after[j].end());
    }
    lowered.insert(lowered.end(), before[n].begin(), before[n].end());
  }
  return out;
}

Schedule strip_communication(const Schedule& schedule) {
  Schedule out = schedule;
  for (int r = 0; r < schedule.ranks_count; ++r) out.actions[r] = schedule.compute_actions(r);
  return out;
}

Schedule build_schedule(const ScheduleOptions& options) {
  Schedule generated = generate_schedule(options);
  validate_schedule(generated);
  Schedule lowered = lower_communication(insert_recompute(std::move(generated), options.recompute));
  validate_schedule(lowered);
  return lowered;
}

}  // namespace pipemat::schedule
