// Note [Shared cores]: ranks that compute at once share SimulateOptions::parallel_ranks cores.

#include <gtest/gtest.h>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

using testing::options;

// 1F1B on 2 ranks, 2 micro-batches, F = 1, B = 2 (I = W = 1). With a core each:
//   rank 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9];  rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7].
const Schedule& one_f_one_b() {
  static const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, 2, 2));
  return s;
}

const TimedAction& timed(const SimulationResult& r, int rank, const std::string& action) {
  for (const TimedAction& t : r.ranks[rank].actions)
    if (format_action(t.action) == action) return t;
  throw std::runtime_error("no action " + action);
}

TEST(SharedCores, EnoughCoresChangeNothing) {
  const CostModel c;
  const SimulationResult own = simulate(one_f_one_b(), c);
  EXPECT_DOUBLE_EQ(own.makespan, 9.0);
  SimulateOptions two;
  two.parallel_ranks = 2;
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(), c, two).makespan, 9.0);
}

TEST(SharedCores, RanksThatComputeAtOnceShareOneCore) {
  // One core: F1 on rank 0 and F0 on rank 1 run together at half speed in [1,3]; rank 1's B0
  // runs alone in [3,5]; then rank 0's B0 shares with rank 1's F1 and B1 until 9, rank 1's B1
  // ends alone at 10 and rank 0's B1 runs alone in [10,12]. The core never idles: 12 = the
  // ranks' total work.
  SimulateOptions one;
  one.parallel_ranks = 1;
  const SimulationResult r = simulate(one_f_one_b(), CostModel{}, one);
  EXPECT_DOUBLE_EQ(r.makespan, 12.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0F1").start, 1.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0F1").end, 3.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1F0").end, 3.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B0").start, 3.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B0").end, 5.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B0").start, 5.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B0").end, 9.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B1").end, 10.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B1").start, 10.0);
  // busy is wall time inside compute actions: 2 + 4 on rank 0's F1 and B0 alone.
  EXPECT_DOUBLE_EQ(r.ranks[0].busy, 1 + 2 + 4 + 2);
}

TEST(SharedCores, TheSharedSpeedSlowsRanksThatShareACore) {
  // As above with half speed while ranks compute together: two computing ranks on one core run
  // at 1/4 speed each, a rank alone at full speed. F1 / F0 run [1,5], B0 of rank 1 [5,7], rank 0's
  // B0 shares with F1 and B1 of rank 1 until 15, rank 1's B1 ends alone at 16, rank 0's B1 runs
  // [16,18].
  SimulateOptions half;
  half.parallel_ranks = 1;
  half.shared_speed = 0.5;
  const SimulationResult r = simulate(one_f_one_b(), CostModel{}, half);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0F1").end, 5.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B0").end, 7.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B0").end, 15.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B1").end, 16.0);
  EXPECT_DOUBLE_EQ(r.makespan, 18.0);
  half.shared_speed = 0;
  EXPECT_THROW(simulate(one_f_one_b(), CostModel{}, half), ScheduleError);
}

TEST(SharedCores, RanksThatComputeAtOnceSlowEachOtherOnTheirOwnCores) {
  // A core each, but half speed while both compute (shared caches, memory bandwidth): F1 / F0
  // run [1,3] together, B0 of rank 1 alone [3,5], rank 0's B0 with rank 1's F1 and B1 until 9,
  // rank 1's B1 alone to 10, rank 0's B1 alone [10,12].
  SimulateOptions half;
  half.shared_speed = 0.5;
  const SimulationResult r = simulate(one_f_one_b(), CostModel{}, half);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0F1").end, 3.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B0").end, 5.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B0").end, 9.0);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1B1").end, 10.0);
  EXPECT_DOUBLE_EQ(r.makespan, 12.0);
}

TEST(SharedCores, MessagesInFlightWakeTheirReceiver) {
  // As above with a message cost of 0.5. Rank 0 computes alone until rank 1's input arrives at
  // 1.5; rank 1's B0 input to rank 0 arrives at 5.5 and B1's at 10.5, so the core idles at the
  // end: rank 0's B1 runs [10.5, 12.5].
  SimulateOptions one;
  one.parallel_ranks = 1;
  CostModel c;
  c.comm = 0.5;
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(), c).makespan, 10.0);  // a core each
  const SimulationResult r = simulate(one_f_one_b(), c, one);
  EXPECT_DOUBLE_EQ(r.makespan, 12.5);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0F1").end, 2.5);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1F0").start, 1.5);
  EXPECT_DOUBLE_EQ(timed(r, 1, "1F0").end, 3.0);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B0").start, 5.5);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B0").end, 9.5);
  EXPECT_DOUBLE_EQ(timed(r, 0, "0B1").start, 10.5);
}

TEST(SharedCores, NoActionStartsEarlierThanWithACoreEach) {
  // The planner's bound (Note [Plan search]): sharing delays, never advances, every action.
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB,
                            ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV}) {
    const Schedule s = build_schedule(options(
        kind, 4, 8, kind == ScheduleKind::kZeroBubbleV ? 2 : 1, RecomputeMode::kPretrigger));
    CostModel c;
    c.forward = 1.0;
    c.backward_input = 1.3;
    c.backward_weight = 0.7;
    c.recompute = 0.4;
    c.comm = 0.1;
    SimulateOptions two;
    two.parallel_ranks = 2;
    const SimulationResult own = simulate(s, c), shared = simulate(s, c, two);
    double busy = 0;
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(own.ranks[r].actions.size(), shared.ranks[r].actions.size());
      for (size_t k = 0; k < own.ranks[r].actions.size(); ++k) {
        EXPECT_GE(shared.ranks[r].actions[k].start, own.ranks[r].actions[k].start - 1e-9)
            << to_string(kind) << " rank " << r << " "
            << format_action(own.ranks[r].actions[k].action);
      }
      busy += own.ranks[r].busy;
    }
    EXPECT_GE(shared.makespan, busy / 2 - 1e-9) << to_string(kind);
  }
}

}  // namespace
}  // namespace pipemat::schedule
