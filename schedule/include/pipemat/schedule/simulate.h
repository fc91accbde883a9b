#pragma once
// Simulator: runs the per-rank action lists of a Schedule against a cost model and reports when
// every action starts and ends, the makespan, the bubble ratio and the peak number of in-flight
// activations per rank.
//
// Semantics (the Note [Executor contract] of schedule.h, with durations):
//   - a rank runs its list in order, one action at a time; time starts at 0 on every rank;
//   - F, B, I, W, R take cost F, B, I, W, R; with lazy recompute B and I also take R;
//   - SEND_* / RECV_* take no rank time: SEND is issued, RECV is posted;
//   - a message arrives at max(send issued, receive posted) + its cost (comm latency + bytes /
//     bandwidth); the consuming F / B / I starts no earlier than its arrival. Without comm
//     actions (a compute-only schedule) a cross-rank input arrives at producer end + that cost.
//     A local hand-off arrives at producer end.
//   - busy time of a rank = sum of its compute durations; bubble_ratio =
//     1 - sum(busy) / (ranks_count * makespan).
//   - in-flight activations: F(s,i) adds one on its rank; the last of B(s,i) / W(s,i) removes it.
//   - ranks that compute at the same time slow each other down: Note [Shared cores].
// A schedule whose lists cannot all run to the end throws ScheduleError ("cross-rank deadlock")
// naming, for every unfinished rank, the blocked action, its position and what it waits for.
//
// Note [Shared cores]
// ~~~~~~~~~~~~~~~~~~~
// Ranks that compute at the same time slow each other down. While k >= 2 ranks are inside a
// compute action, each progresses at s * min(1, c / k) of its speed: c =
// SimulateOptions::parallel_ranks (0: k), the ranks that can compute at once (the machine's cores
// over each rank's threads; with more, the kernel shares c cores between k busy processes), and
// s = SimulateOptions::shared_speed, what is left of a rank's speed while others compute too
// (shared caches and memory bandwidth, the transport's threads, switching between processes). A
// rank computing alone runs at full speed; one that waits for a message takes no core. Such a
// simulation still waits on the same inputs; busy is then the wall time inside compute actions,
// not their cost. Time advances from event to event (an action's end, a message's arrival);
// between two events every computing rank runs at the same speed.
//
// Thread safety: pure functions over values.

#include <optional>
#include <string>
#include <vector>

#include "pipemat/schedule/schedule.h"

namespace pipemat::schedule {

struct CostModel {
  double forward = 1.0;             // F
  std::optional<double> backward;   // B; default backward_input + backward_weight
  double backward_input = 1.0;      // I
  double backward_weight = 1.0;     // W
  std::optional<double> recompute;  // R; default 0 without recompute, F with it
  double comm = 0.0;                // latency of one message between ranks
  double bandwidth = 0.0;           // bytes per time unit of a link; 0: no transfer time
  double message_bytes = 0.0;       // bytes of one stage-boundary message (activation or grad)

  // What one cross-rank message takes: comm + message_bytes / bandwidth.
  double message_cost() const { return comm + (bandwidth > 0 ? message_bytes / bandwidth : 0.0); }
  double backward_cost() const { return backward.value_or(backward_input + backward_weight); }
  double recompute_cost(RecomputeMode mode) const {
    return recompute.value_or(mode == RecomputeMode::kNone ? 0.0 : forward);
  }
};

// Parses "F=1,I=1,W=1,B=2,R=1,comm=0,bw=0,bytes=0" (any subset, any order, keys
// case-insensitive; bw is bandwidth, bytes is message_bytes).
// Unset keys keep the defaults of CostModel. ConfigError naming the item for an unknown key, a
// value that is not a non-negative number, or an empty item.
CostModel parse_costs(const std::string& text);
// "F=1,B=2,I=1,W=1,R=0,comm=0" with the resolved values for `mode`, then ",bw=..,bytes=.." when
// a bandwidth is set.
std::string format_costs(const CostModel& costs, RecomputeMode mode);

struct TimedAction {
  Action action;
  int position = 0;  // index in the rank's list
  double start = 0.0;
  double end = 0.0;
};

struct RankTimeline {
  int rank = 0;
  std::vector<TimedAction> actions;  // every action of the list, in list order
  double busy = 0.0;                 // time in compute actions
  double first_start = 0.0;          // start of the first compute action
  double last_end = 0.0;             // end of the last compute action
  int peak_activations = 0;
};

struct SimulationResult {
  double makespan = 0.0;
  double bubble_ratio = 0.0;
  std::vector<RankTimeline> ranks;
};

// The worst rank's idle share inside its own span: max over ranks of
// 1 - busy / (last_end - first_start). Unlike bubble_ratio it ignores the start stagger and the
// early finish of ranks, which is how the zero-bubble papers count ZB-H2 and ZB-V as bubble-free.
double span_bubble_ratio(const SimulationResult& result);

struct SimulateOptions {
  // Model sends that block until the peer has posted the matching receive (MPI rendezvous for
  // large messages, or a runtime that waits on each send). The default models the executor
  // contract: sends are issued and completed later, never waited on before the next action.
  bool rendezvous_sends = false;
  // Note [Shared cores]. How many ranks can compute at once: the machine's cores over each
  // rank's threads when the ranks share one machine (0: every rank has its own cores), and a
  // rank's speed, in (0, 1], while other ranks compute too.
  int parallel_ranks = 0;
  double shared_speed = 1.0;
};

// Simulates a structurally valid schedule (run validate_schedule's per-rank rules first;
// build_schedule and import_torch_csv do). Throws ScheduleError on deadlock.
SimulationResult simulate(const Schedule& schedule, const CostModel& costs = {},
                          const SimulateOptions& options = {});
// The same with costs per model stage (size stages_count): stage s runs its F, B, I, W and R with
// stage_costs[s], and a message takes the message_cost() of the stage that sends it. For stages
// that hold different work, e.g. a remat plan that recomputes on some stages only.
SimulationResult simulate(const Schedule& schedule, const std::vector<CostModel>& stage_costs,
                          const SimulateOptions& options = {});

}  // namespace pipemat::schedule
