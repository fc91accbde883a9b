#include "pipemat/schedule/action.h"

#include <cctype>

#include "pipemat/core/error.h"

namespace pipemat::schedule {
namespace {

constexpr ActionType kAllTypes[] = {
    ActionType::kForward,        ActionType::kBackward,     ActionType::kBackwardInput,
    ActionType::kBackwardWeight, ActionType::kRecompute,    ActionType::kSendForward,
    ActionType::kRecvForward,    ActionType::kSendBackward, ActionType::kRecvBackward,
};

// Reads a non-negative decimal integer at text[pos...]; returns -1 when there is none or it
// overflows int.
int read_int(const std::string& text, size_t& pos) {
  size_t start = pos;
  long long value = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
    value = value * 10 + (text[pos] - '0');
    if (value > 1000000000LL) return -1;
    ++pos;
  }
  return pos == start ? -1 : static_cast<int>(value);
}

[[noreturn]] void throw_bad_action(const std::string& text, const std::string& why) {
  PIPEMAT_THROW(ScheduleError, "cannot parse action '", text, "': ", why,
                ". Expected <stage><type><micro_batch> such as 2F0, 1I3 or 0RECV_B2, with type one "
                "of F, B, I, W, R, SEND_F, RECV_F, SEND_B, RECV_B");
}

}  // namespace

const char* action_type_code(ActionType type) {
  switch (type) {
    case ActionType::kForward:
      return "F";
    case ActionType::kBackward:
      return "B";
    case ActionType::kBackwardInput:
      return "I";
    case ActionType::kBackwardWeight:
      return "W";
    case ActionType::kRecompute:
      return "R";
    case ActionType::kSendForward:
      return "SEND_F";
    case ActionType::kRecvForward:
      return "RECV_F";
    case ActionType::kSendBackward:
      return "SEND_B";
    case ActionType::kRecvBackward:
      return "RECV_B";
  }
  PIPEMAT_INTERNAL_ASSERT(false, "unknown ActionType ", static_cast<int>(type));
  return "";
}

bool is_compute(ActionType type) {
  switch (type) {
    case ActionType::kForward:
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
    case ActionType::kBackwardWeight:
    case ActionType::kRecompute:
      return true;
    default:
      return false;
  }
}

std::string format_action(const Action& action) {
  return std::to_string(action.stage) + action_type_code(action.type) +
         std::to_string(action.micro_batch);
}

std::vector<std::string> format_actions(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  out.reserve(actions.size());
  for (const Action& a : actions) out.push_back(format_action(a));
  return out;
}

Action parse_action(const std::string& raw) {
  size_t begin = raw.find_first_not_of(" \t\r\n");
  size_t end = raw.find_last_not_of(" \t\r\n");
  if (begin == std::string::npos) throw_bad_action(raw, "it is empty");
  const std::string text = raw.substr(begin, end - begin + 1);
  size_t pos = 0;
  Action action;
  action.stage = read_int(text, pos);
  if (action.stage < 0) throw_bad_action(text, "it does not start with a stage number");
  size_t type_begin = pos;
  while (pos < text.size() &&
         (std::isupper(static_cast<unsigned char>(text[pos])) || text[pos] == '_')) {
    ++pos;
  }
  const std::string code = text.substr(type_begin, pos - type_begin);
  bool known = false;
  for (ActionType type : kAllTypes) {
    if (code == action_type_code(type)) {
      action.type = type;
      known = true;
    }
  }
  if (!known) throw_bad_action(text, "unknown action type '" + code + "'");
  action.micro_batch = read_int(text, pos);
  if (action.micro_batch < 0) throw_bad_action(text, "it has no micro-batch number after the type");
  if (pos != text.size()) throw_bad_action(text, "unexpected text after the micro-batch number");
  return action;
}

}  // namespace pipemat::schedule
