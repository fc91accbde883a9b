#pragma once
// Pipeline schedules: per-rank action lists plus the stage-to-rank map, the generators that
// produce them and the passes that turn them into something a runtime can execute.
//
//   build_schedule(options)  ==  lower_communication(insert_recompute(
//                                    validated(generate_schedule(options)), options.recompute))
//                                followed by validate_schedule on the lowered result.
//
// Errors: every function throws pipemat::ConfigError for option values that are not allowed
// (naming the option, the value and a value that works) and pipemat::ScheduleError for action
// lists that cannot run (naming rank, action, position and the broken rule). Nothing here keeps
// global state; all functions are pure and may be called from any thread concurrently. Schedule
// is a plain value type (copyable, movable) that owns its action lists.
//
// The public headers of schedule (pure C++17: no torch, MPI or Asio):
//   action.h      Action IR: ActionType, Action, format / parse of `2F0`, `0RECV_B2`
//   schedule.h    Schedule, ScheduleOptions, generators and passes (this file)
//   simulate.h    CostModel, simulate(), SimulationResult (timelines, bubble, peak)
//   render.h      text timeline, torch CSV, JSON and SVG of a simulated schedule
//   torch_csv.h   import / export of torch.distributed.pipelining CSV schedules
//   project.h     the scaling projection (`pipemat project`) and its renderers
//   command.h     `pipemat schedule` as a library: CLI options -> schedule -> render
//
// Note [Executor contract]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A pipeline runtime on rank r executes `schedule.actions[r]` of a lowered schedule (one built by
// build_schedule, or passed through lower_communication) strictly in list order:
//   F(s,i)       run stage s forward on micro-batch i. Its input is the model input (s == 0), the
//                tensor received by RECV_F(s,i) (stage s-1 on another rank), or, when stage s-1
//                sits on this rank (is_local_handoff(s-1, s)), the output of F(s-1,i) handed over
//                in memory, with no SEND/RECV.
//   B(s,i)       full backward of (s,i): waits for RECV_B(s,i) (or the local hand-off from stage
//                s+1, or the loss on the last stage), then computes input and weight gradients.
//   I(s,i)       input-gradient backward only; keeps what W(s,i) needs.
//   W(s,i)       weight-gradient pass for the earlier I(s,i); frees the micro-batch's state.
//   R(s,i)       replay the checkpointed forward of (s,i) now (pretrigger recompute, see
//                Note [Recompute placement]); the following B/I(s,i) uses the replayed tensors.
//   SEND_F/B     start a non-blocking send to peer_rank(); never wait on it before the next
//                compute action (complete all sends at the end of the step, or before reusing
//                the buffer).
//   RECV_F/B     post a non-blocking receive from peer_rank(); the consuming F / B / I waits on
//                it right before it computes.
// Messages are matched by (direction, sending stage, micro-batch), see message_id(); do not
// rely on per-peer FIFO order. Under these semantics a schedule that validate_schedule accepts
// cannot deadlock: every receive is posted before its consumer, every send is issued right after
// its producer, and the simulator has checked that the compute order has no cross-rank cycle.
// Schedules from build_schedule / lower_communication are stronger still: they also cannot hang
// when a send blocks until the peer has posted the receive (MPI rendezvous); build_schedule
// checks this with SimulateOptions::rendezvous_sends.
//
// Note [Recompute placement]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// `none`: no stage is checkpointed; activations are kept from F to B / W.
// `lazy`: every stage is checkpointed and replays inside its B / I (classic activation
//   checkpointing). There are no R actions; the simulator adds the R cost to B / I, which is why
//   the replay sits on the critical path after the gradient arrives.
// `pretrigger`: every stage is checkpointed and R(s,i) is an action of its own, placed right
//   before the first B / I of (s,i) and after RECV_B(s,i) has been posted (the lowering posts
//   receives one compute action ahead of their consumer and skips over the R). R depends only
//   on F(s,i), so the replay runs while the gradient is still in flight: B / I then only waits
//   for max(replay, transfer) instead of their sum. It never lengthens the makespan compared
//   with `lazy` and shortens it whenever the rank would otherwise wait for the gradient.

#include <string>
#include <vector>

#include "pipemat/schedule/action.h"

namespace pipemat::schedule {

enum class ScheduleKind {
  kGPipe,         // "gpipe"
  kOneFOneB,      // "1f1b"
  kInterleaved,   // "interleaved" (interleaved 1F1B, v chunks per rank)
  kZeroBubbleH1,  // "zb-h1"
  kZeroBubbleH2,  // "zb-h2"
  kZeroBubbleV,   // "zb-v" (two chunks per rank in a V)
  kImported,      // "imported" (read from a torch CSV)
};

enum class RecomputeMode { kNone, kLazy, kPretrigger };

// How stages map to ranks. kLoop: stage s on rank s % ranks (rank r holds r, r + P, ...).
// kV: rank r holds stages r and 2P - 1 - r (ZB-V). kCustom: any other consistent map (imports).
enum class StageLayout { kLoop, kV, kCustom };

const char* to_string(ScheduleKind kind);
const char* to_string(RecomputeMode mode);
const char* to_string(StageLayout layout);
// Parse the CLI spellings above; throw ConfigError listing the accepted values.
ScheduleKind parse_schedule_kind(const std::string& text);
RecomputeMode parse_recompute_mode(const std::string& text);

// Stage-to-rank maps (index = stage).
std::vector<int> loop_stage_to_rank(int ranks, int stages);
std::vector<int> v_stage_to_rank(int ranks);  // 2 * ranks stages

struct Schedule {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int ranks_count = 1;   // pipeline ranks (`--ranks` on the CLI)
  int stages_count = 1;  // model stages = ranks_count * virtual_stages
  int micro_batches = 1;
  int virtual_stages = 1;  // stages per rank (v); 2 for zb-v
  StageLayout layout = StageLayout::kLoop;
  RecomputeMode recompute = RecomputeMode::kNone;
  std::vector<int> stage_to_rank;            // size stages_count
  std::vector<std::vector<Action>> actions;  // size ranks_count; executed in order per rank

  int rank_of(int stage) const;
  // Stages held by `rank`, ascending.
  std::vector<int> stages_of(int rank) const;
  // True when `from` and `to` are adjacent stages on the same rank: the activation / gradient
  // passes in memory and the lowered schedule has no SEND/RECV for it.
  bool is_local_handoff(int from, int to) const;
  // True when any rank list holds a SEND_* / RECV_* action (the schedule was lowered).
  bool has_comms() const;
  // The list of `rank` without SEND_* / RECV_* actions.
  std::vector<Action> compute_actions(int rank) const;
};

// The rank on the other end of a SEND_* / RECV_* action. ScheduleError for compute actions.
int peer_rank(const Schedule& schedule, const Action& comm);
// The action on the peer that pairs with `comm`: SEND_F(s,i) <-> RECV_F(s+1,i),
// SEND_B(s,i) <-> RECV_B(s-1,i).
Action matching_action(const Action& comm);
// A number that is equal for a SEND and its matching RECV and different for every other message
// of the schedule; usable as a message tag. In [0, 2 * stages_count * micro_batches). MPI only
// guarantees tags up to 32767 (MPI_TAG_UB), i.e. stages_count * micro_batches < 16384; a
// transport with a smaller tag space must map ids itself.
int message_id(const Schedule& schedule, const Action& comm);

// Size limits: generators and the validator refuse schedules with more (stage, micro-batch)
// pairs than this, so that a typo cannot exhaust memory.
constexpr long long kMaxStageMicroBatches = 1LL << 22;

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int ranks = 1;           // pipeline ranks P (YAML `schedule.ranks`)
  int micro_batches = 1;   // M
  int virtual_stages = 1;  // V: chunks per rank (interleaved); zb-v always uses 2
  RecomputeMode recompute = RecomputeMode::kNone;
};

// Compute-only per-rank lists (F, B, I, W) of the chosen generator, not yet validated.
// ConfigError when P, M or V are out of range or the generator's constraints do not hold (the
// message says which and suggests values that work).
Schedule generate_schedule(const ScheduleOptions& options);

// Checks the rules below and throws ScheduleError on the first break, naming rank, action,
// position in the rank's list and the rule:
//   shape: one list per rank, stage_to_rank covers every stage, stage / micro-batch in range;
//   stage-to-rank consistency: every action of stage s is on rank_of(s);
//   per stage and micro-batch: F exactly once; either B or I + W, each once (no duplicate
//   micro-batch); F before B / I / R; I before W; R at most once and before B / I;
//   when the schedule has comms: every cross-rank edge has exactly one SEND after its producer
//   and one RECV before its consumer, and no SEND/RECV exists for a local hand-off;
//   cross-rank deadlock: the lists can all run to the end (checked with the simulator).
void validate_schedule(const Schedule& schedule);

// Returns `schedule` with recompute mode `mode`; for kPretrigger inserts R(s,i) right before the
// first B / I of every (s,i) (Note [Recompute placement]). ScheduleError when the schedule
// already holds R actions and `mode` is not kPretrigger.
Schedule insert_recompute(Schedule schedule, RecomputeMode mode);

// Note [Replays that cannot lower a peak]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pre-triggered R(s,i) replays the whole checkpointed forward of (s,i) at once, and its B / I
// runs on the replayed tensors. When every F(s,i) of stage s is followed on its rank by R(s,i)
// as the next compute action (the last stage of 1F1B and ZB-H1: F(i) R(i) B(i), one micro-batch
// at a time), nothing else computes on the rank while the stage holds its forward's tensors:
// without a checkpoint the rank holds them from F to B; with one it holds the saved tensors from
// F, then the saved and the replayed ones from R to B, which is as much or more (a profiled
// candidate's resident plus replayed bytes against none's resident bytes, pipemat/pp/profile.h),
// and B allocates the same on top. Only a forward whose own temporaries rise above the
// backward's could set a higher peak without the checkpoint; on the 37.7 M-parameter GPT of
// docs/performance.md the last rank of 1F1B peaked at 432.21 MiB without it and 472.21 MiB with
// it. So the checkpoint costs the replay and lowers no peak. (Under
// `lazy` recompute a stage replays one unit at a time inside its backward, which does lower its
// peak; such a schedule has no R actions.) A run whose every stage is such (one rank) keeps its
// policy: there `lazy` recompute is what lowers the peak.

// The stages (ascending) of `schedule` with R actions for which this holds.
std::vector<int> stages_whose_replay_follows_forward(const Schedule& schedule);

// Adds SEND_*/RECV_* actions for every cross-rank edge of a compute-only schedule: the SEND
// right after its producer; the RECV at the earlier of "one compute action ahead of its
// consumer" and "when the sender sends in a unit-cost run", never between a pre-triggered R and
// its B / I, a gradient receive after the micro-batch's own F.
// Local hand-offs get no actions. Returns the schedule unchanged if it already has comms.
// ScheduleError (cross-rank deadlock) when the compute order cannot run.
Schedule lower_communication(const Schedule& schedule);

// Drops SEND_* / RECV_* actions: the compute-only form.
Schedule strip_communication(const Schedule& schedule);

// generate -> validate -> insert R -> lower -> validate. The result is what a rank executes.
Schedule build_schedule(const ScheduleOptions& options);

}  // namespace pipemat::schedule
