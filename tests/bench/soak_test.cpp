// `pipemat bench soak` as a test: a short soak of both loops in which the tracking allocator's
// live bytes are exactly flat after warm-up and the resident set grows less than a stated bound.

#include <gtest/gtest.h>

#include <vector>

#include "pipemat/bench/soak.h"
#include "pipemat/core/error.h"
#include "pipemat/train/config.h"

namespace pipemat::bench {
namespace {

// RSS may move by what the C allocator keeps in its arenas (two rank threads); the allocator
// bytes must not move at all.
constexpr int64_t kRssGrowthBound = 8 << 20;

TEST(Soak, AllocatorBytesAreExactlyFlatAfterWarmupInBothLoops) {
  BenchSoakOptions o;
  o.steps = 320;
  o.every = 100;
  o.warmup = 20;
  const train::TrainConfig config = train::parse_config(kSoakPipeline, "bench soak");
  ASSERT_EQ(config.schedule.ranks, 2);
  const auto samples = run_bench_soak(config, o, nullptr);
  const auto summaries = summarize_soak(samples);
  ASSERT_EQ(summaries.size(), 2u);
  EXPECT_EQ(summaries[0].loop, "pipeline");
  EXPECT_EQ(summaries[1].loop, "remat");
  std::vector<int64_t> steps;
  for (const auto& s : samples) steps.push_back(s.steps);
  EXPECT_EQ(steps, (std::vector<int64_t>{20, 120, 220, 320, 20, 120, 220, 320}));
  for (const auto& s : summaries) {
    SCOPED_TRACE(s.loop);
    EXPECT_EQ(s.samples, 4);
    // Parameters (and gradients) live: 8 layers of a 64x64 GEMM and a norm (pipeline) and
    // 4 layers of 128x128 (remat) in float32.
    const int64_t param_bytes =
        s.loop == "pipeline" ? 8 * (64 * 64 + 64) * 4 : 4 * (128 * 128 + 128) * 4;
    EXPECT_GE(s.allocator_bytes, param_bytes);
    EXPECT_EQ(s.allocator_drift_bytes, 0);
    EXPECT_GT(s.rss_first_bytes, 0);
    EXPECT_LT(s.rss_last_bytes - s.rss_first_bytes, kRssGrowthBound);
  }
}

TEST(Soak, SummaryReportsTheLargestAllocatorDrift) {
  const std::vector<SoakSample> samples = {
      {"remat", 10, 1000, 5000}, {"remat", 20, 1200, 5100}, {"remat", 30, 900, 4900}};
  const auto summaries = summarize_soak(samples);
  ASSERT_EQ(summaries.size(), 1u);
  EXPECT_EQ(summaries[0].samples, 3);
  EXPECT_EQ(summaries[0].allocator_bytes, 1000);
  EXPECT_EQ(summaries[0].allocator_drift_bytes, 200);
  EXPECT_EQ(summaries[0].rss_first_bytes, 5000);
  EXPECT_EQ(summaries[0].rss_last_bytes, 4900);
  EXPECT_EQ(summaries[0].rss_max_bytes, 5100);
}

TEST(Soak, BadOptionsAreConfigErrors) {
  const train::TrainConfig config = train::parse_config("", "defaults");
  BenchSoakOptions o;
  o.warmup = 0;
  EXPECT_THROW(run_bench_soak(config, o, nullptr), ConfigError);
  o = BenchSoakOptions{};
  o.warmup = o.steps;
  EXPECT_THROW(run_bench_soak(config, o, nullptr), ConfigError);
  o = BenchSoakOptions{};
  o.every = 0;
  EXPECT_THROW(run_bench_soak(config, o, nullptr), ConfigError);
  o = BenchSoakOptions{};
  o.loops = "all";
  EXPECT_THROW(run_bench_soak(config, o, nullptr), ConfigError);
}

}  // namespace
}  // namespace pipemat::bench
