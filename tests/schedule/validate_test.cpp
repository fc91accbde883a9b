// validate_schedule: bad schedules are rejected naming rank, action and rule.

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

using testing::from_lists;

std::string rejection(const Schedule& s) {
  try {
    validate_schedule(s);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "accepted";
}

void expect_mentions(const std::string& msg, std::initializer_list<const char*> parts) {
  for (const char* part : parts) {
    EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing in: " << msg;
  }
}

TEST(ScheduleValidateTest, AcceptsAHandWrittenSchedule) {
  EXPECT_EQ(
      rejection(from_lists(2, 2, {{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1B0", "1F1", "1B1"}})),
      "accepted");
}

TEST(ScheduleValidateTest, MissingForward) {
  const std::string msg =
      rejection(from_lists(2, 2, {{"0F0", "0B0", "0B1"}, {"1F0", "1B0", "1F1", "1B1"}}));
  expect_mentions(msg, {"rank 0", "action 0B1", "rule 'missing F'", "micro-batch 1"});
}

TEST(ScheduleValidateTest, MissingForwardWithoutAnyBackwardIsNamedToo) {
  const std::string msg =
      rejection(from_lists(2, 2, {{"0F0", "0B0"}, {"1F0", "1B0", "1F1", "1B1"}}));
  expect_mentions(msg, {"rank 0", "0F1", "rule 'missing F'"});
}

TEST(ScheduleValidateTest, BackwardBeforeForward) {
  const std::string msg =
      rejection(from_lists(2, 2, {{"0F0", "0B0", "0B1", "0F1"}, {"1F0", "1B0", "1F1", "1B1"}}));
  expect_mentions(msg, {"rank 0", "action 0B1", "rule 'F before B/I'", "0F1"});
}

TEST(ScheduleValidateTest, WeightBeforeInput) {
  const std::string msg = rejection(from_lists(1, 2, {{"0F0", "0I0", "0W0", "0F1", "0W1", "0I1"}}));
  expect_mentions(msg, {"rank 0", "action 0W1", "rule 'I before W'", "position 4"});
}

TEST(ScheduleValidateTest, DuplicateMicroBatch) {
  const std::string msg = rejection(
      from_lists(2, 2, {{"0F0", "0F1", "0B0", "0B1"}, {"1F0", "1B0", "1F0", "1F1", "1B1"}}));
  expect_mentions(msg, {"rank 1", "action 1F0", "rule 'duplicate micro-batch'", "position 2",
                        "first at position 0"});
}

TEST(ScheduleValidateTest, BothFullBackwardAndSplitBackward) {
  const std::string msg = rejection(from_lists(1, 1, {{"0F0", "0I0", "0B0"}}));
  expect_mentions(msg, {"rank 0", "action 0B0", "rule 'B or I+W'"});
  const std::string missing_w = rejection(from_lists(1, 1, {{"0F0", "0I0"}}));
  expect_mentions(missing_w, {"rank 0", "0W0", "rule 'B or I+W'", "never W"});
}

TEST(ScheduleValidateTest, StageOnTheWrongRank) {
  const std::string msg = rejection(from_lists(2, 1, {{"0F0", "1F0", "0B0"}, {"1B0"}}));
  expect_mentions(
      msg, {"rank 0", "action 1F0", "rule 'stage-to-rank consistency'", "belongs to rank 1"});
}

TEST(ScheduleValidateTest, ActionOutOfRange) {
  const std::string msg = rejection(from_lists(1, 1, {{"0F0", "0B0", "0F5"}}));
  expect_mentions(msg, {"rank 0", "action 0F5", "rule 'action in range'"});
}

TEST(ScheduleValidateTest, CrossRankDeadlockNamesTheBlockedActionOfEachRank) {
  // Rank 0 waits in 0B0 for 1B0, which rank 1 runs only after 1F1, which needs 0F1, which
  // rank 0 runs after 0B0: a cycle across the two ranks.
  const Schedule s = from_lists(2, 2, {{"0F0", "0B0", "0F1", "0B1"}, {"1F1", "1B1", "1F0", "1B0"}});
  const std::string msg = rejection(s);
  expect_mentions(msg,
                  {"rule 'cross-rank deadlock'", "rank 0 is blocked at action 0B0 (position 1)",
                   "rank 1 is blocked at action 1F1 (position 0)"});
  // Lowering needs a runnable compute order, so it reports the same deadlock.
  try {
    lower_communication(s);
    FAIL() << "lowered a deadlocking schedule";
  } catch (const ScheduleError& e) {
    expect_mentions(e.what(), {"rule 'cross-rank deadlock'"});
  }
  // With comms, the deadlock is reported in terms of the messages.
  const Schedule lowered =
      from_lists(2, 2,
                 {{"0F0", "0SEND_F0", "0RECV_B0", "0B0", "0F1", "0SEND_F1", "0RECV_B1", "0B1"},
                  {"1RECV_F1", "1F1", "1RECV_F0", "1B1", "1SEND_B1", "1F0", "1B0", "1SEND_B0"}});
  expect_mentions(rejection(lowered),
                  {"rule 'cross-rank deadlock'", "rank 0 is blocked at action 0B0",
                   "rank 1 is blocked at action 1F1", "waiting for 0SEND_F1 on rank 0"});
}

TEST(ScheduleValidateTest, CommRulesOnLoweredSchedules) {
  Schedule good = lower_communication(from_lists(2, 1, {{"0F0", "0B0"}, {"1F0", "1B0"}}));
  EXPECT_EQ(rejection(good), "accepted");

  Schedule missing_recv = good;
  auto& r1 = missing_recv.actions[1];
  r1.erase(r1.begin());  // drop 1RECV_F0
  expect_mentions(rejection(missing_recv),
                  {"rank 1", "action 1F0", "rule 'RECV before consumer'", "1RECV_F0"});

  Schedule send_first = good;
  auto& r0 = send_first.actions[0];
  const auto send = std::find(r0.begin(), r0.end(), parse_action("0SEND_F0"));
  ASSERT_NE(send, r0.end());
  std::rotate(r0.begin(), send, send + 1);  // 0SEND_F0 before 0F0
  expect_mentions(rejection(send_first),
                  {"rank 0", "action 0SEND_F0", "rule 'SEND after producer'"});

  Schedule local = from_lists(1, 1, {{"0F0", "0SEND_F0", "0B0"}});
  expect_mentions(rejection(local),
                  {"rank 0", "action 0SEND_F0", "rule 'no comm for local hand-off'"});
}

TEST(ScheduleValidateTest, RecomputeMustSitBetweenForwardAndBackward) {
  expect_mentions(rejection(from_lists(1, 1, {{"0F0", "0B0", "0R0"}})),
                  {"rank 0", "action 0R0", "rule 'R before B/I'"});
  expect_mentions(rejection(from_lists(1, 1, {{"0R0", "0F0", "0B0"}})),
                  {"rank 0", "action 0R0", "rule 'F before R'"});
  EXPECT_EQ(rejection(from_lists(1, 1, {{"0F0", "0R0", "0B0"}})), "accepted");
}

TEST(ScheduleValidateTest, ShapeErrors) {
  Schedule s = from_lists(2, 1, {{"0F0", "0B0"}, {"1F0", "1B0"}});
  s.actions.pop_back();
  EXPECT_THROW(validate_schedule(s), ScheduleError);
  Schedule bad_map = from_lists(2, 1, {{"0F0", "0B0"}, {"1F0", "1B0"}});
  bad_map.stage_to_rank[1] = 7;
  expect_mentions(rejection(bad_map), {"stage_to_rank[1] = 7"});
}

}  // namespace
}  // namespace pipemat::schedule

namespace pipemat::schedule {
namespace {

TEST(ScheduleValidateTest, RandomSchedulesAreAcceptedOrRejectedNeverCrash) {
  // Mutations of real schedules (drop, duplicate, swap, retarget an action) must give a clean
  // ScheduleError or a schedule that runs; never another exception or a crash.
  std::mt19937 rng(12345);
  int accepted = 0, rejected = 0;
  const ScheduleKind kinds[] = {ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
                                ScheduleKind::kZeroBubbleV, ScheduleKind::kZeroBubbleH1};
  for (int trial = 0; trial < 3000; ++trial) {
    const ScheduleKind kind = kinds[trial % 4];
    const int p = 1 + static_cast<int>(rng() % 3), m = 1 + static_cast<int>(rng() % 4);
    const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
    Schedule s = trial % 2 ? build_schedule(testing::options(kind, p, m, v))
                           : generate_schedule(testing::options(kind, p, m, v));
    auto& list = s.actions[rng() % p];
    if (list.empty()) continue;
    const size_t at = rng() % list.size();
    switch (rng() % 4) {
      case 0:
        list.erase(list.begin() + static_cast<std::ptrdiff_t>(at));
        break;
      case 1:
        list.push_back(list[at]);
        break;
      case 2:
        std::swap(list[at], list[rng() % list.size()]);
        break;
      default:
        list[at].stage = static_cast<int>(rng() % (s.stages_count + 1));
        list[at].micro_batch = static_cast<int>(rng() % (m + 1));
        list[at].type = static_cast<ActionType>(rng() % 9);
    }
    try {
      validate_schedule(s);
      simulate(s);
      ++accepted;
    } catch (const ScheduleError& e) {
      EXPECT_NE(std::string(e.what()).find("rule '"), std::string::npos) << e.what();
      ++rejected;
    }
  }
  // Every trial ends one way (no rank list of these schedules is empty); the mutations are
  // seeded, so the split is the generator's.
  EXPECT_EQ(accepted + rejected, 3000);
  EXPECT_EQ(accepted, 208);  // e.g. swaps of independent actions
  EXPECT_EQ(rejected, 2792);
}

}  // namespace
}  // namespace pipemat::schedule
