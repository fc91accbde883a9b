// lower_communication: matched SEND/RECV pairs, local hand-offs, message ids, timing.

#include <gtest/gtest.h>

#include <set>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

using testing::options;

struct Case {
  ScheduleKind kind;
  int p, m, v;
};

const Case kCases[] = {
    {ScheduleKind::kGPipe, 4, 8, 1},        {ScheduleKind::kOneFOneB, 4, 8, 1},
    {ScheduleKind::kOneFOneB, 3, 2, 1},     {ScheduleKind::kInterleaved, 4, 8, 2},
    {ScheduleKind::kInterleaved, 2, 6, 3},  {ScheduleKind::kInterleaved, 1, 4, 3},
    {ScheduleKind::kZeroBubbleH1, 4, 8, 1}, {ScheduleKind::kZeroBubbleH2, 4, 8, 1},
    {ScheduleKind::kZeroBubbleV, 4, 8, 1},  {ScheduleKind::kZeroBubbleV, 1, 3, 1},
};

TEST(LoweringTest, EverySendHasOneMatchingReceiveOnThePeer) {
  for (const Case& c : kCases) {
    for (RecomputeMode mode : {RecomputeMode::kNone, RecomputeMode::kPretrigger}) {
      const Schedule s = build_schedule(options(c.kind, c.p, c.m, c.v, mode));
      std::multiset<std::tuple<int, int, int>> sends, recvs;  // (id, from rank, to rank)
      std::set<int> ids;
      for (int r = 0; r < s.ranks_count; ++r) {
        for (const Action& a : s.actions[r]) {
          if (is_compute(a.type)) continue;
          const int peer = peer_rank(s, a);
          EXPECT_NE(peer, r) << format_action(a);
          EXPECT_EQ(s.rank_of(matching_action(a).stage), peer);
          const bool send =
              a.type == ActionType::kSendForward || a.type == ActionType::kSendBackward;
          const int id = message_id(s, a);
          EXPECT_EQ(id, message_id(s, matching_action(a)));
          EXPECT_GE(id, 0);
          EXPECT_LT(id, 2 * s.stages_count * s.micro_batches);
          if (send) {
            EXPECT_TRUE(ids.insert(id).second) << "message id reused by " << format_action(a);
            sends.insert({id, r, peer});
          } else {
            recvs.insert({id, peer, r});
          }
        }
      }
      EXPECT_EQ(sends, recvs) << to_string(c.kind);
    }
  }
}

TEST(LoweringTest, CrossRankEdgesAreExactlyTheCommunicatedOnes) {
  for (const Case& c : kCases) {
    const Schedule s = build_schedule(options(c.kind, c.p, c.m, c.v));
    int expected = 0;
    for (int st = 0; st + 1 < s.stages_count; ++st) {
      if (!s.is_local_handoff(st, st + 1)) expected += 4 * s.micro_batches;  // SEND+RECV both ways
    }
    int found = 0;
    for (const auto& list : s.actions) {
      for (const Action& a : list) found += is_comm(a.type) ? 1 : 0;
    }
    EXPECT_EQ(found, expected) << to_string(c.kind) << " P=" << c.p;
  }
}

TEST(LoweringTest, ZeroBubbleVHandsOffLocallyAtTheTipOfTheV) {
  const int p = 4;
  const Schedule s = build_schedule(options(ScheduleKind::kZeroBubbleV, p, 8));
  EXPECT_TRUE(s.is_local_handoff(p - 1, p));
  EXPECT_FALSE(s.is_local_handoff(p - 2, p - 1));
  for (const Action& a : s.actions[p - 1]) {
    EXPECT_FALSE(a.type == ActionType::kSendForward && a.stage == p - 1) << format_action(a);
    EXPECT_FALSE(a.type == ActionType::kRecvForward && a.stage == p) << format_action(a);
    EXPECT_FALSE(a.type == ActionType::kSendBackward && a.stage == p) << format_action(a);
    EXPECT_FALSE(a.type == ActionType::kRecvBackward && a.stage == p - 1) << format_action(a);
  }
  // One rank, all stages local: nothing to communicate.
  const Schedule one = build_schedule(options(ScheduleKind::kInterleaved, 1, 4, 3));
  EXPECT_FALSE(one.has_comms());
}

TEST(LoweringTest, ReceivesArePostedBeforeConsumersAndSendsFollowProducers) {
  for (const Case& c : kCases) {
    const Schedule s = build_schedule(options(c.kind, c.p, c.m, c.v, RecomputeMode::kPretrigger));
    for (int r = 0; r < s.ranks_count; ++r) {
      const auto& list = s.actions[r];
      for (size_t k = 0; k < list.size(); ++k) {
        const Action& a = list[k];
        if (a.type == ActionType::kSendForward || a.type == ActionType::kSendBackward) {
          // Right after the producer, possibly after another SEND of the same producer.
          size_t j = k - 1;
          while (is_comm(list[j].type)) --j;
          EXPECT_EQ(list[j].stage, a.stage);
          EXPECT_EQ(list[j].micro_batch, a.micro_batch);
        }
        if (a.type == ActionType::kRecvForward || a.type == ActionType::kRecvBackward) {
          // At most one compute action (the one the transfer overlaps) before the consumer,
          // not counting pre-triggered R actions, which stay glued to their B / I.
          int computes = 0;
          size_t j = k + 1;
          auto consumes = [&](const Action& x) {
            return x.stage == a.stage && x.micro_batch == a.micro_batch &&
                   (a.type == ActionType::kRecvForward
                        ? x.type == ActionType::kForward
                        : x.type == ActionType::kBackward || x.type == ActionType::kBackwardInput);
          };
          for (; j < list.size() && !consumes(list[j]); ++j) {
            computes += is_compute(list[j].type) && list[j].type != ActionType::kRecompute;
          }
          ASSERT_LT(j, list.size()) << format_action(a) << " has no consumer";
          EXPECT_LE(computes, 1) << format_action(a);
        }
      }
    }
  }
}

TEST(LoweringTest, LoweredAndComputeOnlySimulationsAgreeWithoutLatency) {
  for (const Case& c : kCases) {
    const Schedule compute = generate_schedule(options(c.kind, c.p, c.m, c.v));
    const Schedule lowered = lower_communication(compute);
    const auto a = simulate(compute);
    const auto b = simulate(lowered);
    EXPECT_DOUBLE_EQ(a.makespan, b.makespan) << to_string(c.kind);
    EXPECT_DOUBLE_EQ(a.bubble_ratio, b.bubble_ratio);
    EXPECT_EQ(strip_communication(lowered).actions, compute.actions);
  }
}

TEST(LoweringTest, CommLatencyDelaysEachCrossRankHop) {
  // 1F1B P=2 M=1: F0 [0,1] -> +c -> F0 [1+c, 2+c], B0 [2+c, 4+c] -> +c -> B0 [4+2c, 6+2c].
  CostModel c;
  c.comm = 0.5;
  const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, 2, 1));
  const auto sim = simulate(s, c);
  EXPECT_DOUBLE_EQ(sim.makespan, 7.0);
  EXPECT_DOUBLE_EQ(simulate(strip_communication(s), c).makespan, 7.0);
  // Busy time excludes the waits: 1 - 6 / (2 * 7).
  EXPECT_NEAR(sim.bubble_ratio, 1.0 - 6.0 / 14.0, 1e-12);
}

TEST(LoweringTest, PeerOfAComputeActionIsAnError) {
  const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, 2, 1));
  EXPECT_THROW(peer_rank(s, Action{0, ActionType::kForward, 0}), ScheduleError);
}

}  // namespace
}  // namespace pipemat::schedule
