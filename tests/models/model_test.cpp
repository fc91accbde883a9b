// The model zoo's own modules: counter-based dropout and the GPT's causal attention.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cmath>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/dropout.h"
#include "pipemat/models/gpt.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/remat/remat.h"

namespace pipemat::models {
namespace {

// Note [Counter-based dropout]: the mask keeps 1 - p, scales the kept by 1 / (1 - p), is a
// function of one generator draw (so the same generator state gives the same mask and the
// generator moves by exactly one draw), and the gradient is the same noise.
TEST(CounterDropout, OneDrawGivesTheMaskAndTheGradient) {
  at::manual_seed(7);
  const at::Tensor x = at::ones({1000, 1000}).requires_grad_();
  const at::Tensor y = counter_dropout(x, 0.25, true);
  const at::Tensor kept = y.ne(0);
  EXPECT_NEAR(kept.to(at::kDouble).mean().item<double>(), 0.75, 0.002);
  EXPECT_TRUE(y.masked_select(kept).eq(static_cast<float>(1.0 / 0.75)).all().item<bool>());
  EXPECT_FALSE(kept[0].equal(kept[1]));  // not one mask per row
  y.sum().backward();
  EXPECT_TRUE(x.grad().equal(y.detach()));

  const int64_t after_one_call = at::empty({}, at::kLong).random_().item<int64_t>();
  at::manual_seed(7);
  EXPECT_TRUE(counter_dropout(x, 0.25, true).equal(y));
  at::manual_seed(7);
  at::empty({}, at::kLong).random_();
  EXPECT_EQ(at::empty({}, at::kLong).random_().item<int64_t>(), after_one_call);
  EXPECT_FALSE(counter_dropout(x, 0.25, true).equal(y));  // the next draw, the next mask

  EXPECT_TRUE(counter_dropout(x, 0.25, false).is_same(x));
  EXPECT_TRUE(counter_dropout(x, 0.0, true).is_same(x));
  CounterDropout module(0.25);
  module->eval();
  EXPECT_TRUE(module(x).is_same(x));
  EXPECT_THROW(counter_dropout(x, 1.0, true), ConfigError);
  EXPECT_THROW(CounterDropout(-0.1), ConfigError);
}

// The attention tests' shape: hidden 32 in 4 heads.
GptShape attention_shape() {
  GptShape shape;
  shape.hidden = 32;
  shape.heads = 4;
  return shape;
}

// Under CPU autocast to bf16 the attention's kernel runs in float32 on the bf16 q, k, v (its
// output back in bf16), and the thread's autocast state is as it was afterwards.
TEST(Gpt, AttentionUnderAutocastRunsInFloat32) {
  const GptShape shape = attention_shape();
  at::manual_seed(3);
  CausalSelfAttention attn(shape);
  const int64_t b = 2, t = 9, h = shape.hidden, d = h / shape.heads;
  const at::Tensor x = at::randn({b, t, h});
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::increment_nesting();
  const at::Tensor fused = attn->forward(x);
  EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
  const at::Tensor q_k_v =
      attn->qkv->forward(x).view({b, t, 3, shape.heads, d}).permute({2, 0, 3, 1, 4});
  ASSERT_EQ(q_k_v.scalar_type(), at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  const at::Tensor context =
      at::scaled_dot_product_attention(q_k_v[0].to(at::kFloat), q_k_v[1].to(at::kFloat),
                                       q_k_v[2].to(at::kFloat), {}, 0.0, true)
          .to(at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const at::Tensor plain = attn->proj->forward(context.transpose(1, 2).reshape({b, t, h}));
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCPU, false);
  EXPECT_EQ(fused.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(fused, plain));
}

// The selective policy (blocks checkpoint units, attn.qkv and mlp.up SAVE regions) rederives the
// layer-normed input of both SAVE GEMMs in either precision: in float32 the input itself, under
// autocast to bf16 the 2-d view of its bf16 cast that the GEMM on [B, T, H] saves (Note
// [Rederived casts]), at half the bytes; gradients as without remat, bitwise.
TEST(Gpt, SelectiveRederivesTheLayerNormedInputsInBothPrecisions) {
  GptShape shape = attention_shape();
  shape.layers = 2;
  shape.seq_len = 8;
  const int64_t b = 2, t = shape.seq_len, h = shape.hidden;
  ModelOptions model;
  model.kind = ModelKind::kGpt;
  RematConfig selective;
  selective.policy = RematPolicyKind::kSelective;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "float32");
    const auto run = [&](bool remat, remat::RematReport* report) {
      GptStage stage(build_gpt(shape, 5), 0, shape.layers, false, false);
      if (remat) remat::apply_policy(*stage, stage_policy(model, selective));
      at::manual_seed(4);
      const at::Tensor x = at::randn({b, t, h}).requires_grad_();
      at::Tensor out;
      std::shared_ptr<remat::InvocationGroup> group;
      {
        remat::InvocationScope scope({0, 0, 0});
        if (bf16) {
          at::autocast::set_autocast_enabled(at::kCPU, true);
          at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
          at::autocast::increment_nesting();
        }
        out = stage->forward(x).to(at::kFloat);
        if (bf16) {
          if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
          at::autocast::set_autocast_enabled(at::kCPU, false);
        }
        group = scope.group();
      }
      if (report != nullptr) *report = group->report();
      (out * at::linspace(-1, 1, out.numel()).reshape(out.sizes())).sum().backward();
      std::vector<at::Tensor> grads{x.grad()};
      for (const auto& p : stage->parameters()) grads.push_back(p.grad());
      return grads;
    };
    remat::RematReport report;
    const std::vector<at::Tensor> with = run(true, &report), without = run(false, nullptr);
    ASSERT_EQ(with.size(), without.size());
    for (size_t i = 0; i < with.size(); ++i) EXPECT_TRUE(at::equal(with[i], without[i])) << i;
    EXPECT_EQ(report.fallback_total(), 0) << report.str();
    EXPECT_EQ(report.rederived_slots, shape.layers * 2) << report.str();
    EXPECT_EQ(report.rederived_bytes, shape.layers * 2 * b * t * h * (bf16 ? 2 : 4))
        << report.str();
  }
}

// A bf16 input (autocast's output) gets the float32 call's mask from the same draw, the scale
// rounded to bf16, and the result stays bf16 (no at::dropout, which draws every element).
TEST(CounterDropout, Bf16TakesTheSameMaskFromOneDraw) {
  const at::Tensor x = at::ones({300, 300});
  at::manual_seed(11);
  const at::Tensor y32 = counter_dropout(x, 0.25, true);
  const int64_t after = at::empty({}, at::kLong).random_().item<int64_t>();
  at::manual_seed(11);
  const at::Tensor y16 = counter_dropout(x.to(at::kBFloat16), 0.25, true);
  EXPECT_EQ(at::empty({}, at::kLong).random_().item<int64_t>(), after) << "one draw";
  EXPECT_EQ(y16.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(y16.ne(0).equal(y32.ne(0)));
  EXPECT_TRUE(y16.to(at::kFloat).equal(y32.to(at::kBFloat16).to(at::kFloat)));
}

// The attention's fused kernel computes softmax(q k^T / sqrt(d) with the future masked) v: its
// output and the gradients of x and of both projections equal the explicit formula's.
TEST(Gpt, AttentionIsCausal) {
  const GptShape shape = attention_shape();
  at::manual_seed(3);
  CausalSelfAttention attn(shape);
  const int64_t b = 2, t = 9, h = shape.hidden, d = h / shape.heads;
  const at::Tensor x = at::randn({b, t, h}).requires_grad_(true);
  const at::Tensor fused = attn->forward(x);
  const at::Tensor x2 = x.detach().clone().requires_grad_(true);
  const at::Tensor q_k_v =
      attn->qkv->forward(x2).view({b, t, 3, shape.heads, d}).permute({2, 0, 3, 1, 4});
  const at::Tensor scores = at::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(d * 1.0);
  const at::Tensor future = at::ones({t, t}, at::kBool).triu(1);
  const at::Tensor probs = at::softmax(scores.masked_fill(future, -INFINITY), -1);
  const at::Tensor plain =
      attn->proj->forward(at::matmul(probs, q_k_v[2]).transpose(1, 2).reshape({b, t, h}));
  EXPECT_TRUE(at::allclose(fused, plain, 1e-5, 1e-6)) << (fused - plain).abs().max();
  // Token 0 sees only itself: changing a later token leaves its output as it was.
  const at::Tensor changed = x.detach().clone();
  changed.select(1, t - 1).add_(1.0);
  EXPECT_TRUE(at::equal(attn->forward(changed).select(1, 0), fused.detach().select(1, 0)));

  const at::Tensor w = at::randn({b, t, h});
  auto grads = [&](const at::Tensor& out, const at::Tensor& input) {
    for (auto& p : attn->parameters()) p.mutable_grad().reset();
    (out * w).sum().backward();
    return std::vector<at::Tensor>{input.grad(), attn->qkv->weight.grad().clone(),
                                   attn->proj->weight.grad().clone()};
  };
  const auto g_fused = grads(fused, x);
  const auto g_plain = grads(plain, x2);
  for (size_t i = 0; i < g_fused.size(); ++i) {
    EXPECT_TRUE(at::allclose(g_fused[i], g_plain[i], 1e-4, 1e-5))
        << i << ": " << (g_fused[i] - g_plain[i]).abs().max();
  }
}

}  // namespace
}  // namespace pipemat::models
