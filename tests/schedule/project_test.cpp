// The scaling projection (pipemat project): stage costs scale with the layers a stage holds, the
// per-message cost is latency + bytes / bandwidth, and the results are the simulator's.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>

#include "pipemat/core/error.h"
#include "pipemat/schedule/project.h"

namespace pipemat::schedule {
namespace {

ProjectionOptions one(ScheduleKind kind, int p, int m, int layers, const std::string& costs) {
  ProjectionOptions o;
  o.kinds = {kind};
  o.ranks = {p};
  o.micro_batches = {m};
  o.layers = layers;
  o.layer_costs = parse_costs(costs);
  return o;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(Projection, TwoStagesOfTwoLayersOneMicroBatch) {
  // Each stage: F = 2, B = 4. F0 [0,2], F1 [2,4], B1 [4,8], B0 [8,12]; the reference is 4 x 3.
  auto p = project_scaling(one(ScheduleKind::kOneFOneB, 2, 1, 4, "F=1,I=1,W=1"));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(p[0].feasible);
  EXPECT_DOUBLE_EQ(p[0].step, 12.0);
  EXPECT_DOUBLE_EQ(p[0].bubble, 0.5);
  EXPECT_DOUBLE_EQ(p[0].speedup, 1.0);
  EXPECT_EQ(p[0].peak_activations, 1);
  // Two messages on the critical path, 0.5 each: as latency, or as 0.1 + 400 bytes at 1000/unit.
  EXPECT_DOUBLE_EQ(
      project_scaling(one(ScheduleKind::kOneFOneB, 2, 1, 4, "F=1,I=1,W=1,comm=0.5"))[0].step, 13.0);
  EXPECT_DOUBLE_EQ(project_scaling(one(ScheduleKind::kOneFOneB, 2, 1, 4,
                                       "F=1,I=1,W=1,comm=0.1,bw=1000,bytes=400"))[0]
                       .step,
                   13.0);
}

TEST(Projection, OneFOneBMatchesTheClosedForm) {
  // 1F1B without comm: (M + P - 1) x (F + B) per stage, bubble (P - 1) / (M + P - 1).
  const auto p = project_scaling(one(ScheduleKind::kOneFOneB, 4, 8, 32, "F=1,B=2"));
  EXPECT_DOUBLE_EQ(p[0].step, 11 * 24.0);
  EXPECT_NEAR(p[0].bubble, 3.0 / 11, 1e-12);
  EXPECT_NEAR(p[0].speedup, 32 * 3 * 8 / (11 * 24.0), 1e-12);
  EXPECT_EQ(p[0].peak_activations, 4);
}

TEST(Projection, ZbvChunksHoldHalfAStagesLayers) {
  ProjectionOptions o = one(ScheduleKind::kZeroBubbleV, 4, 8, 32, "F=1,I=1,W=1,comm=0.25");
  const auto p = project_scaling(o);
  ScheduleOptions so;
  so.kind = ScheduleKind::kZeroBubbleV;
  so.ranks = 4;
  so.micro_batches = 8;
  const SimulationResult sim = simulate(build_schedule(so), parse_costs("F=4,I=4,W=4,comm=0.25"));
  EXPECT_DOUBLE_EQ(p[0].step, sim.makespan);
  EXPECT_DOUBLE_EQ(p[0].bubble, sim.bubble_ratio);
  EXPECT_DOUBLE_EQ(p[0].speedup, 32 * 3 * 8 / sim.makespan);
}

TEST(Projection, GridTableJsonAndChart) {
  ProjectionOptions o;
  o.kinds = {ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved, ScheduleKind::kZeroBubbleV};
  o.ranks = {4, 8};
  o.micro_batches = {8, 9, 16};
  o.layer_costs = parse_costs("F=1,I=1,W=1,R=0.5,comm=0.1");
  o.recompute = RecomputeMode::kPretrigger;
  const auto points = project_scaling(o);
  ASSERT_EQ(points.size(), 18u);
  // Interleaved over 4 ranks runs M in rounds of >= 4: 9 does not split (2 rounds).
  const ProjectionPoint& refused = points[6 + 1];
  EXPECT_EQ(refused.kind, ScheduleKind::kInterleaved);
  EXPECT_EQ(refused.ranks, 4);
  EXPECT_EQ(refused.micro_batches, 9);
  EXPECT_FALSE(refused.feasible);
  EXPECT_NE(refused.why.find("must split into equal rounds"), std::string::npos) << refused.why;
  for (const auto& p : points) {
    if (&p == &refused) continue;
    EXPECT_TRUE(p.feasible) << to_string(p.kind) << " P=" << p.ranks << " M=" << p.micro_batches;
    EXPECT_GT(p.speedup, 1.0);
    EXPECT_LT(p.speedup, p.ranks);
  }
  // More micro-batches, smaller 1F1B bubble.
  EXPECT_LT(points[2].bubble, points[0].bubble);

  const std::string text = render_projection_text(o, points);
  EXPECT_EQ(count(text, "\n1f1b "), 6u) << text;
  EXPECT_EQ(count(text, "n/a: "), 1u) << text;  // on 8 ranks, 9 micro-batches are one round
  const nlohmann::json j = nlohmann::json::parse(render_projection_json(o, points));
  ASSERT_EQ(j["points"].size(), 18u);
  EXPECT_EQ(j["points"][0]["step"].get<double>(), points[0].step);
  EXPECT_EQ(j["recompute"], "pretrigger");
  EXPECT_DOUBLE_EQ(j["message_cost"].get<double>(), 0.1);
  const std::string svg = render_projection_svg(o, points);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(count(svg, "<polyline"), 6u);  // one line per schedule and stage count
  EXPECT_EQ(count(svg, ">P = "), 2u);
}

TEST(Projection, BadOptionsAreConfigErrors) {
  EXPECT_THROW(project_scaling(one(ScheduleKind::kOneFOneB, 1, 8, 32, "F=1")), ConfigError);
  EXPECT_THROW(project_scaling(one(ScheduleKind::kOneFOneB, 4, 0, 32, "F=1")), ConfigError);
  EXPECT_THROW(project_scaling(one(ScheduleKind::kOneFOneB, 4, 8, 0, "F=1")), ConfigError);
  EXPECT_THROW(project_scaling(one(ScheduleKind::kOneFOneB, 4, 8, 32, "F=0,I=0,W=0")), ConfigError);
  ProjectCommandOptions c;
  c.costs = "F=1";
  c.format = "png";
  EXPECT_THROW(render_project_command(c), ConfigError);
  c.format = "json";
  c.schedules = {"2f2b"};
  EXPECT_THROW(render_project_command(c), ConfigError);
  c.schedules = {"zb-h1"};
  c.ranks = {4};
  c.micro_batches = {8};
  EXPECT_EQ(nlohmann::json::parse(render_project_command(c))["points"].size(), 1u);
}

}  // namespace
}  // namespace pipemat::schedule
