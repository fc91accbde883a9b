// Pipeline training against the single-process reference: every schedule kind x remat policy,
// 2 and 4 ranks as threads over the local transport. Losses of every step and every parameter
// after every optimizer step must be bitwise equal (the micro-batch accumulation order of each
// stage matches the reference's for every generated schedule).

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>

#include "pipemat/comm/device_lane.h"
#include "pipemat/comm/rank_threads.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/remat.h"
#include "pipemat/schedule/torch_csv.h"
#include "pipemat/train/train.h"

namespace pipemat::train {
namespace {

TrainConfig small_config(const std::string& kind, int ranks, const std::string& model,
                         const std::string& remat_policy) {
  TrainConfig c;
  c.model.kind = models::parse_model_kind(model).value();
  c.model.layers = 8;
  c.model.hidden = 16;
  c.model.tokens = 8;
  c.model.heads = 2;
  c.schedule.kind = schedule::parse_schedule_kind(kind);
  c.schedule.ranks = ranks;
  c.schedule.micro_batches = 4;
  c.schedule.virtual_stages = kind == "interleaved" ? 2 : 1;
  c.schedule.recompute = remat_policy == "none" ? schedule::RecomputeMode::kNone
                                                : schedule::RecomputeMode::kPretrigger;
  c.remat.policy = models::parse_remat_policy(remat_policy).value();
  c.training.steps = 2;
  c.training.lr = 0.05;
  c.output.progress = false;
  return c;
}

// remat.stages naming c's policy for every model stage: each stage checkpoints, the last stage of
// 1F1B and ZB-H1 too (Note [Replays that cannot lower a peak] drops those replays under
// remat.policy alone).
TrainConfig every_stage_checkpointed(TrainConfig c) {
  const int chunks = c.schedule.kind == schedule::ScheduleKind::kZeroBubbleV
                         ? 2
                         : static_cast<int>(c.schedule.virtual_stages);
  c.remat.stages.assign(static_cast<size_t>(c.schedule.ranks * chunks),
                        models::StageRemat::named(c.remat.policy));
  return c;
}

void expect_matches_reference(const TrainConfig& c) {
  TrainResult pipe = train_in_process(c, nullptr);
  TrainResult ref = train_reference(c, nullptr);
  ASSERT_EQ(pipe.steps.size(), ref.steps.size());
  for (size_t s = 0; s < ref.steps.size(); ++s) {
    EXPECT_EQ(pipe.steps[s].loss, ref.steps[s].loss) << "loss of step " << s;
  }
  std::map<std::string, at::Tensor> want(ref.params.begin(), ref.params.end());
  ASSERT_EQ(pipe.params.size(), want.size());
  for (const auto& [name, value] : pipe.params) {
    ASSERT_TRUE(want.count(name)) << name;
    EXPECT_TRUE(at::equal(value, want[name]))
        << "parameter " << name << " after the last step: max diff "
        << (value - want[name]).abs().max().item<double>();
  }
}

struct GridCase {
  std::string kind;
  int ranks;
  std::string model;
  std::string policy;
};

class PipelineGrid : public ::testing::TestWithParam<GridCase> {};

TEST_P(PipelineGrid, LossesAndParametersEqualTheReferenceBitwise) {
  const auto& p = GetParam();
  expect_matches_reference(small_config(p.kind, p.ranks, p.model, p.policy));
}

std::vector<GridCase> grid() {
  std::vector<GridCase> cases;
  for (const char* kind : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"}) {
    for (const char* policy : {"none", "full", "selective"}) {
      cases.push_back({kind, 2, "rmsnorm-gemm", policy});
    }
    cases.push_back({kind, 2, "save-chain", "selective"});
  }
  cases.push_back({"1f1b", 4, "rmsnorm-gemm", "selective"});
  cases.push_back({"zb-v", 4, "rmsnorm-gemm", "selective"});
  cases.push_back({"zb-h1", 4, "transformer", "selective"});
  cases.push_back({"1f1b", 2, "moe", "selective"});
  cases.push_back({"zb-v", 2, "mlp", "full"});
  return cases;
}

// "zb_v_2r_rmsnorm_gemm_selective"
std::string grid_name(const ::testing::TestParamInfo<GridCase>& test) {
  std::string n = test.param.kind + "_" + std::to_string(test.param.ranks) + "r_" +
                  test.param.model + "_" + test.param.policy;
  for (auto& ch : n) {
    if (ch == '-') ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineGrid, ::testing::ValuesIn(grid()), grid_name);

// Note [Mixed precision]: under training.precision bf16 every schedule kind, with and without
// remat (selective: SAVE regions on the GEMMs, recomputed norms, pre-triggered replay; a SAVE ->
// SAVE chain; the MoE), and a data-parallel 2 x 2 run with clipping, equal the single process
// bitwise; and bf16 is in effect (the losses are not float32's).
class Bf16Grid : public ::testing::TestWithParam<GridCase> {};

TEST_P(Bf16Grid, LossesAndParametersEqualTheReferenceBitwise) {
  const auto& p = GetParam();
  auto c = small_config(p.kind, p.ranks, p.model, p.policy);
  c.training.precision = pp::Precision::kBFloat16;
  if (p.ranks == 4) c.parallel.data = 2, c.schedule.ranks = 2, c.training.clip_grad_norm = 0.5;
  expect_matches_reference(c);
  auto fp32 = c;
  fp32.training.precision = pp::Precision::kFloat32;
  const TrainResult a = train_reference(c, nullptr), b = train_reference(fp32, nullptr);
  if (p.model != "save-chain") {  // its ops are all elementwise: none that autocast lowers
    EXPECT_NE(a.steps[0].loss, b.steps[0].loss) << "bf16 computes in bf16";
  }
}

std::vector<GridCase> bf16_grid() {
  std::vector<GridCase> cases;
  for (const char* kind : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"}) {
    cases.push_back({kind, 2, "rmsnorm-gemm", "selective"});
  }
  cases.push_back({"1f1b", 2, "rmsnorm-gemm", "none"});
  cases.push_back({"zb-v", 2, "transformer", "full"});
  cases.push_back({"zb-h2", 2, "save-chain", "selective"});  // SAVE -> SAVE placeholders
  cases.push_back({"1f1b", 2, "moe", "selective"});
  cases.push_back({"zb-h1", 4, "rmsnorm-gemm", "selective"});  // 2 replicas x 2 ranks
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Schedules, Bf16Grid, ::testing::ValuesIn(bf16_grid()), grid_name);

// Note [Data x pipeline]: D replicas of a P-rank pipeline (D x P ranks as threads) equal the
// single process on the global batch of D x M micro-batches, bitwise: pure data parallelism
// (2 x 1), 2 x 2 under every schedule kind with split backward among them, 3 x 2, and the MoE,
// whose experts a replica's micro-batches may leave without a gradient.
struct DataCase {
  std::string kind;
  int ranks;
  int data;
  std::string model;
};

class DataGrid : public ::testing::TestWithParam<DataCase> {};

TEST_P(DataGrid, ReplicasEqualTheReferenceOnTheGlobalBatchBitwise) {
  const auto& p = GetParam();
  auto c = small_config(p.kind, p.ranks, p.model, "selective");
  c.parallel.data = p.data;
  c.training.clip_grad_norm = 0.5;
  expect_matches_reference(c);
}

INSTANTIATE_TEST_SUITE_P(Layouts, DataGrid,
                         ::testing::Values(DataCase{"gpipe", 1, 2, "rmsnorm-gemm"},
                                           DataCase{"gpipe", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"1f1b", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"interleaved", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"zb-h1", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"zb-h2", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"zb-v", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"1f1b", 2, 3, "transformer"},
                                           DataCase{"1f1b", 2, 2, "moe"}),
                         [](const ::testing::TestParamInfo<DataCase>& test) {
                           std::string n = std::to_string(test.param.data) + "x" +
                                           std::to_string(test.param.ranks) + "_" +
                                           test.param.kind + "_" + test.param.model;
                           for (auto& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

// Note [Sharded optimizer]: parallel.shard_optimizer leaves the bits unchanged: D x P under every
// schedule kind with remat and clipping, AdamW with weight decay and SGD with momentum, equal the
// single process on the global batch; the run's metrics give each rank's optimizer state.
class ShardedGrid : public ::testing::TestWithParam<DataCase> {};

TEST_P(ShardedGrid, ShardedReplicasEqualTheReferenceBitwise) {
  const auto& p = GetParam();
  auto c = small_config(p.kind, p.ranks, p.model, "selective");
  c.parallel.data = p.data;
  c.parallel.shard_optimizer = true;
  c.training.clip_grad_norm = 0.5;
  c.training.weight_decay = 0.01;
  if (p.kind == "zb-h2" || p.kind == "gpipe") {
    c.training.momentum = 0.9;  // SGD with momentum
  } else {
    c.training.optimizer = OptimizerKind::kAdamW;
    c.training.lr = 0.01;
  }
  expect_matches_reference(c);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedGrid,
                         ::testing::Values(DataCase{"gpipe", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"1f1b", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"interleaved", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"zb-h1", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"zb-h2", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"zb-v", 2, 2, "rmsnorm-gemm"},
                                           DataCase{"1f1b", 2, 3, "transformer"},
                                           DataCase{"zb-v", 2, 3, "rmsnorm-gemm"},
                                           DataCase{"1f1b", 2, 2, "moe"}),
                         [](const ::testing::TestParamInfo<DataCase>& test) {
                           std::string n = std::to_string(test.param.data) + "x" +
                                           std::to_string(test.param.ranks) + "_" +
                                           test.param.kind + "_" + test.param.model;
                           for (auto& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

// Note [Sharded optimizer] with the other features of the exchange: under bf16 (Note [Mixed
// precision]) and with one message per parameter (64-byte buckets, the weight tail posting them
// one by one), 2 sharded replicas still equal the single process bitwise.
TEST(PipelineTrain, ShardedReplicasUnderBf16AndOneParameterBucketsEqualTheReference) {
  auto c = small_config("zb-h1", 2, "rmsnorm-gemm", "selective");
  c.parallel.data = 2;
  c.parallel.shard_optimizer = true;
  c.training.clip_grad_norm = 0.5;
  c.training.optimizer = OptimizerKind::kAdamW;
  c.training.lr = 0.01;
  auto bf16 = c;
  bf16.training.precision = pp::Precision::kBFloat16;
  expect_matches_reference(bf16);
  auto buckets = c;
  buckets.schedule.kind = schedule::ScheduleKind::kZeroBubbleH2;
  buckets.parallel.bucket_bytes = 64;
  expect_matches_reference(buckets);
}

// Note [Sharded optimizer]: the last stage's rank reports the optimizer state of every rank of
// its pipeline: with 2 replicas exactly the AdamW moments (8 bytes an element) of the parameters
// replica 0 owns, and without sharding of all of them.
TEST(PipelineTrain, ShardedOptimizerStateIsTheOwnedSliceOnly) {
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "none");
  c.parallel.data = 2;
  c.training.optimizer = OptimizerKind::kAdamW;
  const TrainResult plain = train_in_process(c, nullptr);
  c.parallel.shard_optimizer = true;
  const TrainResult sharded = train_in_process(c, nullptr);
  const std::vector<int64_t> all = plain.steps.back().rank_optimizer_state_bytes;
  const std::vector<int64_t> mine = sharded.steps.back().rank_optimizer_state_bytes;
  ASSERT_EQ(all.size(), 2u);
  ASSERT_EQ(mine.size(), 2u);
  // Replica 0's parameters, pipeline rank 0's then rank 1's, each in stage then parameter order;
  // unsharded each rank holds the moments of all of its own.
  std::vector<std::vector<int64_t>> numels(2);
  int64_t rank0 = 0;
  for (const auto& [name, value] : plain.params) {
    const size_t r = rank0 < all[0] ? 0 : 1;
    numels[r].push_back(value.numel());
    if (r == 0) rank0 += 8 * value.numel();
  }
  ASSERT_EQ(rank0, all[0]);
  // One bucket per stage (the default bucket size): replica 0 owns its first half, rounded down.
  for (size_t r = 0; r < 2; ++r) {
    int64_t total = 0;
    for (int64_t n : numels[r]) total += n;
    const pp::ShardSlice slice = pp::shard_slices(numels[r], 2)[0];
    EXPECT_EQ(slice.end - slice.begin, total / 2);
    EXPECT_EQ(all[r], 8 * total) << "rank " << r;
    EXPECT_EQ(mine[r], 8 * (total / 2)) << "rank " << r;
    // Parameters whole on both; gradients whole unsharded, replica 0's slice sharded.
    EXPECT_EQ(plain.steps.back().rank_parameter_bytes.at(r), 4 * total) << "rank " << r;
    EXPECT_EQ(sharded.steps.back().rank_parameter_bytes.at(r), 4 * total) << "rank " << r;
    EXPECT_EQ(plain.steps.back().rank_gradient_bytes.at(r), 4 * total) << "rank " << r;
    EXPECT_EQ(sharded.steps.back().rank_gradient_bytes.at(r), 4 * (total / 2)) << "rank " << r;
  }
}

// Note [Overlapped gradient all-reduce]: with one message per parameter (64-byte buckets) the
// replicas still equal the reference bitwise, under ZB-V whose later stage ends its backward
// first; every step reports the exchange and the part of it waited for.
TEST(PipelineTrain, GradientBucketsOfOneParameterEqualTheReference) {
  // Note [Weight tail]: under the split schedules each tail of W actions runs bucket by bucket.
  for (const char* kind : {"zb-h1", "zb-h2"}) {
    auto split = small_config(kind, 2, "rmsnorm-gemm", "selective");
    split.parallel.data = 2;
    split.parallel.bucket_bytes = 64;
    expect_matches_reference(split);
  }
  auto c = small_config("zb-v", 2, "rmsnorm-gemm", "selective");
  c.parallel.data = 2;
  c.parallel.bucket_bytes = 64;
  expect_matches_reference(c);
  const TrainResult r = train_in_process(c, nullptr);
  for (const auto& m : r.steps) {
    EXPECT_GT(m.allreduce_ms, 0.0) << "step " << m.step;
    EXPECT_GE(m.allreduce_wait_ms, 0.0) << "step " << m.step;
    EXPECT_LE(m.allreduce_wait_ms, m.allreduce_ms) << "step " << m.step;
    EXPECT_EQ(m.allreduce_end_ms - m.allreduce_start_ms, m.allreduce_ms);
    // The timeline's spans: every rank of replica 0's pipeline, inside the step.
    ASSERT_EQ(m.rank_allreduce_ms.size(), 2u) << "step " << m.step;
    for (const auto& [start, end] : m.rank_allreduce_ms) {
      EXPECT_GT(start, 0.0) << "step " << m.step;
      EXPECT_GT(end, start) << "step " << m.step;
      EXPECT_LE(end, m.step_ms) << "step " << m.step;
    }
  }
  c.parallel.data = 1;
  EXPECT_EQ(train_in_process(c, nullptr).steps.back().allreduce_ms, 0.0) << "one pipeline";
}

// Note [Device lanes]: a run whose tensor lists all go over a lane (the transport link, which here
// carries every CPU tensor as NCCL carries a GPU's) equals the reference bitwise: 2 replicas of a
// 2-rank ZB-V pipeline with clipping, whose activations, gradients, norms and data-parallel sums
// take the lane. The first progress line names it.
TEST(PipelineTrain, ALaneCarryingEveryListEqualsTheReference) {
  auto c = small_config("zb-v", 2, "rmsnorm-gemm", "selective");
  c.parallel.data = 2;
  c.training.clip_grad_norm = 0.5;
  c.output.progress = true;
  auto job = comm::make_local_transports(4);
  for (auto& t : job) {
    t->attach_device_lane(comm::make_device_lane(*t, comm::make_transport_link(*t, 1)));
  }
  std::vector<TrainResult> results(4);
  std::vector<std::ostringstream> progress(4);
  comm::run_rank_threads(4, [&](int r) {
    results[static_cast<size_t>(r)] =
        train_on(c, *job[static_cast<size_t>(r)], &progress[static_cast<size_t>(r)]);
  });
  const TrainResult ref = train_reference(c, nullptr);
  std::map<std::string, at::Tensor> want(ref.params.begin(), ref.params.end());
  size_t params = 0;
  for (size_t r = 0; r < results.size(); ++r) {
    if (results[r].last_stage_rank) {
      ASSERT_EQ(results[r].steps.size(), ref.steps.size());
      for (size_t s = 0; s < ref.steps.size(); ++s) {
        EXPECT_EQ(results[r].steps[s].loss, ref.steps[s].loss) << "loss of step " << s;
      }
      EXPECT_NE(progress[r].str().find("compute: 4 ranks over local+transport on cpu"),
                std::string::npos)
          << progress[r].str();
    }
    for (const auto& [name, value] : results[r].params) {
      ASSERT_TRUE(want.count(name)) << name;
      EXPECT_TRUE(at::equal(value, want[name])) << "parameter " << name;
      ++params;
    }
  }
  EXPECT_EQ(params, want.size());
}

TEST(PipelineTrain, AnNcclLaneNeedsACudaDevice) {
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "none");
  c.transport.lane = comm::LaneKind::kNccl;
  try {
    train_in_process(c, nullptr);
    ADD_FAILURE() << "an nccl lane on the CPU";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "transport.lane: nccl moves tensors between GPUs, but training.device is cpu; "
                 "set training.device: cuda, or transport.lane: none");
  }
}

// A layout the job's ranks do not fill is a clear error before anything is built.
TEST(PipelineTrain, AWrongDataLayoutIsAConfigError) {
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "none");
  c.parallel.data = 2;
  auto three = comm::make_local_transports(3);
  try {
    train_on(c, *three[0], nullptr);
    ADD_FAILURE() << "a 3-rank job ran a 2 x 2 layout";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "parallel.data is 2 and schedule.ranks 2: the job needs 4 ranks (pipemat-run -n "
                 "4 ...) but has 3");
  }
}

TEST(PipelineTrain, LazyRecomputeAndAdamWAlsoMatch) {
  auto c = small_config("zb-h1", 2, "rmsnorm-gemm", "selective");
  c.schedule.recompute = schedule::RecomputeMode::kLazy;
  c.training.optimizer = OptimizerKind::kAdamW;
  c.training.lr = 0.01;
  expect_matches_reference(c);
}

TEST(PipelineTrain, ExecutionCountsPerStepWithSplitBackward) {
  // zb-h1 with pre-triggered recompute: I and W per micro-batch, one replay each.
  auto c = every_stage_checkpointed(small_config("zb-h1", 2, "rmsnorm-gemm", "selective"));
  TrainResult r = train_in_process(c, nullptr);
  const int64_t units = c.model.layers * c.schedule.micro_batches;  // layer x micro-batch
  for (const auto& m : r.steps) {
    EXPECT_EQ(m.remat.unit_calls, units) << "one forward per layer and micro-batch";
    EXPECT_EQ(m.remat.save_calls, units) << "SAVE bodies run once per micro-batch";
    EXPECT_EQ(m.remat.replays, units) << "one replay per micro-batch although I and W are split";
    EXPECT_EQ(m.remat.save_skips, units) << "the replay skips every SAVE body";
    EXPECT_EQ(m.remat.early_stops, units) << "early stop is on";
  }
}

TEST(PipelineTrain, EveryRematCounterIsSummedOverRanks) {
  // The save chain without early stop: s1..s3 keep no output (save_output=false), so each unit
  // forward records 3 output leaves and each replay, which runs to the end, hands out 3
  // placeholders; s4 keeps one tensor for its own backward. Both ranks' counts are summed.
  auto c = every_stage_checkpointed(small_config("1f1b", 2, "save-chain", "selective"));
  c.remat.early_stop = false;
  TrainResult r = train_in_process(c, nullptr);
  const int64_t units = c.model.layers * c.schedule.micro_batches;
  for (const auto& m : r.steps) {
    EXPECT_EQ(m.remat.unit_calls, units);
    EXPECT_EQ(m.remat.save_kept, units);
    EXPECT_EQ(m.remat.output_leaves, 3 * units);
    EXPECT_EQ(m.remat.placeholders, 3 * units);
  }
  EXPECT_EQ(r.last.remat.placeholders, 3 * units);
  EXPECT_FALSE(r.last.timeline.empty()) << "the last step keeps its timeline";
  EXPECT_TRUE(r.steps.back().timeline.empty()) << "the history keeps summaries only";
}

TEST(PipelineTrain, TraceShowsNoSlotSharedAcrossMicroBatches) {
  auto c = every_stage_checkpointed(small_config("zb-v", 2, "rmsnorm-gemm", "selective"));
  c.training.steps = 1;
  std::mutex mu;
  std::vector<std::string> lines;
  remat::set_trace_sink([&](const std::string& l) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(l);
  });
  train_in_process(c, nullptr);
  remat::set_trace_sink(nullptr);
  // "rederive: ... as slot #K, ... (checkpoint unit 'layers.N' (step S, stage C, micro-batch I,
  // unit call #J))" and "unpack slot #K of SAVE region '...' (checkpoint unit ... (...), phase".
  std::regex created(
      R"(as slot #(\d+).*\((checkpoint unit '[^']+' \(step \d+, stage \d+, micro-batch \d+, unit call #\d+\))\)$)");
  std::regex unpacked(
      R"(unpack slot #(\d+) .*\((checkpoint unit '[^']+' \(step \d+, stage \d+, micro-batch \d+, unit call #\d+\)), phase)");
  std::set<std::string> slots;
  int creates = 0, unpacks = 0;
  for (const auto& l : lines) {
    std::smatch m;
    if (std::regex_search(l, m, created)) {
      EXPECT_TRUE(slots.insert(m[2].str() + " slot " + m[1].str()).second) << l;
      ++creates;
    }
  }
  for (const auto& l : lines) {
    std::smatch m;
    if (std::regex_search(l, m, unpacked)) {
      EXPECT_TRUE(slots.count(m[2].str() + " slot " + m[1].str())) << "unpack of a slot no "
                                                                      "invocation created: "
                                                                   << l;
      ++unpacks;
    }
  }
  const int expected = c.model.layers * c.schedule.micro_batches;
  EXPECT_EQ(creates, expected);
  // I and W each unpack every slot once, except on the first stage (2 of the 8 layers): its
  // input needs no gradient, so its I is empty and W is its whole backward.
  const int first_stage = 2 * c.schedule.micro_batches;
  EXPECT_EQ(unpacks, 2 * expected - first_stage);
}

TEST(PipelineTrain, ScheduleConstraintsAreClearErrors) {
  auto c = small_config("interleaved", 2, "rmsnorm-gemm", "selective");
  c.schedule.micro_batches = 5;
  try {
    train_in_process(c, nullptr);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("so schedule.micro_batches must"), std::string::npos)
        << e.what();
  }
  auto few = small_config("zb-v", 4, "rmsnorm-gemm", "selective");
  few.model.layers = 6;  // zb-v on 4 ranks has 8 stages
  try {
    train_in_process(few, nullptr);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the model has 6 layers but the schedule has 8 stages"),
              std::string::npos)
        << e.what();
  }
}

TEST(PipelineTrain, ProgressAndMetricsLines) {
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "selective");
  c.output.progress = true;
  std::ostringstream out;
  TrainResult r = train_in_process(c, &out);
  const std::string text = out.str();
  EXPECT_NE(text.find("step 1/2  loss "), std::string::npos) << text;
  EXPECT_NE(text.find("step 2/2  loss "), std::string::npos) << text;
  EXPECT_NE(text.find(" bubble "), std::string::npos) << text;
  const std::string json = metrics_json(r.steps[0]);
  for (const char* key :
       {"\"step\":0", "\"loss\":", "\"step_ms\":", "\"bubble\":", "\"peak_bytes\":"}) {
    EXPECT_NE(json.find(key), std::string::npos) << json;
  }
  EXPECT_GE(r.steps[0].bubble, 0.0);
  EXPECT_LT(r.steps[0].bubble, 1.0);
}

// Note [Threads are measured, not assumed]: more than 1 thread asked is measured against 1 thread
// on the run's own micro-batch first; the first progress line gives both times and what runs.
TEST(PipelineTrain, ThreadsAboveOneAreMeasuredAgainstOneThreadFirst) {
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "none");
  c.output.progress = true;
  c.training.threads = 2;
  std::ostringstream out;
  ASSERT_EQ(run_train(c, /*reference=*/true, out, out), 0) << out.str();
  const std::regex line(
      "compute: 1 rank on cpu in fp32, ([12]) threads? per rank \\(training.threads; 2 asked, "
      "measured "
      "first: one "
      "micro-batch's forward and backward took ([0-9.]+) ms on 1 thread and ([0-9.]+) ms on 2 "
      "\\(medians of 3 rounds, OMP_WAIT_POLICY [^)]+\\), the faster kept\\), LibTorch ");
  std::smatch m;
  const std::string text = out.str();
  ASSERT_TRUE(std::regex_search(text, m, line)) << text;
  const pp::ComputeInfo info = pp::compute_info();
  ASSERT_TRUE(info.choice.has_value());
  const pp::ThreadChoice& choice = *info.choice;
  EXPECT_EQ(choice.threads, choice.asked_ms <= choice.one_ms ? 2 : 1);
  EXPECT_EQ(info.threads, choice.threads);
  EXPECT_EQ(std::stoi(m[1]), choice.threads) << text;
  EXPECT_EQ(m[2], format_fixed(choice.one_ms, 1)) << text;
  EXPECT_EQ(m[3], format_fixed(choice.asked_ms, 1)) << text;

  // training.thread_probe false: the threads as asked, unmeasured.
  c.training.thread_probe = false;
  std::ostringstream asked;
  ASSERT_EQ(run_train(c, /*reference=*/true, asked, asked), 0) << asked.str();
  EXPECT_NE(asked.str().find(
                "compute: 1 rank on cpu in fp32, 2 threads per rank (training.threads), LibTorch "),
            std::string::npos)
      << asked.str();
  pp::set_compute_threads(1);
}

}  // namespace
}  // namespace pipemat::train

namespace pipemat::train {
namespace {

// Output files create their parent directories, with or without checkpoints, for the pipeline
// and the reference alike; a path whose parent cannot be made is a ConfigError naming the key.
TEST(PipelineTrain, OutputFilesCreateTheirParentDirectories) {
  const std::string root = ::testing::TempDir() + "pipemat_outputs_" + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "selective");
  c.training.steps = 1;
  c.transport.kind = comm::TransportKind::kLocal;
  c.checkpoint.dir = "";
  c.output.metrics = root + "/pipeline/deeper/metrics.jsonl";
  c.output.timeline_svg = root + "/pipeline/timeline.svg";
  std::ostringstream out;
  EXPECT_EQ(run_train(c, false, out, out), 0) << out.str();
  EXPECT_TRUE(std::filesystem::exists(c.output.metrics));
  EXPECT_TRUE(std::filesystem::exists(c.output.timeline_svg));
  c.output.timeline_svg = "";
  c.output.metrics = root + "/reference/metrics.jsonl";
  EXPECT_EQ(run_train(c, true, out, out), 0) << out.str();
  EXPECT_TRUE(std::filesystem::exists(c.output.metrics));
  c.output.metrics = "/proc/nonexistent/metrics.jsonl";
  try {
    run_train(c, true, out, out);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(
        std::string(e.what()).find("output.metrics: cannot create the directory "
                                   "'/proc/nonexistent' of '/proc/nonexistent/metrics.jsonl'"),
        std::string::npos)
        << e.what();
  }
  // After training: an output file that cannot be written is an end-of-run failure (exit code
  // 4), the training result stands.
  c.output.metrics = "";
  c.output.loss_svg = "/proc/nonexistent/loss.svg";
  std::ostringstream err;
  EXPECT_EQ(run_train(c, false, out, err), 4);
  EXPECT_NE(err.str().find("pipemat: error: an output file failed after the run's last step "
                           "(step 1 of 1): output.loss_svg: cannot create the directory"),
            std::string::npos)
      << err.str();
  std::filesystem::remove_all(root);
}

TEST(PipelineTrain, ScheduleFromATorchCsvFileMatchesTheReference) {
  // A ZB-H1 schedule exported as torch writes it, with FSDP cells, read through schedule.csv.
  schedule::ScheduleOptions so;
  so.kind = schedule::ScheduleKind::kZeroBubbleH1;
  so.ranks = 2;
  so.micro_batches = 4;
  const std::string csv = schedule::export_torch_csv(schedule::generate_schedule(so));
  const std::string path = ::testing::TempDir() + "pipemat_zb_h1.csv";
  {
    std::ofstream out(path);
    out << "0UNSHARD," << csv.substr(0, csv.find('\n')) << ",0REDUCE_GRAD\n"
        << "1UNSHARD," << csv.substr(csv.find('\n') + 1);
  }
  auto c = small_config("1f1b", 2, "rmsnorm-gemm", "selective");
  c.schedule.micro_batches = 1;  // replaced by the file's
  c.schedule_csv = path;
  const ResolvedSchedule resolved = resolve_schedule(c);
  EXPECT_EQ(resolved.config.schedule.kind, schedule::ScheduleKind::kImported);
  EXPECT_EQ(resolved.config.schedule.micro_batches, 4);
  EXPECT_EQ(resolved.note, "ignored 2 UNSHARD and 1 REDUCE_GRAD cells of " + path +
                               ": pipemat does not shard, and all-reduces a stage's gradients "
                               "after its last backward by itself (parallel.data), so they are "
                               "no-ops");
  expect_matches_reference(c);
  std::ostringstream out;
  c.training.steps = 1;
  c.output.progress = true;
  c.transport.kind = comm::TransportKind::kLocal;
  EXPECT_EQ(run_train(c, false, out, out), 0);
  EXPECT_EQ(out.str().find(resolved.note), 0u) << out.str();
  // The same file for each of 2 replicas (Note [Data x pipeline]).
  c.output.progress = false;
  c.training.steps = 2;
  c.parallel.data = 2;
  expect_matches_reference(c);

  c.schedule_csv = "/nonexistent/s.csv";
  try {
    resolve_schedule(c);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("schedule.csv: cannot open '/nonexistent/s.csv'"),
              std::string::npos)
        << e.what();
  }
}

// Balanced by parameter count: [20, 20, 20, 80] on 2 stages is 60 | 80 (the greedy split stops
// before a layer would take the first stage past half of the 140 parameters); an explicit
// partition is taken as is; what does not fit is a ConfigError that says why.
TEST(PartitionLayers, BalancedByParametersOrExplicit) {
  std::vector<torch::nn::AnyModule> layers;
  for (int i = 0; i < 3; ++i) layers.emplace_back(torch::nn::Linear(4, 4));  // 16 + 4
  layers.emplace_back(torch::nn::Linear(4, 16));                             // 64 + 16
  EXPECT_EQ(models::partition_layers(layers, {}, 2), (std::vector<int64_t>{0, 3, 4}));
  EXPECT_EQ(models::partition_layers(layers, {}, 4), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(models::partition_layers(layers, {}, 1), (std::vector<int64_t>{0, 4}));
  models::PartitionOptions explicit_split;
  explicit_split.layers_per_stage = {1, 3};
  EXPECT_EQ(models::partition_layers(layers, explicit_split, 2), (std::vector<int64_t>{0, 1, 4}));
  auto message = [&](const models::PartitionOptions& p, int stages) {
    try {
      models::partition_layers(layers, p, stages);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({}, 5),
            "the model has 4 layers but the schedule has 5 stages; every stage needs at least one "
            "layer (raise model.layers or lower schedule.ranks / schedule.virtual_stages)");
  EXPECT_EQ(message(explicit_split, 3),
            "partition.layers_per_stage has 2 entries but the schedule has 3 stages");
  explicit_split.layers_per_stage = {1, 2};
  EXPECT_EQ(message(explicit_split, 2),
            "partition.layers_per_stage sums to 3 but model.layers is 4");
  // Entries that would overflow the running sum, or leave a stage empty, name the entry.
  explicit_split.layers_per_stage = {std::numeric_limits<int64_t>::max(), 1};
  EXPECT_EQ(message(explicit_split, 2),
            "partition.layers_per_stage[0] is 9223372036854775807; expected 1 to 4 (every stage "
            "holds at least one of the model's 4 layers, and the entries sum to model.layers)");
  explicit_split.layers_per_stage = {3, 0, 1};
  EXPECT_EQ(message(explicit_split, 3),
            "partition.layers_per_stage[1] is 0; expected 1 to 1 (every stage holds at least one "
            "of the model's 4 layers, and the entries sum to model.layers)");
}

// The summary's device memory: each rank's most over the steps, and nothing from CPU steps.
TEST(RunTotals, DevicePeaksAreEachRanksMostOverTheSteps) {
  RunTotals totals;
  StepMetrics cpu;
  cpu.rank_device_peak_bytes = {0, 0};
  totals.add(cpu);
  EXPECT_TRUE(totals.rank_device_peak_bytes.empty());
  StepMetrics a, b;
  a.rank_device_peak_bytes = {5 << 20, 7 << 20};
  b.rank_device_peak_bytes = {6 << 20, 3 << 20};
  totals.add(a);
  totals.add(b);
  EXPECT_EQ(totals.rank_device_peak_bytes, (std::vector<int64_t>{6 << 20, 7 << 20}));
  RunTotals one;  // a rank without the others' figures: its own
  StepMetrics own;
  own.device_peak_bytes = 9;
  one.add(own);
  EXPECT_EQ(one.rank_device_peak_bytes, (std::vector<int64_t>{9}));
}

}  // namespace
}  // namespace pipemat::train
