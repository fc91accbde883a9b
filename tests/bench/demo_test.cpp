// `pipemat demo` as a library: the checkpointed run's losses equal the no-checkpoint run's
// bitwise, step by step, and each step, with its remat counters, is handed over as it ends.

#include <gtest/gtest.h>

#include <stdexcept>
#include <type_traits>
#include <vector>

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
  std::vector<int64_t> indices;
  std::vector<DemoStep> steps;
  const DemoReport report = run_demo(o, [&](int64_t step, const DemoStep& s) {
    indices.push_back(step);
    steps.push_back(s);
  });
  EXPECT_TRUE(report.all_equal);
  EXPECT_EQ(report.steps, 2);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(indices, (std::vector<int64_t>{0, 1}));
  for (const DemoStep& s : steps) {
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

// Issue 44 #12: a step is handed over as it ends, before the next one starts (here the first
// step's handler ends a run of a million steps), and the report keeps no step (a fixed-size,
// trivially copyable struct), so memory stays flat however many steps run.
TEST(Demo, StreamsEachStepAsItEndsAndKeepsNone) {
  static_assert(std::is_trivially_copyable_v<DemoReport>, "DemoReport must keep no steps");
  DemoOptions o;
  o.layers = 2;
  o.tokens = 8;
  o.hidden = 16;
  o.steps = 1000000;
  struct Stop {};
  int calls = 0;
  double first_loss = 0;
  EXPECT_THROW(run_demo(o,
                        [&](int64_t step, const DemoStep& s) {
                          ++calls;
                          EXPECT_EQ(step, 0);
                          first_loss = s.loss;
                          throw Stop{};
                        }),
               Stop);
  EXPECT_EQ(calls, 1);
  EXPECT_GT(first_loss, 0);
}

TEST(Demo, NonPositiveSizesAreConfigErrors) {
  DemoOptions o;
  o.steps = 0;
  EXPECT_THROW(run_demo(o), ConfigError);
}

}  // namespace
}  // namespace pipemat::bench
