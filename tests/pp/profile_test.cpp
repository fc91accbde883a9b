// The remat profiler: candidates generated from the module tree and their measured bytes.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <limits>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"
#include "pipemat/plan/split.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/pp/profile.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::pp {
namespace {

constexpr int64_t kTokens = 8, kHidden = 16, kFfn = 32;

torch::nn::AnyModule mlp_block() { return torch::nn::AnyModule(models::MlpBlock(kHidden, kFfn)); }

std::vector<std::string> names(const LayerCandidates& c) {
  std::vector<std::string> out;
  for (const auto& k : c.profile.candidates) out.push_back(k.name);
  return out;
}

TEST(Profile, CandidatesComeFromTheModuleTree) {
  at::manual_seed(3);
  const LayerCandidates c = profile_layer("layers.*", mlp_block, at::randn({kTokens, kHidden}));
  EXPECT_EQ(c.save_leaves, (std::vector<std::string>{"norm", "up", "down"}));
  EXPECT_EQ(names(c), (std::vector<std::string>{"none", "full", "save:norm", "save:up",
                                                "save:norm+up", "save:down", "save:norm+down",
                                                "save:up+down", "save:norm+up+down"}));
  // x + down(silu(up(norm(x)))) on [8, 16] float32, ffn 32. "full" keeps only its output
  // (512 B; the input is the caller's) and its replay rebuilds exactly what "none" keeps.
  const auto& k = c.profile.candidates;
  const double output = kTokens * kHidden * 4;
  EXPECT_EQ(k[0].replayed_bytes, 0);
  EXPECT_EQ(k[0].recompute, 0);
  EXPECT_EQ(k[1].resident_bytes, output);
  EXPECT_EQ(k[1].resident_bytes + k[1].replayed_bytes, k[0].resident_bytes);
  // "none" keeps what autograd saves, one count per storage, and the output: the rsqrt's
  // [8, 1]; x * rsqrt and the normalized x [8, 16] (saved by the weight multiply and by up's
  // GEMM); up's and silu's outputs [8, 32] (saved by silu and by down's GEMM); the output.
  EXPECT_EQ(k[0].resident_bytes,
            kTokens * 4 + 2 * kTokens * kHidden * 4 + 2 * kTokens * kFfn * 4 + output);
  EXPECT_EQ(k[0].resident_bytes, 3616);
  for (size_t i = 2; i < k.size(); ++i) {
    // A SAVE region moves bytes from the replay to the resident set. The outputs of norm and up
    // are saved by the next op anyway; down's output is not (the residual add saves nothing),
    // so caching it adds its 512 B.
    const bool down = k[i].name.find("down") != std::string::npos;
    EXPECT_EQ(k[i].resident_bytes + k[i].replayed_bytes, k[0].resident_bytes + (down ? output : 0))
        << k[i].name;
    EXPECT_GT(k[i].replayed_bytes, 0) << k[i].name;
    EXPECT_GT(k[i].recompute, 0) << k[i].name;
  }
  // "save:up" caches up's output [8, 32]: 1024 B more resident, 1024 B less replayed.
  EXPECT_EQ(k[3].name, "save:up");
  EXPECT_EQ(k[3].resident_bytes, output + kTokens * kFfn * 4);
  EXPECT_EQ(k[3].replayed_bytes, k[1].replayed_bytes - kTokens * kFfn * 4);
  // Temporaries: remat changes what F keeps, not what the backward allocates; a candidate's F
  // peaks no higher than none's (it keeps less while it runs), and the replay keeps all it
  // allocates.
  for (const auto& x : k) {
    EXPECT_EQ(x.backward_temporary_bytes, k[0].backward_temporary_bytes) << x.name;
    EXPECT_LE(x.resident_bytes + x.forward_temporary_bytes,
              k[0].resident_bytes + k[0].forward_temporary_bytes)
        << x.name;
    EXPECT_EQ(x.recompute_temporary_bytes, 0) << x.name;
  }
  EXPECT_LT(k[1].resident_bytes + k[1].forward_temporary_bytes,
            k[0].resident_bytes + k[0].forward_temporary_bytes);
  EXPECT_GT(k[0].backward_temporary_bytes, 0);
}

// Note [Mixed precision]: profiled in bf16, a layer's bytes are those of its bf16 run. The
// layer x + down(silu(up(norm(x)))) under autocast: the RMSNorm's ops are not autocast's, so
// "none" keeps the rsqrt's [8, 1] and x * rsqrt [8, 16] in float32 (saved by the weight
// multiply); up's GEMM saves autocast's bf16 cast of the normalized x [8, 16], not the float32
// tensor itself, which is freed; then the bf16 casts of up's [32, 16] and down's [16, 32]
// weights, up's and silu's outputs [8, 32] in bf16, and the output [8, 16] (float32 x plus bf16
// down(...): float32). 4384 B against float32's 3616.
TEST(Profile, GivenSaveSetsAreTheOnlySelectiveCandidates) {
  at::manual_seed(3);
  ProfileOptions options;
  options.save_sets = {{"up"}, {"norm", "down"}};
  const LayerCandidates c =
      profile_layer("layers.*", mlp_block, at::randn({kTokens, kHidden}), options);
  EXPECT_EQ(names(c), (std::vector<std::string>{"none", "full", "save:up", "save:norm+down"}));
  EXPECT_EQ(c.save_leaves, (std::vector<std::string>{"down", "norm", "up"}));
  options.save_sets = {{"gate"}};
  try {
    profile_layer("layers.*", mlp_block, at::randn({kTokens, kHidden}), options);
    ADD_FAILURE() << "a leaf the layer does not have";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'gate' is not a SAVE leaf of layers.*; its leaves: "
                                         "norm, up, down"),
              std::string::npos)
        << e.what();
  }
}

TEST(Profile, Bf16BytesAreThoseOfTheBf16Run) {
  at::manual_seed(3);
  ProfileOptions bf16;
  bf16.precision = Precision::kBFloat16;
  const LayerCandidates c =
      profile_layer("layers.*", mlp_block, at::randn({kTokens, kHidden}), bf16);
  const auto& none = c.profile.candidates[0];
  EXPECT_EQ(none.resident_bytes, kTokens * 4 + kTokens * kHidden * 4 + kTokens * kHidden * 2 +
                                     2 * kFfn * kHidden * 2 + 2 * kTokens * kFfn * 2 +
                                     kTokens * kHidden * 4);
  EXPECT_EQ(none.resident_bytes, 4384);
  EXPECT_EQ(c.profile.candidates[1].resident_bytes, kTokens * kHidden * 4) << "full: the output";
}

TEST(Profile, StagePolicyNamesEachLayerByItsIndex) {
  at::manual_seed(3);
  const LayerCandidates c =
      profile_layer("layers.*", mlp_block, at::randn({kTokens, kHidden}), {1, 6});
  const remat::RematPolicy p = stage_policy_of({&c, &c, &c}, {0, 1, 4}, "layers.");
  EXPECT_EQ(p.checkpoint, (std::vector<std::string>{"layers.1", "layers.2"}));
  ASSERT_EQ(p.exclude.size(), 2u);
  EXPECT_EQ(p.exclude[0].path, "layers.2.norm");
  EXPECT_EQ(p.exclude[1].path, "layers.2.up");
}

// A stage of two Linear(16, 16, no bias) on [8, 16]: the input (512 B) is held on its own; the
// graph keeps the first Linear's output (512 B, saved by the second for its weight gradient); the
// stage's output is sent and freed.
TEST(Profile, StageBytesAreItsInputAndWhatItsGraphSaved) {
  auto seq = torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)),
                                   torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)));
  PipelineStage stage;
  stage.index = 0;
  stage.module = seq.ptr();
  stage.forward = [seq](const Tensors& in) mutable { return Tensors{seq->forward(in.at(0))}; };
  const at::Tensor x = at::randn({8, 16});
  const StageProfile p = profile_stage(stage, {x}, nullptr, {}, 2);
  EXPECT_EQ(p.input_bytes, 512);
  EXPECT_EQ(p.resident_bytes, 512);
  ASSERT_EQ(p.outputs.size(), 1u);
  EXPECT_TRUE(at::equal(p.outputs[0], seq->forward(x)));
  EXPECT_FALSE(p.outputs[0].requires_grad());
  // F: the first Linear's output and the stage's output. B, into the gradients a first backward
  // left: the gradient of that output (512) and a new W2 gradient (1024) before it is added in.
  // I: the gradients of the first Linear's output and of the input (512 each), of which the
  // first stays for W; W: a new weight gradient (1024) and a transposed operand (512).
  EXPECT_EQ(p.forward_peak_bytes, 1024);
  EXPECT_EQ(p.backward_peak_bytes, 1536);
  EXPECT_EQ(p.input_peak_bytes, 1024);
  EXPECT_EQ(p.input_held_bytes, 512);
  EXPECT_EQ(p.weight_peak_bytes, 1536);
  EXPECT_EQ(p.output_gradient_bytes, 512);  // the gradient of the [8, 16] output
  // The step's first B makes the weight gradients (1024 each): at its peak both and the gradient
  // of the first Linear's output (512).
  EXPECT_EQ(p.first_backward_peak_bytes, 2560);
  EXPECT_GT(p.forward, 0);
  EXPECT_GT(p.backward, 0);
  EXPECT_GT(p.backward_input, 0);
  EXPECT_GT(p.backward_weight, 0);
}

// A parameter-free entry whose compute is heavy: the head of a large vocabulary in miniature
// (a parameter count calls it free).
struct HeavyImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x;
    for (int k = 0; k < 40; ++k) y = at::tanh(at::matmul(y, y.transpose(0, 1)).matmul(y) * 1e-3);
    return y + x;
  }
};
TORCH_MODULE(Heavy);

// Note [Split by cost]: balance_by_cost profiles each entry and returns plan::choose_split's
// split of those costs (every contiguous split of them simulated here gives no shorter step);
// the parameter split leaves the heavy entry with more entries on its stage.
TEST(BalanceByCost, TheSplitIsTheShortestOfItsMeasuredCosts) {
  at::manual_seed(5);
  torch::nn::Sequential model;
  for (int i = 0; i < 7; ++i) model->push_back(torch::nn::Linear(64, 64));
  model->push_back(Heavy());
  schedule::ScheduleOptions schedule;
  schedule.kind = schedule::ScheduleKind::kOneFOneB;
  schedule.ranks = 2;
  schedule.micro_batches = 4;
  MicroBatch sample{{at::randn({64, 64})}, {at::randn({64, 64})}};
  const LossFn loss = [](const Tensors& out, const Tensors& targets) {
    return (out[0] - targets[0]).pow(2).mean();
  };
  const CostBalance b = balance_by_cost(model, schedule, sample, loss, 3, 1);
  ASSERT_EQ(b.entries.size(), 8u);
  EXPECT_EQ(b.entries[0].layer, "0");
  EXPECT_EQ(b.entries[7].layer, "7");
  EXPECT_EQ(b.entries[7].fixed_bytes, 0.0);
  EXPECT_EQ(b.entries[0].fixed_bytes, 16.0 * (64 * 64 + 64));
  // The heavy entry costs more than all the Linear layers together.
  double linear = 0;
  for (int i = 0; i < 7; ++i) linear += b.entries[static_cast<size_t>(i)].cost.forward;
  EXPECT_GT(b.entries[7].cost.forward, linear);
  // The parameter split: 4 Linear entries on stage 0, 3 and the heavy one on stage 1.
  EXPECT_EQ(b.parameter_bounds, (std::vector<int64_t>{0, 4, 8}));
  // By cost the heavy entry's stage holds fewer entries, and no split of these costs is faster.
  ASSERT_EQ(b.bounds.size(), 3u);
  EXPECT_GT(b.bounds[1], 4);
  plan::SplitProblem problem;
  problem.schedule = schedule;
  problem.layers = b.entries;
  double best = std::numeric_limits<double>::infinity();
  for (int first = 1; first < 8; ++first) {
    best = std::min(best, plan::evaluate_split(problem, {first, 8 - first}).step);
  }
  EXPECT_EQ(b.step_ms, best);
  EXPECT_EQ(b.step_ms, plan::evaluate_split(problem, {static_cast<int>(b.bounds[1]),
                                                      static_cast<int>(8 - b.bounds[1])})
                           .step);
  EXPECT_EQ(b.parameter_step_ms, plan::evaluate_split(problem, {4, 4}).step);
  EXPECT_LT(b.step_ms, b.parameter_step_ms);
}

TEST(BalanceByCost, TooFewEntriesAndAFailingProfileAreConfigErrors) {
  torch::nn::Sequential two(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  schedule::ScheduleOptions schedule;
  schedule.kind = schedule::ScheduleKind::kOneFOneB;
  schedule.ranks = 4;
  schedule.micro_batches = 4;
  MicroBatch sample{{at::randn({2, 4})}, {at::randn({2, 4})}};
  const LossFn loss = [](const Tensors& out, const Tensors& t) {
    return (out[0] - t[0]).pow(2).mean();
  };
  try {
    balance_by_cost(two, schedule, sample, loss);
    ADD_FAILURE() << "2 entries on 4 stages";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("2 entries but the schedule has 4 stages"),
              std::string::npos)
        << e.what();
  }
  schedule.ranks = 2;
  MicroBatch wrong{{at::randn({2, 5})}, {at::randn({2, 4})}};  // 5 features into Linear(4, 4)
  try {
    balance_by_cost(two, schedule, wrong, loss);
    ADD_FAILURE() << "a profile on a wrong input";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("profiling entry 0 ('0') failed"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pipemat::pp
