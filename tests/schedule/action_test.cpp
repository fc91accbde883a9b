#include "pipemat/schedule/action.h"

#include <gtest/gtest.h>

#include "pipemat/core/error.h"

namespace pipemat::schedule {
namespace {

TEST(ScheduleActionTest, FormatsTorchTextForm) {
  EXPECT_EQ(format_action({2, ActionType::kForward, 0}), "2F0");
  EXPECT_EQ(format_action({1, ActionType::kBackwardInput, 3}), "1I3");
  EXPECT_EQ(format_action({0, ActionType::kRecvBackward, 2}), "0RECV_B2");
  EXPECT_EQ(format_action({12, ActionType::kSendForward, 17}), "12SEND_F17");
  EXPECT_EQ(format_action({3, ActionType::kRecompute, 1}), "3R1");
}

TEST(ScheduleActionTest, ParseFormatRoundTripForEveryType) {
  for (const char* text : {"0F0", "1B2", "2I3", "3W4", "4R5", "5SEND_F6", "6RECV_F7", "7SEND_B8",
                           "8RECV_B9", "123F4567"}) {
    EXPECT_EQ(format_action(parse_action(text)), text);
  }
  const Action a = parse_action("  0RECV_B2 ");
  EXPECT_EQ(a.stage, 0);
  EXPECT_EQ(a.type, ActionType::kRecvBackward);
  EXPECT_EQ(a.micro_batch, 2);
}

TEST(ScheduleActionTest, ComputeVersusComm) {
  EXPECT_TRUE(is_compute(ActionType::kForward));
  EXPECT_TRUE(is_compute(ActionType::kRecompute));
  EXPECT_TRUE(is_comm(ActionType::kSendBackward));
  EXPECT_TRUE(is_comm(ActionType::kRecvForward));
}

TEST(ScheduleActionTest, RejectsMalformedTextWithTheAcceptedForm) {
  for (const char* text : {"", "F0", "0X1", "0F", "0F1x", "-1F0", "0f0", "0SEND1"}) {
    try {
      parse_action(text);
      FAIL() << "accepted '" << text << "'";
    } catch (const ScheduleError& e) {
      EXPECT_NE(std::string(e.what()).find("<stage><type><micro_batch>"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace pipemat::schedule
