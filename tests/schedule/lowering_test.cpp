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

TEST(ScheduleLoweringTest, EverySendHasOneMatchingReceiveOnThePeer) {
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

TEST(ScheduleLoweringTest, CrossRankEdgesAreExactlyTheCommunicatedOnes) {
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

TEST(ScheduleLoweringTest, ZeroBubbleVHandsOffLocallyAtTheTipOfTheV) {
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

TEST(ScheduleLoweringTest, ReceivesArePostedEarlyAndSendsFollowProducers) {
  for (const Case& c : kCases) {
    const Schedule s = build_schedule(options(c.kind, c.p, c.m, c.v, RecomputeMode::kPretrigger));
    for (int r = 0; r < s.ranks_count; ++r) {
      const auto& list = s.actions[r];
      for (size_t k = 0; k < list.size(); ++k) {
        const Action& a = list[k];
        if (a.type == ActionType::kSendForward || a.type == ActionType::kSendBackward) {
          // Right after the producer (receives and other sends of it may sit in between).
          size_t j = k - 1;
          while (is_comm(list[j].type)) --j;
          EXPECT_EQ(list[j].stage, a.stage);
          EXPECT_EQ(list[j].micro_batch, a.micro_batch);
        }
        if (a.type != ActionType::kRecvForward && a.type != ActionType::kRecvBackward) continue;
        auto consumes = [&](const Action& x) {
          return x.stage == a.stage && x.micro_batch == a.micro_batch &&
                 (a.type == ActionType::kRecvForward
                      ? x.type == ActionType::kForward
                      : x.type == ActionType::kBackward || x.type == ActionType::kBackwardInput);
        };
        // Compute actions (other than pre-triggered R) the transfer overlaps before its consumer.
        int between = 0;
        size_t j = k + 1;
        for (; j < list.size() && !consumes(list[j]); ++j) {
          between += is_compute(list[j].type) && list[j].type != ActionType::kRecompute;
        }
        ASSERT_LT(j, list.size()) << format_action(a) << " has no consumer";
        // Posted at least one compute ahead unless nothing earlier can host it: the consumer
        // is the rank's first compute, or a gradient receive right after its own F.
        int computes_before = 0;
        for (size_t x = 0; x < k; ++x) computes_before += is_compute(list[x].type);
        const bool after_own_forward =
            a.type == ActionType::kRecvBackward && k > 0 &&
            list[k - 1] == Action{a.stage, ActionType::kForward, a.micro_batch};
        if (computes_before > 0 && !after_own_forward) {
          EXPECT_GE(between, 1) << format_action(a) << " on rank " << r;
        }
        // A receive never sits between a pre-triggered R and its B / I.
        if (k > 0 && list[k - 1].type == ActionType::kRecompute) {
          EXPECT_FALSE(k + 1 < list.size() && is_compute(list[k + 1].type) &&
                       list[k + 1].stage == list[k - 1].stage &&
                       list[k + 1].micro_batch == list[k - 1].micro_batch)
              << format_action(a);
        }
      }
    }
  }
}

TEST(ScheduleLoweringTest, LoweredSchedulesCannotDeadlockEvenWithRendezvousSends) {
  // Sends that block until the peer posted the receive (large MPI messages) must not hang any
  // lowered schedule of the grid (Note [Receive placement]).
  SimulateOptions rendezvous;
  rendezvous.rendezvous_sends = true;
  int checked = 0;
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
        ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 24; m += (m < 8 ? 1 : 3)) {
        for (int v = 1; v <= (kind == ScheduleKind::kInterleaved ? 4 : 1); ++v) {
          if (kind == ScheduleKind::kInterleaved && m % std::max(1, m / p) != 0) continue;
          for (RecomputeMode mode : {RecomputeMode::kNone, RecomputeMode::kPretrigger}) {
            const Schedule s = build_schedule(options(kind, p, m, v, mode));
            EXPECT_NO_THROW(simulate(s, CostModel{}, rendezvous))
                << to_string(kind) << " P=" << p << " M=" << m << " V=" << v;
            ++checked;
          }
        }
      }
    }
  }
  // 5 kinds x 8 P x 13 M x 2 modes, and interleaved's 79 (P, M) that fill its rounds x 4 V x 2.
  EXPECT_EQ(checked, 5 * 8 * 13 * 2 + 79 * 4 * 2);
}

TEST(ScheduleLoweringTest, RendezvousSimulationDetectsSendSendCycles) {
  // Both ranks send before posting their receive: fine with non-blocking sends, a hang when
  // sends block until the receive is posted.
  Schedule s = testing::from_lists(
      2, 1, {{"0F0", "0SEND_F0", "0RECV_B0", "0B0"}, {"1RECV_F0", "1F0", "1B0", "1SEND_B0"}});
  EXPECT_NO_THROW(simulate(s));
  s.micro_batches = 2;
  s.actions = {testing::parse_list(
                   {"0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0B0", "0B1"}),
               testing::parse_list(
                   {"1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"})};
  EXPECT_NO_THROW(simulate(s));
  SimulateOptions rendezvous;
  rendezvous.rendezvous_sends = true;
  try {
    simulate(s, CostModel{}, rendezvous);
    FAIL() << "expected a rendezvous deadlock";
  } catch (const ScheduleError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0 is blocked at action 0SEND_F1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1 is blocked at action 1SEND_B0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(rendezvous send)"), std::string::npos) << msg;
  }
}

TEST(ScheduleLoweringTest, LoweredAndComputeOnlySimulationsAgreeWithoutLatency) {
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

TEST(ScheduleLoweringTest, CommLatencyDelaysEachCrossRankHop) {
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

TEST(ScheduleLoweringTest, PeerOfAComputeActionIsAnError) {
  const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, 2, 1));
  EXPECT_THROW(peer_rank(s, Action{0, ActionType::kForward, 0}), ScheduleError);
}

}  // namespace
}  // namespace pipemat::schedule
