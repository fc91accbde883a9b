// The scaling projection (pipemat project): stage costs scale with the layers a stage holds, the
// per-message cost is latency + bytes / bandwidth, and the results are the simulator's. With D
// replicas each chunk's gradients are all-reduced after its last B or W (Note [Projected
// all-reduce] in project.h).

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

// P = 2, M = 2, D replicas; gradients of 1000 bytes per layer over a ring of 1000 bytes per unit
// with a latency of 0.5 per all-reduce.
ProjectionOptions data_parallel(ScheduleKind kind, int layers, std::vector<int> data) {
  ProjectionOptions o = one(kind, 2, 2, layers, "F=1,I=1,W=1");
  o.data = std::move(data);
  o.grad_bytes = 1000;
  o.allreduce_bandwidth = 1000;
  o.allreduce_latency = 0.5;
  return o;
}

TEST(ProjectionDataParallel, OneFOneBAllReducesAfterEachRanksLastBackward) {
  // One layer per stage: F = 1, B = 2. Rank 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; rank 1:
  // F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]. With D = 2 a stage's all-reduce takes
  // 2 x 1/2 x 1000 / 1000 + 0.5 = 1.5: rank 1's runs [7, 8.5], rank 0's [9, 10.5], both after
  // the rank's last action, so nothing hides. The reference runs 2 x 2 micro-batches: 4 x 2 x 3.
  const auto p = project_scaling(data_parallel(ScheduleKind::kOneFOneB, 2, {1, 2}));
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].data, 1);
  EXPECT_DOUBLE_EQ(p[0].step, 9.0);
  EXPECT_DOUBLE_EQ(p[0].allreduce, 0.0);
  EXPECT_DOUBLE_EQ(p[0].hidden, 1.0);
  EXPECT_DOUBLE_EQ(p[0].speedup, 12.0 / 9);
  EXPECT_DOUBLE_EQ(p[0].efficiency, 12.0 / 9 / 2);
  EXPECT_EQ(p[1].data, 2);
  EXPECT_DOUBLE_EQ(p[1].step, 10.5);
  EXPECT_DOUBLE_EQ(p[1].bubble, 1.0 / 3);  // the pipeline's, as without replicas
  EXPECT_DOUBLE_EQ(p[1].allreduce, 1.5);
  EXPECT_DOUBLE_EQ(p[1].hidden, 0.0);
  EXPECT_DOUBLE_EQ(p[1].speedup, 24.0 / 10.5);
  EXPECT_DOUBLE_EQ(p[1].efficiency, 24.0 / 10.5 / 4);
  EXPECT_EQ(p[1].peak_activations, 2);
}

TEST(ProjectionDataParallel, OneReplicaIsThePipelineProjection) {
  ProjectionOptions o = one(ScheduleKind::kZeroBubbleV, 4, 8, 32, "F=1,I=1,W=1,comm=0.25");
  const auto before = project_scaling(o);
  o.grad_bytes = 1e6;
  o.allreduce_bandwidth = 10;
  o.allreduce_latency = 3;
  const auto after = project_scaling(o);  // o.data is {1}: no all-reduce, whatever its cost
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].step, before[0].step);
  EXPECT_EQ(after[0].speedup, before[0].speedup);
  EXPECT_EQ(after[0].bubble, before[0].bubble);
  EXPECT_DOUBLE_EQ(after[0].efficiency, before[0].speedup / 4);
  EXPECT_DOUBLE_EQ(after[0].allreduce, 0.0);
  EXPECT_FALSE(projects_data_parallel(o));
  // The documents keep their pipeline-only shape.
  const std::string text = render_projection_text(o, after);
  EXPECT_EQ(text.find("all-reduce"), std::string::npos) << text;
  EXPECT_EQ(nlohmann::json::parse(render_projection_json(o, after))["points"][0].count("data"), 0u);
}

TEST(ProjectionDataParallel, RingCost) {
  ProjectionOptions o = data_parallel(ScheduleKind::kOneFOneB, 8, {4});
  // 8 layers over 2 stages: 4000 bytes a stage; 2 x 3/4 x 4000 / 1000 + 0.5.
  EXPECT_DOUBLE_EQ(projection_allreduce_time(o, 4, 2), 6.5);
  EXPECT_DOUBLE_EQ(projection_allreduce_time(o, 1, 2), 0.0);
  // zb-v's 4 chunks of 2 layers: 2 x 1/2 x 2000 / 1000 + 0.5.
  EXPECT_DOUBLE_EQ(projection_allreduce_time(o, 2, 4), 2.5);
}

// Sharded (Note [Projected all-reduce]): the 1F1B timeline above with a reduce-scatter of
// 1/2 x 1000 / 1000 + 0.5 = 1 a stage (rank 1's [7, 8], rank 0's [9, 10]), then each rank's
// all-gather of its one chunk, 1 more: the step ends at 11. The state: one layer a rank, 1000
// bytes of parameters and of gradients, 2000 of optimizer state / D.
TEST(ProjectionDataParallel, ShardedOptimizerReduceScattersThenGathersAfterTheCompute) {
  ProjectionOptions o = data_parallel(ScheduleKind::kOneFOneB, 2, {1, 2});
  o.shard_optimizer = true;
  o.optimizer_state_bytes = 2000;
  EXPECT_DOUBLE_EQ(projection_allreduce_time(o, 2, 2), 1.0);
  auto p = project_scaling(o);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_DOUBLE_EQ(p[0].step, 9.0);
  EXPECT_DOUBLE_EQ(p[0].gather, 0.0);
  EXPECT_DOUBLE_EQ(p[0].state_bytes, 4000.0);
  EXPECT_DOUBLE_EQ(p[1].step, 11.0);
  EXPECT_DOUBLE_EQ(p[1].allreduce, 1.0);
  EXPECT_DOUBLE_EQ(p[1].gather, 1.0);
  EXPECT_DOUBLE_EQ(p[1].hidden, 0.0);
  EXPECT_DOUBLE_EQ(p[1].state_bytes, 3000.0);
  EXPECT_DOUBLE_EQ(p[1].speedup, 24.0 / 11);
  // Unsharded the same state is whole on every replica, and the all-reduce takes 1.5.
  o.shard_optimizer = false;
  p = project_scaling(o);
  EXPECT_DOUBLE_EQ(p[1].step, 10.5);
  EXPECT_DOUBLE_EQ(p[1].gather, 0.0);
  EXPECT_DOUBLE_EQ(p[1].state_bytes, 4000.0);
  // The documents: gather and state columns, the JSON's fields.
  o.shard_optimizer = true;
  p = project_scaling(o);
  const std::string text = render_projection_text(o, p);
  EXPECT_NE(text.find("hidden   gather      state\n"), std::string::npos) << text;
  EXPECT_NE(text.find("   1.000       0.00\n"), std::string::npos) << text;  // 3000 B in MiB
  const nlohmann::json j = nlohmann::json::parse(render_projection_json(o, p));
  EXPECT_DOUBLE_EQ(j["points"][1]["gather"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["points"][1]["state_bytes"].get<double>(), 3000.0);
  EXPECT_TRUE(j["shard_optimizer"].get<bool>());
}

TEST(ProjectionDataParallel, ZbvHidesTheFirstChunksAllReduceBehindTheSecondsBackward) {
  // One layer per chunk, F = I = W = 1. Rank 0 (stages 0 and 3): 0F0 [0,1] 0F1 [1,2], 3F0 3I0
  // 3W0 3F1 3I1 3W1 from 3 to 9, 0I0 0W0 [9,11], 0I1 0W1 [12,14]: stage 3's last W ends at 9,
  // stage 0's at 14. Rank 1 (stages 1 and 2): 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1
  // from 1 to 13: stage 2's last W ends at 11, stage 1's at 13. The reference runs 4
  // micro-batches of 4 layers x 3 = 48.
  ProjectionOptions o = data_parallel(ScheduleKind::kZeroBubbleV, 4, {1, 2});
  o.grad_bytes = 1500;  // 2 x 1/2 x 1500 / 1000 + 0.5 = 2 a chunk
  auto p = project_scaling(o);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_DOUBLE_EQ(p[0].step, 14.0);
  // Rank 0: stage 3's [9, 11] ends before 0W1 does, fully hidden; stage 0's [14, 16].
  // Rank 1: stage 2's [11, 13] ends with 1W1, fully hidden; stage 1's [13, 15].
  EXPECT_DOUBLE_EQ(p[1].step, 16.0);
  EXPECT_DOUBLE_EQ(p[1].allreduce, 4.0);
  EXPECT_DOUBLE_EQ(p[1].hidden, 0.5);
  EXPECT_DOUBLE_EQ(p[1].speedup, 48.0 / 16);
  EXPECT_DOUBLE_EQ(p[1].efficiency, 48.0 / 16 / 4);

  // 4 a chunk: rank 1's stage 2 all-reduce [11, 15] runs 2 past its last W (13), and stage 1's
  // waits for it: [15, 19]. Rank 0: [9, 13] hidden, [14, 18]. Hidden: (4 + 2) of 16.
  o.grad_bytes = 4000;
  o.allreduce_latency = 0;
  p = project_scaling(o);
  EXPECT_DOUBLE_EQ(p[1].step, 19.0);
  EXPECT_DOUBLE_EQ(p[1].allreduce, 8.0);
  EXPECT_DOUBLE_EQ(p[1].hidden, 6.0 / 16);
}

TEST(ProjectionDataParallel, TableJsonAndChart) {
  ProjectionOptions o = data_parallel(ScheduleKind::kZeroBubbleH1, 8, {1, 2, 4});
  o.kinds = {ScheduleKind::kZeroBubbleH1, ScheduleKind::kInterleaved};
  o.ranks = {2, 4};
  o.micro_batches = {4, 5};
  const auto points = project_scaling(o);
  ASSERT_EQ(points.size(), 2u * 2 * 2 * 3);  // (kind, P, M, D), D fastest
  EXPECT_EQ(points[1].data, 2);
  EXPECT_EQ(points[3].micro_batches, 5);
  // Interleaved over 2 ranks runs 5 micro-batches in 2 rounds that are not equal: refused for
  // every D.
  EXPECT_EQ(points[15].kind, ScheduleKind::kInterleaved);
  EXPECT_FALSE(points[15].feasible);
  EXPECT_EQ(points[17].data, 4);
  EXPECT_FALSE(points[17].feasible);
  EXPECT_TRUE(points[18].feasible);
  for (const auto& p : points) {
    if (!p.feasible) continue;
    EXPECT_DOUBLE_EQ(p.efficiency, p.speedup / (p.data * p.ranks));
    EXPECT_LE(p.efficiency, 1.0);
  }
  // More replicas, a longer all-reduce and a longer step on the same pipeline.
  EXPECT_LT(points[0].step, points[1].step);
  EXPECT_LT(points[1].step, points[2].step);
  EXPECT_GT(points[2].allreduce, points[1].allreduce);

  const std::string text = render_projection_text(o, points);
  EXPECT_NE(text.find("speedup / (D x P)"), std::string::npos) << text;
  EXPECT_NE(text.find("all-reduce hidden"), std::string::npos) << text;
  EXPECT_EQ(count(text, "\nzb-h1 "), 12u) << text;
  EXPECT_EQ(count(text, "n/a: "), 3u) << text;
  const nlohmann::json j = nlohmann::json::parse(render_projection_json(o, points));
  ASSERT_EQ(j["points"].size(), 24u);
  EXPECT_EQ(j["points"][2]["data"], 4);
  EXPECT_DOUBLE_EQ(j["points"][2]["efficiency"].get<double>(), points[2].efficiency);
  EXPECT_DOUBLE_EQ(j["points"][2]["allreduce"].get<double>(), points[2].allreduce);
  EXPECT_DOUBLE_EQ(j["allreduce_bandwidth"].get<double>(), 1000.0);
  const std::string svg = render_projection_svg(o, points);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  // A line per schedule and M in each P panel, less interleaved's refused M = 5 on 2 ranks.
  EXPECT_EQ(count(svg, "<polyline"), 7u);
  EXPECT_EQ(count(svg, ">P = "), 2u);
  EXPECT_NE(svg.find(">zb-h1, M=5<"), std::string::npos);
  EXPECT_NE(svg.find("data-parallel replicas D"), std::string::npos);
}

TEST(ProjectionDataParallel, BadOptionsNameTheFlag) {
  auto message = [](const ProjectionOptions& o) {
    try {
      project_scaling(o);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ProjectionOptions o = data_parallel(ScheduleKind::kOneFOneB, 2, {2, 0});
  EXPECT_NE(message(o).find("--data 0 is outside [1, 65536]"), std::string::npos) << message(o);
  o.data = {};
  EXPECT_NE(message(o).find("--data is empty"), std::string::npos) << message(o);
  o.data = {2};
  o.allreduce_bandwidth = -1;
  EXPECT_NE(message(o).find("--allreduce-bw -1 is not a non-negative"), std::string::npos)
      << message(o);
  o.allreduce_bandwidth = 0;
  EXPECT_NE(message(o).find("--grad-bytes 1000 needs --allreduce-bw"), std::string::npos)
      << message(o);
  o.allreduce_bandwidth = 1000;
  o.allreduce_latency = -0.5;
  EXPECT_NE(message(o).find("--allreduce-latency -0.5"), std::string::npos) << message(o);
  o.allreduce_latency = 0;
  o.grad_bytes = -3;
  EXPECT_NE(message(o).find("--grad-bytes -3"), std::string::npos) << message(o);
  // Latency alone needs no bandwidth.
  o.grad_bytes = 0;
  o.allreduce_bandwidth = 0;
  o.allreduce_latency = 2;
  EXPECT_DOUBLE_EQ(project_scaling(o)[0].step, 9.0 + 2);

  // The command maps its flags onto the options.
  ProjectCommandOptions c;
  c.costs = "F=1,I=1,W=1";
  c.schedules = {"1f1b"};
  c.ranks = {2};
  c.micro_batches = {2};
  c.layers = 2;
  c.data = {2};
  c.grad_bytes = 1000;
  EXPECT_THROW(render_project_command(c), ConfigError);
  c.allreduce_bw = 1000;
  c.allreduce_latency = 0.5;
  c.format = "json";
  const nlohmann::json j = nlohmann::json::parse(render_project_command(c));
  EXPECT_DOUBLE_EQ(j["points"][0]["step"].get<double>(), 10.5);
}

}  // namespace
}  // namespace pipemat::schedule
