// Recompute placement: lazy folds R into B/I, pretrigger places R ahead of the gradient wait.

#include <gtest/gtest.h>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

using testing::options;

double makespan(ScheduleKind kind, int p, int m, int v, RecomputeMode mode, const CostModel& c) {
  return simulate(build_schedule(options(kind, p, m, v, mode)), c).makespan;
}

TEST(ScheduleRecomputeTest, PretriggerNeverLengthensTheMakespanVersusLazy) {
  const ScheduleKind kinds[] = {ScheduleKind::kGPipe,        ScheduleKind::kOneFOneB,
                                ScheduleKind::kInterleaved,  ScheduleKind::kZeroBubbleH1,
                                ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV};
  for (ScheduleKind kind : kinds) {
    for (int p : {2, 3, 4, 8}) {
      for (int m : {4, 8, 16}) {
        const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
        if (kind == ScheduleKind::kInterleaved && m % std::max(1, m / p) != 0) continue;
        for (double comm : {0.25, 1.0, 3.0}) {
          for (double r : {0.5, 1.0, 2.0}) {
            CostModel c;
            c.comm = comm;
            c.recompute = r;
            const double lazy = makespan(kind, p, m, v, RecomputeMode::kLazy, c);
            const double pre = makespan(kind, p, m, v, RecomputeMode::kPretrigger, c);
            EXPECT_LE(pre, lazy + 1e-9)
                << to_string(kind) << " P=" << p << " M=" << m << " comm=" << comm << " R=" << r;
          }
        }
      }
    }
  }
}

TEST(ScheduleRecomputeTest, PretriggerShortensTheMakespanWhenRFitsInTheWait) {
  // P=2, M=1, 1F1B, comm c, R r, F 1, B 2. Lazy: rank 0 waits for the gradient (arrives at
  // 4 + 2c + r) and then replays and runs B: 6 + 2c + 2r. Pretrigger: rank 0 replays during the
  // wait (R ends at 1 + r), B starts on arrival: 6 + 2c + r.
  CostModel c;
  c.comm = 1.0;
  c.recompute = 1.0;
  EXPECT_DOUBLE_EQ(makespan(ScheduleKind::kOneFOneB, 2, 1, 1, RecomputeMode::kLazy, c), 10.0);
  EXPECT_DOUBLE_EQ(makespan(ScheduleKind::kOneFOneB, 2, 1, 1, RecomputeMode::kPretrigger, c), 9.0);
  // Larger pipelines: strictly shorter for every schedule with a gradient wait.
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1,
                            ScheduleKind::kGPipe, ScheduleKind::kZeroBubbleV}) {
    const double lazy = makespan(kind, 4, 8, 1, RecomputeMode::kLazy, c);
    const double pre = makespan(kind, 4, 8, 1, RecomputeMode::kPretrigger, c);
    EXPECT_LT(pre, lazy - 0.5) << to_string(kind);
  }
}

TEST(ScheduleRecomputeTest, PerStageCostsChargeEachStageItsOwn) {
  // P=2, M=1, 1F1B with comms, comm 1. Stage 0: F 1, B 2, no recompute; stage 1: F 2, B 4,
  // R 1 and messages of cost 0.5. F0 [0,1] -> F1 starts at 1 + 1 (stage 0 sends), ends 4;
  // R1 [4,5], B1 [5,9]; the gradient arrives at 9 + 0.5 (stage 1 sends); B0 [9.5,11.5].
  const Schedule s =
      build_schedule(options(ScheduleKind::kOneFOneB, 2, 1, 1, RecomputeMode::kPretrigger));
  CostModel first, second;
  first.forward = 1;
  first.backward = 2;
  first.recompute = 0;
  first.comm = 1;
  second.forward = 2;
  second.backward = 4;
  second.recompute = 1;
  second.comm = 0.5;
  EXPECT_DOUBLE_EQ(simulate(s, std::vector<CostModel>{first, second}).makespan, 11.5);
  // Equal per-stage costs are the uniform model.
  EXPECT_DOUBLE_EQ(simulate(s, std::vector<CostModel>{first, first}).makespan,
                   simulate(s, first).makespan);
  try {
    simulate(s, std::vector<CostModel>{first});
    FAIL() << "expected ScheduleError";
  } catch (const ScheduleError& e) {
    EXPECT_STREQ(e.what(),
                 "simulate: 1 stage costs for a schedule of 2 stages; give one CostModel per "
                 "stage.");
  }
}

TEST(ScheduleRecomputeTest, LazyAddsRToEveryBackward) {
  CostModel c;  // R defaults to F when recompute is on
  const Schedule lazy =
      build_schedule(options(ScheduleKind::kOneFOneB, 1, 3, 1, RecomputeMode::kLazy));
  EXPECT_EQ(lazy.recompute, RecomputeMode::kLazy);
  for (const Action& a : lazy.actions[0]) EXPECT_NE(a.type, ActionType::kRecompute);
  // One rank: 3 x (F + B + R) = 3 x 4.
  EXPECT_DOUBLE_EQ(simulate(lazy, c).makespan, 12.0);
  const Schedule none = build_schedule(options(ScheduleKind::kOneFOneB, 1, 3));
  EXPECT_DOUBLE_EQ(simulate(none, c).makespan, 9.0);
}

TEST(ScheduleRecomputeTest, PretriggerPlacesRAfterTheReceiveAndRightBeforeItsBackward) {
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1,
                            ScheduleKind::kInterleaved, ScheduleKind::kZeroBubbleV}) {
    const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
    const Schedule s = build_schedule(options(kind, 4, 8, v, RecomputeMode::kPretrigger));
    int recomputes = 0;
    for (int r = 0; r < s.ranks_count; ++r) {
      const auto& list = s.actions[r];
      for (size_t k = 0; k < list.size(); ++k) {
        if (list[k].type != ActionType::kRecompute) continue;
        ++recomputes;
        const Action& rc = list[k];
        ASSERT_LT(k + 1, list.size());
        const Action& next = list[k + 1];
        EXPECT_TRUE(next.type == ActionType::kBackward || next.type == ActionType::kBackwardInput);
        EXPECT_EQ(next.stage, rc.stage);
        EXPECT_EQ(next.micro_batch, rc.micro_batch);
        if (rc.stage + 1 < s.stages_count && !s.is_local_handoff(rc.stage, rc.stage + 1)) {
          const Action recv{rc.stage, ActionType::kRecvBackward, rc.micro_batch};
          const auto end = list.begin() + static_cast<std::ptrdiff_t>(k);
          EXPECT_NE(std::find(list.begin(), end, recv), end)
              << format_action(recv) << " not before " << format_action(rc);
        }
      }
    }
    EXPECT_EQ(recomputes, s.stages_count * s.micro_batches) << to_string(kind);
  }
}

TEST(ScheduleRecomputeTest, RecomputeCostDefaults) {
  CostModel c;
  EXPECT_DOUBLE_EQ(c.recompute_cost(RecomputeMode::kNone), 0.0);
  EXPECT_DOUBLE_EQ(c.recompute_cost(RecomputeMode::kPretrigger), 1.0);
  c.forward = 3.0;
  EXPECT_DOUBLE_EQ(c.recompute_cost(RecomputeMode::kLazy), 3.0);
  c.recompute = 0.5;
  EXPECT_DOUBLE_EQ(c.recompute_cost(RecomputeMode::kLazy), 0.5);
  EXPECT_DOUBLE_EQ(c.backward_cost(), 2.0);
}

TEST(ScheduleRecomputeTest, ExistingRActionsNeedPretrigger) {
  Schedule s =
      build_schedule(options(ScheduleKind::kOneFOneB, 2, 2, 1, RecomputeMode::kPretrigger));
  EXPECT_THROW(insert_recompute(s, RecomputeMode::kLazy), ScheduleError);
  const Schedule again = insert_recompute(s, RecomputeMode::kPretrigger);
  EXPECT_EQ(again.actions, s.actions);  // no second R
}

TEST(ScheduleRecomputeTest, ParseCosts) {
  const CostModel c = parse_costs("F=2, i=1.5,W=0.5,comm=0.25,R=1");
  EXPECT_DOUBLE_EQ(c.forward, 2.0);
  EXPECT_DOUBLE_EQ(c.backward_input, 1.5);
  EXPECT_DOUBLE_EQ(c.backward_cost(), 2.0);
  EXPECT_DOUBLE_EQ(c.comm, 0.25);
  EXPECT_DOUBLE_EQ(*c.recompute, 1.0);
  EXPECT_DOUBLE_EQ(parse_costs("B=5").backward_cost(), 5.0);
  EXPECT_EQ(format_costs(parse_costs(""), RecomputeMode::kLazy), "F=1,B=2,I=1,W=1,R=1,comm=0");
  const CostModel link = parse_costs("comm=0.1,BW=1000,bytes=400");
  EXPECT_DOUBLE_EQ(link.bandwidth, 1000.0);
  EXPECT_DOUBLE_EQ(link.message_bytes, 400.0);
  EXPECT_DOUBLE_EQ(link.message_cost(), 0.5);
  EXPECT_DOUBLE_EQ(parse_costs("comm=0.1,bytes=400").message_cost(), 0.1);  // no bandwidth set
  EXPECT_EQ(format_costs(link, RecomputeMode::kNone),
            "F=1,B=2,I=1,W=1,R=0,comm=0.1,bw=1000,bytes=400");
  for (const char* bad : {"X=1", "F=-1", "F=abc", "F", "F=1,,B=2", "F=inf", "bw=-5"}) {
    EXPECT_THROW(parse_costs(bad), ConfigError) << bad;
  }
}

// Note [Replays that cannot lower a peak]: the last stage of 1F1B and ZB-H1 (F(i), R(i), B / I(i)
// one micro-batch at a time); no stage of GPipe (its last stage runs every F first) or of a
// schedule without R actions.
TEST(ScheduleRecomputeTest, StagesWhoseReplayFollowsTheirForward) {
  for (int p : {2, 3, 4}) {
    for (int m : {4, 8}) {
      const auto stages = [&](ScheduleKind kind, RecomputeMode mode, int v = 1) {
        return stages_whose_replay_follows_forward(build_schedule(options(kind, p, m, v, mode)));
      };
      const std::vector<int> last = {p - 1};
      EXPECT_EQ(stages(ScheduleKind::kOneFOneB, RecomputeMode::kPretrigger), last);
      EXPECT_EQ(stages(ScheduleKind::kZeroBubbleH1, RecomputeMode::kPretrigger), last);
      EXPECT_EQ(stages(ScheduleKind::kGPipe, RecomputeMode::kPretrigger), std::vector<int>{});
      EXPECT_EQ(stages(ScheduleKind::kOneFOneB, RecomputeMode::kLazy), std::vector<int>{});
      EXPECT_EQ(stages(ScheduleKind::kOneFOneB, RecomputeMode::kNone), std::vector<int>{});
      // Every stage listed holds the property on the compute-only lists, checked here one
      // action at a time; every stage left out breaks it somewhere.
      for (ScheduleKind kind :
           {ScheduleKind::kInterleaved, ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
        const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
        if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
        const Schedule s =
            strip_communication(build_schedule(options(kind, p, m, v, RecomputeMode::kPretrigger)));
        std::vector<bool> holds(static_cast<size_t>(s.stages_count), true);
        for (const auto& list : s.actions) {
          for (size_t k = 0; k < list.size(); ++k) {
            if (list[k].type != ActionType::kForward) continue;
            const bool next_is_its_replay = k + 1 < list.size() &&
                                            list[k + 1].type == ActionType::kRecompute &&
                                            list[k + 1].stage == list[k].stage &&
                                            list[k + 1].micro_batch == list[k].micro_batch;
            if (!next_is_its_replay) holds[static_cast<size_t>(list[k].stage)] = false;
          }
        }
        std::vector<int> want;
        for (int stage = 0; stage < s.stages_count; ++stage) {
          if (holds[static_cast<size_t>(stage)]) want.push_back(stage);
        }
        EXPECT_EQ(stages_whose_replay_follows_forward(s), want)
            << to_string(kind) << " P=" << p << " M=" << m;
      }
    }
  }
}

}  // namespace
}  // namespace pipemat::schedule
