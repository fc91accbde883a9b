// Wall-clock checks of the schedule generators, in their own binary labelled `perf` so that the
// README test command (which runs `ctest -LE perf`) never depends on the machine's speed. Run
// them with `ctest -L perf` from the build directory.

#include <gtest/gtest.h>

#include <chrono>

#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

TEST(ScheduleGeneratorsPerf, LargeSchedulesBuildInLinearishTime) {
  const auto start = std::chrono::steady_clock::now();
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH2,
                            ScheduleKind::kZeroBubbleV, ScheduleKind::kInterleaved}) {
    const int v = kind == ScheduleKind::kInterleaved ? 4 : 1;
    const Schedule s =
        build_schedule(testing::options(kind, 8, 2048, v, RecomputeMode::kPretrigger));
    // 2048 micro-batches on 8 ranks: the warm-up and cool-down are a sliver of the step
    // (1F1B: 7 / 2055 of it).
    const SimulationResult sim = simulate(s);
    EXPECT_GE(sim.bubble_ratio, 0.0) << to_string(kind);
    EXPECT_LT(sim.bubble_ratio, 0.01) << to_string(kind);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
}

}  // namespace
}  // namespace pipemat::schedule
