// Generators: grid of (P, M, V), closed-form bubbles and peaks, golden per-rank orders.

#include <gtest/gtest.h>

#include <map>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

using testing::compute_strings;
using testing::options;

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::kGPipe,        ScheduleKind::kOneFOneB,
                                      ScheduleKind::kInterleaved,  ScheduleKind::kZeroBubbleH1,
                                      ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV};

bool splits_kind(ScheduleKind k) {
  return k == ScheduleKind::kZeroBubbleH1 || k == ScheduleKind::kZeroBubbleH2 ||
         k == ScheduleKind::kZeroBubbleV;
}

// Every (stage, micro-batch) has exactly one F and one B, or one I and one W.
void expect_counts(const Schedule& s, const std::string& where) {
  std::map<std::tuple<int, int, ActionType>, int> count;
  int compute = 0;
  for (int r = 0; r < s.ranks_count; ++r) {
    for (const Action& a : s.compute_actions(r)) {
      ++count[{a.stage, a.micro_batch, a.type}];
      ++compute;
    }
  }
  const bool split = splits_kind(s.kind);
  const int per = split ? 3 : 2;
  ASSERT_EQ(compute, per * s.stages_count * s.micro_batches) << where;
  for (int st = 0; st < s.stages_count; ++st) {
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      ASSERT_EQ((count[{st, mb, ActionType::kForward}]), 1) << where;
      if (split) {
        ASSERT_EQ((count[{st, mb, ActionType::kBackwardInput}]), 1) << where;
        ASSERT_EQ((count[{st, mb, ActionType::kBackwardWeight}]), 1) << where;
      } else {
        ASSERT_EQ((count[{st, mb, ActionType::kBackward}]), 1) << where;
      }
    }
  }
}

TEST(ScheduleGeneratorsTest, GridValidatesSimulatesAndHasRightCounts) {
  int built = 0, rejected = 0;
  for (ScheduleKind kind : kAllKinds) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 24; ++m) {
        const int max_v = kind == ScheduleKind::kInterleaved ? 4 : 1;
        for (int v = 1; v <= max_v; ++v) {
          const std::string where = std::string(to_string(kind)) + " P=" + std::to_string(p) +
                                    " M=" + std::to_string(m) + " V=" + std::to_string(v);
          Schedule s;
          try {
            s = build_schedule(options(kind, p, m, v));
          } catch (const ConfigError& e) {
            // Only interleaved has a constraint: M must split into equal rounds of >= P.
            ASSERT_EQ(kind, ScheduleKind::kInterleaved) << where << ": " << e.what();
            const int rounds = std::max(1, m / p);
            ASSERT_NE(m % rounds, 0) << where << ": " << e.what();
            EXPECT_NE(std::string(e.what()).find("--micro-batches"), std::string::npos);
            ++rejected;
            continue;
          }
          ASSERT_NO_THROW(validate_schedule(s)) << where;
          const SimulationResult sim = simulate(s);
          ASSERT_GT(sim.makespan, 0) << where;
          ASSERT_GE(sim.bubble_ratio, -1e-12) << where;
          expect_counts(s, where);
          ++built;
        }
      }
    }
  }
  // Every (kind, p, m, v) of the grid: five kinds with v = 1 and interleaved with v = 1..4, over
  // p = 1..8 and m = 1..24; the generator refuses the interleaved ones whose m does not fill
  // its rounds.
  EXPECT_EQ(built + rejected, 9 * 8 * 24);
  EXPECT_EQ(rejected, 165);
  EXPECT_EQ(built, 1563);
}

TEST(ScheduleGeneratorsTest, GpipeAnd1F1BBubbleClosedForm) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB}) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 24; ++m) {
        const SimulationResult sim = simulate(build_schedule(options(kind, p, m)));
        EXPECT_NEAR(sim.bubble_ratio, double(p - 1) / (m + p - 1), 1e-9)
            << to_string(kind) << " P=" << p << " M=" << m;
        EXPECT_DOUBLE_EQ(sim.makespan, 3.0 * (m + p - 1));
      }
    }
  }
}

TEST(ScheduleGeneratorsTest, InterleavedBubbleClosedFormWhenMIsAMultipleOfP) {
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = p; m <= 24; m += p) {
        const SimulationResult sim =
            simulate(build_schedule(options(ScheduleKind::kInterleaved, p, m, v)));
        EXPECT_NEAR(sim.bubble_ratio, double(p - 1) / (v * m + p - 1), 1e-9)
            << "P=" << p << " M=" << m << " V=" << v;
      }
    }
  }
}

TEST(ScheduleGeneratorsTest, ZeroBubbleH1BubbleClosedForm) {
  // Holds once the pipeline fills (M >= P); below that one micro-batch's F-I chain through all
  // stages is longer than 3M + P - 1 and the bubble is larger.
  for (int p = 1; p <= 8; ++p) {
    for (int m = p; m <= 24; ++m) {
      const SimulationResult sim =
          simulate(build_schedule(options(ScheduleKind::kZeroBubbleH1, p, m)));
      EXPECT_NEAR(sim.bubble_ratio, double(p - 1) / (3 * m + p - 1), 1e-9)
          << "P=" << p << " M=" << m;
    }
  }
}

TEST(ScheduleGeneratorsTest, ReferenceNumbersForP4M8) {
  // Cross-checked against an independent unit-cost simulator (research notes, sim.py).
  auto run = [](ScheduleKind k, int v = 1) {
    return simulate(build_schedule(options(k, 4, 8, v)));
  };
  EXPECT_NEAR(run(ScheduleKind::kGPipe).bubble_ratio, 0.273, 5e-4);
  EXPECT_NEAR(run(ScheduleKind::kOneFOneB).bubble_ratio, 0.273, 5e-4);
  EXPECT_NEAR(run(ScheduleKind::kZeroBubbleH1).bubble_ratio, 0.111, 5e-4);
  EXPECT_NEAR(run(ScheduleKind::kInterleaved, 2).bubble_ratio, 0.158, 5e-4);
  EXPECT_NEAR(run(ScheduleKind::kZeroBubbleV).bubble_ratio, 0.059, 5e-4);
  const SimulationResult interleaved = run(ScheduleKind::kInterleaved, 2);
  std::vector<int> peaks;
  for (const auto& r : interleaved.ranks) peaks.push_back(r.peak_activations);
  EXPECT_EQ(peaks, (std::vector<int>{11, 9, 7, 5}));
}

TEST(ScheduleGeneratorsTest, PeakActivationsMatchKnownFigures) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 24; ++m) {
      const std::string where = "P=" + std::to_string(p) + " M=" + std::to_string(m);
      const auto gpipe = simulate(build_schedule(options(ScheduleKind::kGPipe, p, m)));
      const auto ofob = simulate(build_schedule(options(ScheduleKind::kOneFOneB, p, m)));
      const auto h1 = simulate(build_schedule(options(ScheduleKind::kZeroBubbleH1, p, m)));
      const auto h2 = simulate(build_schedule(options(ScheduleKind::kZeroBubbleH2, p, m)));
      const auto zbv = simulate(build_schedule(options(ScheduleKind::kZeroBubbleV, p, m)));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.ranks[r].peak_activations, m) << where;                  // m
        EXPECT_EQ(ofob.ranks[r].peak_activations, std::min(p - r, m)) << where;  // P - r
        EXPECT_EQ(h1.ranks[r].peak_activations, std::min(p, m)) << where;        // P on every rank
        EXPECT_LE(h2.ranks[r].peak_activations, 2 * p - 1) << where;             // <= 2P - 1
        // ZB-V: two half-size chunks per rank; 2P of them = P full micro-batches (1x 1F1B).
        EXPECT_LE(zbv.ranks[r].peak_activations, 2 * p) << where;
        if (m >= 2 * p) {
          EXPECT_EQ(zbv.ranks[r].peak_activations, 2 * p) << where;
        }
      }
      EXPECT_EQ(h2.ranks[0].peak_activations, std::min(2 * p - 1, m)) << where;
    }
  }
}

TEST(ScheduleGeneratorsTest, InterleavedPeakOnRankZero) {
  // Rank 0 holds its warmup + 1 chunk activations: (V - 1) * P + 2 * (P - 1) + 1.
  for (int p = 2; p <= 8; ++p) {
    for (int v = 2; v <= 4; ++v) {
      const auto sim = simulate(build_schedule(options(ScheduleKind::kInterleaved, p, 2 * p, v)));
      EXPECT_EQ(sim.ranks[0].peak_activations, (v - 1) * p + 2 * (p - 1) + 1)
          << "P=" << p << " V=" << v;
    }
  }
}

TEST(ScheduleGeneratorsTest, ZeroBubbleH2HasNoBubbleInsideEachRanksSpan) {
  // ZB-H2 turns the trapezoid into a parallelogram: each rank is busy from its first to its
  // last action once M is large enough; the global bubble is only the start stagger.
  for (int p = 2; p <= 6; ++p) {
    const int m = 4 * p;
    const auto sim = simulate(build_schedule(options(ScheduleKind::kZeroBubbleH2, p, m)));
    for (const auto& rank : sim.ranks) {
      EXPECT_NEAR(rank.busy, rank.last_end - rank.first_start, 1e-9)
          << "P=" << p << " rank " << rank.rank;
    }
  }
}

TEST(ScheduleGeneratorsTest, OneFOneBWarmupIsPMinusRMinusOne) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 24; ++m) {
      const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, p, m));
      for (int r = 0; r < p; ++r) {
        const auto list = s.compute_actions(r);
        int forwards = 0;
        while (forwards < static_cast<int>(list.size()) &&
               list[forwards].type == ActionType::kForward) {
          ++forwards;
        }
        // Warmup forwards plus the first steady forward come before the first backward.
        EXPECT_EQ(forwards, std::min(p - r - 1, m) + (m > p - r - 1 ? 1 : 0))
            << "P=" << p << " M=" << m << " rank " << r;
        // Then strict alternation B, F, B, F ... until the forwards run out.
        for (int k = forwards; k + 1 < static_cast<int>(list.size()); k += 2) {
          if (list[k + 1].type != ActionType::kForward) break;
          EXPECT_EQ(list[k].type, ActionType::kBackward);
          EXPECT_EQ(list[k + 1].micro_batch, list[k].micro_batch + forwards);
        }
      }
    }
  }
}

TEST(ScheduleGeneratorsTest, StageMaps) {
  EXPECT_EQ(v_stage_to_rank(4), (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(loop_stage_to_rank(3, 6), (std::vector<int>{0, 1, 2, 0, 1, 2}));
  const Schedule v = build_schedule(options(ScheduleKind::kZeroBubbleV, 4, 8));
  EXPECT_EQ(v.stages_of(0), (std::vector<int>{0, 7}));
  EXPECT_EQ(v.stages_of(3), (std::vector<int>{3, 4}));
  EXPECT_EQ(v.rank_of(5), 2);
}

TEST(ScheduleGeneratorsTest, OneFOneBGoldenOrderP3M4) {
  // Warmup P - r - 1 forwards, then F/B pairs, then the cooldown backwards (hand-derived).
  const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, 3, 4));
  const std::vector<std::vector<std::string>> golden = {
      {"0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"},
      {"1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1B3"},
      {"2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"},
  };
  EXPECT_EQ(compute_strings(s), golden);
  EXPECT_EQ(s.stage_to_rank, (std::vector<int>{0, 1, 2}));
}

TEST(ScheduleGeneratorsTest, OneFOneBGoldenLoweredOrderP2M2) {
  const Schedule s = build_schedule(options(ScheduleKind::kOneFOneB, 2, 2));
  std::vector<std::vector<std::string>> lists;
  for (const auto& l : s.actions) lists.push_back(format_actions(l));
  const std::vector<std::vector<std::string>> golden = {
      {"0F0", "0SEND_F0", "0RECV_B0", "0F1", "0SEND_F1", "0RECV_B1", "0B0", "0B1"},
      {"1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"},
  };
  EXPECT_EQ(lists, golden);
}

TEST(ScheduleGeneratorsTest, ZeroBubbleVGoldenOrderP2M4) {
  // torch ScheduleZBVZeroBubble order, derived by hand for P=2, M=4 (n = max(2P-1, M) = 4).
  // Rank 0 holds stages 0 and 3, rank 1 holds stages 1 and 2.
  const Schedule s = build_schedule(options(ScheduleKind::kZeroBubbleV, 2, 4));
  const std::vector<std::vector<std::string>> golden = {
      {"0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "3I1", "3W1", "0F3", "0I0", "0W0",
       "3F2", "3I2", "3W2", "0I1", "0W1", "3F3", "3I3", "3W3", "0I2", "0W2", "0I3", "0W3"},
      {"1F0", "2F0", "1F1", "2F1", "2I0", "2W0", "1F2", "1I0", "1W0", "2F2", "2I1", "2W1",
       "1F3", "1I1", "1W1", "2F3", "2I2", "2W2", "1I2", "2I3", "1I3", "1W2", "2W3", "1W3"},
  };
  EXPECT_EQ(compute_strings(s), golden);
  EXPECT_EQ(s.stage_to_rank, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(s.layout, StageLayout::kV);
  EXPECT_EQ(s.virtual_stages, 2);
}

TEST(ScheduleGeneratorsTest, ZeroBubbleVDropsMicroBatchesAboveM) {
  // With M < 2P - 1 torch generates 2P - 1 micro-batches and drops the extra ones.
  const Schedule s = build_schedule(options(ScheduleKind::kZeroBubbleV, 4, 2));
  for (int r = 0; r < 4; ++r) {
    for (const Action& a : s.compute_actions(r)) EXPECT_LT(a.micro_batch, 2);
  }
}

TEST(ScheduleGeneratorsTest, InterleavedStageMapAndConstraintMessage) {
  const Schedule s = build_schedule(options(ScheduleKind::kInterleaved, 2, 4, 3));
  EXPECT_EQ(s.stages_count, 6);
  EXPECT_EQ(s.stage_to_rank, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(s.stages_of(1), (std::vector<int>{1, 3, 5}));
  try {
    build_schedule(options(ScheduleKind::kInterleaved, 4, 9, 2));
    FAIL() << "M=9 does not split into rounds of 4";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--micro-batches 8 or 10"), std::string::npos) << msg;
    EXPECT_NE(msg.find("multiple of 4"), std::string::npos) << msg;
  }
}

TEST(ScheduleGeneratorsTest, RejectsBadOptionsNamingTheFlag) {
  auto message = [](const ScheduleOptions& o) {
    try {
      build_schedule(o);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(options(ScheduleKind::kOneFOneB, 0, 4)).find("--ranks"), std::string::npos);
  EXPECT_NE(message(options(ScheduleKind::kOneFOneB, 4, 0)).find("--micro-batches"),
            std::string::npos);
  EXPECT_NE(message(options(ScheduleKind::kOneFOneB, 4, 8, 2)).find("--kind interleaved"),
            std::string::npos);
  EXPECT_NE(message(options(ScheduleKind::kZeroBubbleV, 4, 8, 3)).find("exactly two"),
            std::string::npos);
  EXPECT_NO_THROW(build_schedule(options(ScheduleKind::kZeroBubbleV, 4, 8, 2)));
}

TEST(ScheduleGeneratorsTest, ParsesKindAndRecomputeNames) {
  EXPECT_EQ(parse_schedule_kind("zb-v"), ScheduleKind::kZeroBubbleV);
  EXPECT_EQ(parse_schedule_kind("1f1b"), ScheduleKind::kOneFOneB);
  EXPECT_EQ(parse_recompute_mode("pretrigger"), RecomputeMode::kPretrigger);
  EXPECT_THROW(parse_schedule_kind("zb"), ConfigError);
  EXPECT_THROW(parse_recompute_mode("eager"), ConfigError);
}

// The worst rank's idle share inside its own span, ignoring the start stagger and early finish.
TEST(SpanBubbleRatio, WorstRankInsideItsOwnSpan) {
  SimulationResult r;
  r.ranks.resize(3);
  r.ranks[0].first_start = 0, r.ranks[0].last_end = 10, r.ranks[0].busy = 8;  // 0.2 idle
  r.ranks[1].first_start = 2, r.ranks[1].last_end = 12, r.ranks[1].busy = 9;  // 0.1 idle
  r.ranks[2].first_start = 5, r.ranks[2].last_end = 5, r.ranks[2].busy = 0;   // no span
  EXPECT_DOUBLE_EQ(span_bubble_ratio(r), 0.2);
  EXPECT_EQ(span_bubble_ratio(SimulationResult{}), 0.0);
  // GPipe on 2 ranks, 1 micro-batch, F = B = 1: rank 0 runs F at 0 and B at 3 (idle 2 of 4),
  // rank 1 runs F and B back to back; the whole-step bubble is 1 - 4 / (2 x 4) as well.
  CostModel unit;
  unit.forward = 1;
  unit.backward = 1;
  const SimulationResult gpipe =
      simulate(build_schedule(testing::options(ScheduleKind::kGPipe, 2, 1)), unit);
  EXPECT_DOUBLE_EQ(gpipe.makespan, 4.0);
  EXPECT_DOUBLE_EQ(span_bubble_ratio(gpipe), 0.5);
  EXPECT_DOUBLE_EQ(gpipe.bubble_ratio, 0.5);
}

}  // namespace
}  // namespace pipemat::schedule
