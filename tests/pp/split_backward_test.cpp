// Split backward (Note [Split backward]): I then W equals the fused backward, computes each
// parameter gradient once, and works for any module of the zoo, with and without remat.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "pipemat/models/zoo_stages.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/remat.h"
#include "split_backward.h"  // private: pp/src

namespace pipemat::pp {
namespace {

using models::build_layers;
using models::micro_batch_data;
using models::micro_batch_loss;
using models::ModelOptions;
using models::RematConfig;
using models::Stage;
using models::stage_policy;

struct Case {
  std::string kind;
  std::string policy;
};

class SplitBackwardEquality : public ::testing::TestWithParam<Case> {};

TEST_P(SplitBackwardEquality, InputThenWeightEqualsFusedBackward) {
  const Case c = GetParam();
  ModelOptions m;
  m.kind = models::parse_model_kind(c.kind).value();
  m.layers = 2;
  m.hidden = 16;
  m.tokens = 8;
  m.heads = 2;
  RematConfig rc;
  rc.policy = models::parse_remat_policy(c.policy).value();
  // parts: 0 the fused backward, 1 I then W, 2 I then W one parameter at a time, last first
  // (Note [Weight tail]): each part computes its parameter's gradient and no other.
  auto run = [&](int parts, std::vector<at::Tensor>* grads) {
    Stage stage(build_layers(m, 3));
    auto policy = stage_policy(m, rc);
    if (!policy.checkpoint.empty()) remat::apply_policy(*stage, policy);
    auto params = stage->parameters();
    auto [in, target] = micro_batch_data(m, 3, 0, 0);
    auto x = in.requires_grad_(true);
    std::shared_ptr<remat::InvocationGroup> group;
    at::Tensor loss;
    {
      remat::InvocationScope scope({0, 0, 0});
      loss = micro_batch_loss(stage->forward(x), target, 1);
      group = scope.group();
    }
    at::Tensor dx;
    if (parts > 0) {
      group->retain();
      SplitBackward sb({gradient_edge(loss)}, {x}, params);
      dx = sb.run_input({at::ones_like(loss)}).at(0);
      for (const auto& p : params) EXPECT_FALSE(p.grad().defined()) << "I computed a dW";
      if (parts == 1) {
        sb.run_weight();
      } else {
        for (size_t i = params.size(); i-- > 0;) {
          sb.run_weight(i, i + 1, /*last=*/i == 0);
          for (size_t j = 0; j < i; ++j)
            EXPECT_FALSE(params[j].grad().defined()) << "part " << i << " computed dW " << j;
        }
      }
    } else {
      loss.backward();
      dx = x.grad();
    }
    group->release();
    grads->push_back(dx);
    for (const auto& p : params) grads->push_back(p.grad());
  };
  std::vector<at::Tensor> fused;
  run(0, &fused);
  for (int parts : {1, 2}) {
    std::vector<at::Tensor> split;
    run(parts, &split);
    ASSERT_EQ(fused.size(), split.size());
    for (size_t i = 0; i < fused.size(); ++i) {
      ASSERT_TRUE(split[i].defined()) << "gradient " << i << " missing (parts " << parts << ")";
      EXPECT_TRUE(at::equal(fused[i], split[i]))
          << c.kind << "/" << c.policy << " gradient " << i << " (parts " << parts << ") max diff "
          << (fused[i] - split[i]).abs().max().item<double>();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zoo, SplitBackwardEquality,
                         ::testing::Values(Case{"rmsnorm-gemm", "none"},
                                           Case{"rmsnorm-gemm", "selective"}, Case{"mlp", "none"},
                                           Case{"mlp", "full"}, Case{"transformer", "none"},
                                           Case{"transformer", "selective"},
                                           Case{"moe", "selective"},
                                           Case{"save-chain", "selective"}),
                         [](const ::testing::TestParamInfo<Case>& test) {
                           std::string name = test.param.kind + "_" + test.param.policy;
                           for (auto& ch : name) {
                             if (ch == '-') ch = '_';
                           }
                           return name;
                         });

TEST(SplitBackwardMemory, RederivedGemmInputLivesOnlyFromRToW) {
  remat::install_tracking_allocator();
  ModelOptions m;
  m.kind = models::ModelKind::kRmsNormGemm;
  m.layers = 3;
  m.hidden = 32;
  m.tokens = 16;
  const int64_t act = m.tokens * m.hidden * 4;  // one [tokens, hidden] float32 activation
  Stage stage(build_layers(m, 5));
  RematConfig rc;
  rc.policy = models::RematPolicyKind::kSelective;
  remat::apply_policy(*stage, stage_policy(m, rc));
  auto params = stage->parameters();
  int64_t param_bytes = 0;
  for (const auto& p : params) param_bytes += p.numel() * 4;
  auto [in, target] = micro_batch_data(m, 5, 0, 0);
  auto x = in.requires_grad_(true);
  const int64_t baseline = remat::memory_stats().current_bytes;
  std::shared_ptr<remat::InvocationGroup> group;
  at::Tensor dx;
  {
    at::Tensor loss;
    {
      remat::InvocationScope scope({0, 1, 0});
      loss = micro_batch_loss(stage->forward(x), target, 1);
      group = scope.group();
    }
    auto after_forward = group->report();
    EXPECT_EQ(after_forward.rederived_slots, m.layers);
    EXPECT_EQ(after_forward.rederived_bytes, m.layers * act) << "the GEMM inputs are not kept";
    EXPECT_EQ(after_forward.replayed_bytes, 0) << "nothing regenerated before R";

    group->pretrigger();  // R
    auto after_r = group->report();
    EXPECT_GE(after_r.replayed_bytes, m.layers * act) << "R regenerated the GEMM inputs";

    SplitBackward split({gradient_edge(loss)}, {x}, params);
    dx = split.run_input({at::ones_like(loss)}).at(0);  // I
    // I releases what only the dx chain needed; W's inputs stay: per layer the GEMM's input and
    // the norm's x * rsqrt (its weight's gradient), and two [tokens, 1] floats.
    EXPECT_EQ(group->report().replayed_bytes, m.layers * (2 * act + 2 * m.tokens * 4))
        << "after R: " << after_r.replayed_bytes;
    split.run_weight();  // W
    group->release();
    EXPECT_EQ(group->report().replayed_bytes, 0);
  }
  // Everything of the micro-batch is gone: only the parameter gradients and dx remain.
  EXPECT_EQ(remat::memory_stats().current_bytes - baseline, param_bytes + act);
}

}  // namespace
}  // namespace pipemat::pp
