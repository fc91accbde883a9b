// Schedule value type, names, stage maps, and the passes insert R / lower / strip / build.
//
// What lives where in schedule/src (the public headers are listed in schedule.h): action.cpp,
// generate.cpp (one generator per kind), schedule.cpp (this file), validate.cpp, simulate.cpp
// (and cost parsing), render.cpp, torch_csv.cpp, project.cpp, command.cpp.

#include "pipemat/schedule/schedule.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/schedule/simulate.h"

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
    std::set<std::pair<int, int>> has_recompute;
    for (const Action& a : list) {
      if (a.type == ActionType::kRecompute) has_recompute.emplace(a.stage, a.micro_batch);
    }
    for (const Action& a : list) {
      if (is_backward_pass(a.type) && has_recompute.emplace(a.stage, a.micro_batch).second) {
        out.push_back({a.stage, ActionType::kRecompute, a.micro_batch});
      }
      out.push_back(a);
    }
    list = std::move(out);
  }
  return schedule;
}

std::vector<int> stages_whose_replay_follows_forward(const Schedule& schedule) {
  std::vector<int> out;
  std::vector<bool> has_r(static_cast<size_t>(schedule.stages_count), false);
  std::vector<bool> broken(static_cast<size_t>(schedule.stages_count), false);
  for (const auto& list : schedule.actions) {
    const Action* forward = nullptr;  // the last compute action, when it is an F
    for (const Action& a : list) {
      if (!is_compute(a.type)) continue;
      if (a.type == ActionType::kRecompute) has_r[static_cast<size_t>(a.stage)] = true;
      if (forward != nullptr && !(a.type == ActionType::kRecompute && a.stage == forward->stage &&
                                  a.micro_batch == forward->micro_batch)) {
        broken[static_cast<size_t>(forward->stage)] = true;
      }
      forward = a.type == ActionType::kForward ? &a : nullptr;
    }
    if (forward != nullptr) broken[static_cast<size_t>(forward->stage)] = true;
  }
  for (int s = 0; s < schedule.stages_count; ++s) {
    if (has_r[static_cast<size_t>(s)] && !broken[static_cast<size_t>(s)]) out.push_back(s);
  }
  return out;
}

namespace {

bool glued_recompute(const std::vector<Action>& list, int r_index) {
  // list[r_index] is a pre-triggered R immediately followed by the B / I it prepares.
  const int n = static_cast<int>(list.size());
  return r_index >= 0 && r_index + 1 < n && list[r_index].type == ActionType::kRecompute &&
         is_backward_pass(list[r_index + 1].type) &&
         list[r_index].stage == list[r_index + 1].stage &&
         list[r_index].micro_batch == list[r_index + 1].micro_batch;
}

// End times of the forward and of the backward (B or I) of every (stage, micro-batch) in the
// reference run of Note [Receive placement].
struct PassEnds {
  std::vector<double> forward, backward;
};

PassEnds pass_ends(const Schedule& schedule, const SimulationResult& timeline) {
  const int mbs = schedule.micro_batches;
  PassEnds ends;
  ends.forward.assign(static_cast<size_t>(schedule.stages_count) * mbs, 0.0);
  ends.backward.assign(ends.forward.size(), 0.0);
  for (const RankTimeline& rank : timeline.ranks) {
    for (const TimedAction& t : rank.actions) {
      const size_t key = static_cast<size_t>(t.action.stage) * mbs + t.action.micro_batch;
      if (t.action.type == ActionType::kForward) ends.forward[key] = t.end;
      if (is_backward_pass(t.action.type)) ends.backward[key] = t.end;
    }
  }
  return ends;
}

// One rank's compute list with the reference run's start of every action.
struct ComputeList {
  const std::vector<Action>& list;
  std::vector<double> starts;
  std::map<std::pair<int, int>, int> forward_index;  // (stage, micro-batch) -> position of F
};

// The slot (Note [Receive placement]) of the receive of list[j], whose send is issued at
// `send_time`. Slot 2j: before list[j]; slot 2j + 1: right after list[j], ahead of its sends.
int receive_slot(const ComputeList& c, int j, double send_time, bool gradient) {
  const Action& a = c.list[j];
  int previous = j - 1;
  while (glued_recompute(c.list, previous)) --previous;
  const int ahead = 2 * std::max(previous, 0);
  // Starts are non-decreasing along the list: the last one before the send is a search.
  const int last_started =
      static_cast<int>(std::lower_bound(c.starts.begin(), c.starts.begin() + j, send_time) -
                       c.starts.begin()) -
      1;
  const int in_time = last_started >= 0 ? 2 * last_started + 1 : 0;
  int slot = std::min({ahead, in_time, 2 * j});
  if (gradient) {
    const auto own_forward = c.forward_index.find({a.stage, a.micro_batch});
    if (own_forward != c.forward_index.end() && own_forward->second < j) {
      slot = std::max(slot, 2 * own_forward->second + 1);
    }
  }
  for (bool moved = true; moved;) {
    moved = false;
    if (slot % 2 == 1 && glued_recompute(c.list, slot / 2)) {
      slot -= 1;
      moved = true;
    } else if (slot % 2 == 0 && slot > 0 && glued_recompute(c.list, slot / 2 - 1)) {
      slot -= 2;
      moved = true;
    }
  }
  return slot;
}

// Rank r's compute list with its receives and sends (Note [Receive placement]).
std::vector<Action> lower_rank(const Schedule& schedule, int r, const RankTimeline& timeline,
                               const PassEnds& ends) {
  const int stages = schedule.stages_count, mbs = schedule.micro_batches;
  ComputeList c{schedule.actions[r], {}, {}};
  const auto& list = c.list;
  const auto& timed = timeline.actions;  // same positions: the list is compute-only
  const int n = static_cast<int>(list.size());
  c.starts.resize(n);
  for (int x = 0; x < n; ++x) {
    c.starts[x] = timed[x].start;
    if (list[x].type == ActionType::kForward)
      c.forward_index[{list[x].stage, list[x].micro_batch}] = x;
  }
  std::vector<std::vector<Action>> slots(2 * static_cast<size_t>(n) + 1);
  std::vector<std::vector<Action>> sends(n);
  for (int j = 0; j < n; ++j) {
    const Action& a = list[j];
    const int s = a.stage, i = a.micro_batch;
    std::optional<Action> recv;
    double send_time = 0.0;
    if (a.type == ActionType::kForward && s > 0 && schedule.rank_of(s - 1) != r) {
      recv = Action{s, ActionType::kRecvForward, i};
      send_time = ends.forward[static_cast<size_t>(s - 1) * mbs + i];
    }
    if (is_backward_pass(a.type) && s < stages - 1 && schedule.rank_of(s + 1) != r) {
      recv = Action{s, ActionType::kRecvBackward, i};
      send_time = ends.backward[static_cast<size_t>(s + 1) * mbs + i];
    }
    if (recv) {
      slots[receive_slot(c, j, send_time, recv->type == ActionType::kRecvBackward)].push_back(
          *recv);
    }
    if (a.type == ActionType::kForward && s < stages - 1 && schedule.rank_of(s + 1) != r) {
      sends[j].push_back({s, ActionType::kSendForward, i});
    }
    if (is_backward_pass(a.type) && s > 0 && schedule.rank_of(s - 1) != r) {
      sends[j].push_back({s, ActionType::kSendBackward, i});
    }
  }
  std::vector<Action> lowered;
  for (int j = 0; j < n; ++j) {
    lowered.insert(lowered.end(), slots[2 * j].begin(), slots[2 * j].end());
    lowered.push_back(list[j]);
    lowered.insert(lowered.end(), slots[2 * j + 1].begin(), slots[2 * j + 1].end());
    lowered.insert(lowered.end(), sends[j].begin(), sends[j].end());
  }
  lowered.insert(lowered.end(), slots[2 * n].begin(), slots[2 * n].end());
  return lowered;
}

}  // namespace

Schedule lower_communication(const Schedule& schedule) {
  if (schedule.has_comms()) return schedule;
  // Note [Receive placement]
  // A receive is posted at the earlier of two points: (a) one compute action ahead of its
  // consumer, so the transfer overlaps that compute; (b) right after the last compute action
  // that starts before the sender issues the send in a unit-cost run of the compute schedule,
  // ahead of that action's own sends. (b) makes the order safe even for sends that block until
  // the receive is posted (rendezvous): every send waits at most for compute that the receiver
  // can already run. Posting earlier never creates a wait, so taking the earlier point keeps
  // both properties. A gradient receive stays after the micro-batch's own F, and never splits
  // a pre-triggered R from its B / I (Note [Recompute placement]). Recompute costs nothing in
  // the reference run, so lazy and pretrigger schedules get the same placement.
  Schedule reference = schedule;
  reference.recompute = RecomputeMode::kNone;
  CostModel unit;
  unit.recompute = 0.0;
  const SimulationResult timeline = simulate(reference, unit);
  const PassEnds ends = pass_ends(schedule, timeline);
  Schedule out = schedule;
  for (int r = 0; r < schedule.ranks_count; ++r) {
    out.actions[r] = lower_rank(schedule, r, timeline.ranks[r], ends);
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
  // Note [Receive placement] promises more than the executor contract needs: the order also
  // survives sends that block until the receive is posted.
  SimulateOptions rendezvous;
  rendezvous.rendezvous_sends = true;
  try {
    simulate(lowered, CostModel{}, rendezvous);
  } catch (const ScheduleError& e) {
    PIPEMAT_INTERNAL_ASSERT(false, "the lowered ", to_string(options.kind),
                            " schedule hangs with rendezvous sends: ", e.what());
  }
  return lowered;
}

}  // namespace pipemat::schedule
