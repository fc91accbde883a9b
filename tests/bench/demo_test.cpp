// `pipemat demo` as a library: the checkpointed run's losses equal the no-checkpoint run's
// bitwise, step by step, and the report carries each step's remat counters.

#include <gtest/gtest.h>

#include "pipemat/bench/demo.h"
#include "pipemat/core/error.h"

namespace pipemat::bench {
namespace {

TEST(Demo, ReportMatchesTheNoCheckpointRunBitwise) {
  DemoOptions o;
  o.layers = 3;
  o.tokens = 16;
  o.hidden = 32;
  o.steps = 2;
  const DemoReport report = run_demo(o);
  EXPECT_TRUE(report.all_equal);
  ASSERT_EQ(report.steps.size(), 2u);
  for (const DemoStep& s : report.steps) {
    EXPECT_EQ(s.loss, s.reference_loss);
    EXPECT_GT(s.ms, 0);
    // One checkpoint unit per layer, each replayed once in backward; its SAVE region (the GEMM)
    // runs in forward and is skipped in the replay.
    EXPECT_EQ(s.counters.unit_calls, o.layers);
    EXPECT_EQ(s.counters.replays, o.layers);
    EXPECT_EQ(s.counters.save_calls, o.layers);
    EXPECT_EQ(s.counters.save_skips, o.layers);
  }
}

TEST(Demo, NonPositiveSizesAreConfigErrors) {
  DemoOptions o;
  o.steps = 0;
  EXPECT_THROW(run_demo(o), ConfigError);
}

}  // namespace
}  // namespace pipemat::bench
