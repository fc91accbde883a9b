#pragma once
// Action IR of pipeline schedules.
//
// An Action is one step a rank executes: a compute pass of one stage on one micro-batch (F, B, I,
// W, R) or one half of a point-to-point transfer (SEND_F, RECV_F, SEND_B, RECV_B). The text form
// is torch.distributed.pipelining's: `<stage><type><micro_batch>`, e.g. `2F0`, `1I3`,
// `0RECV_B2`.
//
// Meaning of each type for stage s and micro-batch i (see Note [Executor contract] in
// schedule.h for what a runtime does with them):
//   F       forward of stage s on micro-batch i.
//   B       full backward (input gradient and weight gradient in one pass).
//   I       backward for the input gradient only ("dx"); the weight gradient is deferred to W.
//   W       weight-gradient pass of an earlier I of the same (stage, micro-batch).
//   R       recompute (replay the checkpointed forward) of (s, i) ahead of its B / I.
//   SEND_F  stage s sends its output activation of micro-batch i to stage s + 1.
//   RECV_F  stage s posts the receive of its input activation of micro-batch i from stage s - 1.
//   SEND_B  stage s sends its input gradient of micro-batch i to stage s - 1.
//   RECV_B  stage s posts the receive of its output gradient of micro-batch i from stage s + 1.
//
// Thread safety: plain values; all functions are pure.

#include <cstdint>
#include <string>
#include <vector>

namespace pipemat::schedule {

enum class ActionType : uint8_t {
  kForward,         // F
  kBackward,        // B
  kBackwardInput,   // I
  kBackwardWeight,  // W
  kRecompute,       // R
  kSendForward,     // SEND_F
  kRecvForward,     // RECV_F
  kSendBackward,    // SEND_B
  kRecvBackward,    // RECV_B
};

struct Action {
  int stage = 0;
  ActionType type = ActionType::kForward;
  int micro_batch = 0;

  friend bool operator==(const Action& a, const Action& b) {
    return a.stage == b.stage && a.type == b.type && a.micro_batch == b.micro_batch;
  }
  friend bool operator!=(const Action& a, const Action& b) { return !(a == b); }
};

// "F", "B", "I", "W", "R", "SEND_F", "RECV_F", "SEND_B", "RECV_B".
const char* action_type_code(ActionType type);

// True for F, B, I, W, R (actions that occupy the rank's compute), false for SEND_* / RECV_*.
bool is_compute(ActionType type);
inline bool is_comm(ActionType type) { return !is_compute(type); }

// "2F0", "0RECV_B2".
std::string format_action(const Action& action);
std::vector<std::string> format_actions(const std::vector<Action>& actions);

// Parses the text form (surrounding spaces allowed). Throws ScheduleError naming the text and the
// accepted form when it is not `<stage><type><micro_batch>` with non-negative integers and a known
// type.
Action parse_action(const std::string& text);

}  // namespace pipemat::schedule
