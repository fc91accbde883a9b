// The Llama decoder (llama.h): its RMSNorm, forward and gradients against a plain LibTorch
// computation written here from the formulas (grouped-query attention, RoPE, SwiGLU, tied and
// untied heads), its Hugging Face names and its shape errors.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/llama.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/pp/precision.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/policy.h"

namespace pipemat::models {
namespace {

LlamaShape small_shape(bool tied) {
  LlamaShape s;
  s.layers = 2;
  s.hidden = 16;
  s.heads = 4;
  s.kv_heads = 2;  // grouped-query: 2 query heads per key/value head
  s.ffn = 24;
  s.seq_len = 8;
  s.rope_theta = 500.0;
  s.norm_eps = 1e-5;
  s.tie_embeddings = tied;
  return s;
}

// ---- the formulas, written out ----------------------------------------------------------------

at::Tensor plain_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor ms = (x * x).sum(-1, /*keepdim=*/true) / static_cast<double>(x.size(-1));
  return weight * (x / at::sqrt(ms + eps));
}

// Rotates the pairs (i, i + d/2) of x [B, heads, T, d] by position t x theta^(-2i/d).
at::Tensor plain_rope(const at::Tensor& x, double theta) {
  const int64_t t = x.size(2), d = x.size(3), half = d / 2;
  at::Tensor out = at::empty_like(x);
  for (int64_t pos = 0; pos < t; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(i) / d);
      const double c = std::cos(angle), s = std::sin(angle);
      const at::Tensor a = x.select(2, pos).select(-1, i);
      const at::Tensor b = x.select(2, pos).select(-1, i + half);
      out.select(2, pos).select(-1, i).copy_(a * c - b * s);
      out.select(2, pos).select(-1, i + half).copy_(b * c + a * s);
    }
  }
  return out;
}

// Logits of ids [B, T] from the parameters by their Hugging Face names.
at::Tensor plain_llama(const std::map<std::string, at::Tensor>& w, const LlamaShape& s,
                       const at::Tensor& ids) {
  const int64_t b = ids.size(0), t = ids.size(1), d = s.head_dim();
  at::Tensor x = w.at("model.embed_tokens.weight").index_select(0, ids.reshape({-1}));
  x = x.reshape({b, t, s.hidden});
  const at::Tensor mask = at::ones({t, t}, at::kBool).triu(1);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const at::Tensor h = plain_rms_norm(x, w.at(p + "input_layernorm.weight"), s.norm_eps);
    const auto heads_of = [&](const std::string& name, int64_t n) {
      return at::matmul(h, w.at(p + name).t()).reshape({b, t, n, d}).permute({0, 2, 1, 3});
    };
    const at::Tensor q = plain_rope(heads_of("self_attn.q_proj.weight", s.heads), s.rope_theta);
    const at::Tensor k = plain_rope(heads_of("self_attn.k_proj.weight", s.kv_heads), s.rope_theta);
    const at::Tensor v = heads_of("self_attn.v_proj.weight", s.kv_heads);
    std::vector<at::Tensor> heads;
    for (int64_t head = 0; head < s.heads; ++head) {
      const int64_t group = head / (s.heads / s.kv_heads);
      at::Tensor scores = at::matmul(q.select(1, head), k.select(1, group).transpose(-1, -2)) /
                          std::sqrt(static_cast<double>(d));
      scores = scores.masked_fill(mask, -INFINITY);
      heads.push_back(at::matmul(at::softmax(scores, -1), v.select(1, group)));  // [B, T, d]
    }
    const at::Tensor context = at::cat(heads, -1);  // [B, T, heads * d]
    x = x + at::matmul(context, w.at(p + "self_attn.o_proj.weight").t());
    const at::Tensor g = plain_rms_norm(x, w.at(p + "post_attention_layernorm.weight"), s.norm_eps);
    const at::Tensor gate = at::matmul(g, w.at(p + "mlp.gate_proj.weight").t());
    const at::Tensor up = at::matmul(g, w.at(p + "mlp.up_proj.weight").t());
    const at::Tensor act = gate / (1 + at::exp(-gate)) * up;
    x = x + at::matmul(act, w.at(p + "mlp.down_proj.weight").t());
  }
  x = plain_rms_norm(x, w.at("model.norm.weight"), s.norm_eps);
  const at::Tensor head =
      s.tie_embeddings ? w.at("model.embed_tokens.weight") : w.at("lm_head.weight");
  return at::matmul(x, head.t());
}

TEST(LlamaRMSNorm, IsHuggingFacesInFloat32BackToTheInputDtypeTimesTheWeight) {
  LlamaRMSNorm norm(2, 1e-5);
  {
    at::NoGradGuard no_grad;
    norm->weight.copy_(at::tensor({2.0f, 0.5f}));
  }
  // [3, 4]: mean of squares 12.5, so x / sqrt(12.5 + 1e-5) times the weight.
  const at::Tensor y = norm(at::tensor({3.0f, 4.0f}));
  const double r = 1.0 / std::sqrt(12.5 + 1e-5);
  EXPECT_NEAR(y[0].item<double>(), 2.0 * 3.0 * r, 1e-6);
  EXPECT_NEAR(y[1].item<double>(), 0.5 * 4.0 * r, 1e-6);
  // A bf16 input: normalized in float32, rounded to bf16, times the float32 weight (float32).
  at::manual_seed(3);
  const at::Tensor x = at::randn({4, 2}).to(at::kBFloat16);
  const at::Tensor got = norm(x);
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor want =
      norm->weight * (xf * at::rsqrt(xf.pow(2).mean({-1}, true) + 1e-5)).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(got, want));
}

TEST(LlamaRope, TablesAreCosAndSinOfPositionTimesInverseFrequency) {
  const auto [cos, sin] = rope_tables(5, 4, 100.0);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{5, 4}));
  // Position 3, pair 1: angle 3 x 100^(-2/4) = 0.3, in columns 1 and 3.
  EXPECT_NEAR(cos[3][1].item<double>(), std::cos(0.3), 1e-6);
  EXPECT_NEAR(sin[3][3].item<double>(), std::sin(0.3), 1e-6);
  EXPECT_NEAR(cos[3][0].item<double>(), std::cos(3.0), 1e-6);
  EXPECT_EQ(sin[0].abs().sum().item<double>(), 0.0);  // position 0 is not rotated
}

class LlamaForward : public ::testing::TestWithParam<bool> {};

// The whole model as one stage (GQA, RoPE, SwiGLU, both RMSNorms, the head) against the plain
// computation: logits, and the gradients of a cross-entropy for every parameter.
TEST_P(LlamaForward, LogitsAndGradientsEqualThePlainComputation) {
  const LlamaShape shape = small_shape(GetParam());
  const LlamaParts parts = build_llama(shape, 11);
  LlamaStage stage(parts, 0, shape.layers, true, true);
  {
    // Norm weights away from one, so their gradients and scaling are tested too.
    at::NoGradGuard no_grad;
    for (auto& item : stage->named_parameters()) {
      if (item.key().find("norm") != std::string::npos) item.value().uniform_(0.5, 1.5);
    }
  }
  at::manual_seed(5);
  const at::Tensor ids = at::randint(0, kByteVocab, {2, shape.seq_len}, at::kLong);
  const at::Tensor targets = at::randint(0, kByteVocab, {2, shape.seq_len}, at::kLong);

  const at::Tensor logits = stage->forward(ids);
  gpt_loss(logits, targets).backward();

  std::map<std::string, at::Tensor> mine, theirs;
  for (const auto& item : stage->named_parameters()) {
    const std::string hf = llama_hf_name(item.key());
    mine[hf] = item.value();
    theirs[hf] = item.value().detach().clone().requires_grad_();
  }
  EXPECT_EQ(mine.size(), llama_hf_names(shape).size());
  EXPECT_EQ(mine.count("lm_head.weight"), GetParam() ? 0u : 1u);
  const at::Tensor want = plain_llama(theirs, shape, ids);
  EXPECT_TRUE(at::allclose(logits, want, 1e-4, 1e-5)) << (logits - want).abs().max().item<double>();
  const at::Tensor plain_loss = -at::log_softmax(want.reshape({-1, kByteVocab}), -1)
                                     .gather(1, targets.reshape({-1, 1}))
                                     .mean();
  plain_loss.backward();
  for (const auto& [name, p] : mine) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_GT(p.grad().abs().max().item<double>(), 0.0) << name;
    EXPECT_TRUE(at::allclose(p.grad(), theirs[name].grad(), 1e-3, 1e-6))
        << name << ": " << (p.grad() - theirs[name].grad()).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, LlamaForward, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& test) {
                           return test.param ? std::string("Tied") : std::string("Untied");
                         });

// Causality: the logits at position t do not change when later ids change.
TEST(LlamaAttention, IsCausal) {
  const LlamaShape shape = small_shape(false);
  const LlamaParts parts = build_llama(shape, 2);
  LlamaStage stage(parts, 0, shape.layers, true, true);
  at::manual_seed(1);
  at::Tensor ids = at::randint(0, kByteVocab, {1, shape.seq_len}, at::kLong);
  const at::Tensor a = stage->forward(ids).detach();
  ids[0][5] = (ids[0][5].item<int64_t>() + 1) % kByteVocab;
  const at::Tensor b = stage->forward(ids).detach();
  EXPECT_TRUE(at::equal(a.narrow(1, 0, 5), b.narrow(1, 0, 5)));
  EXPECT_FALSE(at::equal(a.narrow(1, 5, 1), b.narrow(1, 5, 1)));
}

TEST(LlamaNames, MapOneToOneOntoHuggingFaceNames) {
  LlamaShape shape = small_shape(false);
  shape.layers = 1;
  const std::vector<std::pair<std::string, std::string>> want = {
      {"embed_tokens.weight", "model.embed_tokens.weight"},
      {"layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight"},
      {"layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"},
      {"layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"},
      {"layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.weight"},
      {"layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight"},
      {"layers.0.post_attention_layernorm.weight",
       "model.layers.0.post_attention_layernorm.weight"},
      {"layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight"},
      {"layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"},
      {"layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"},
      {"norm.weight", "model.norm.weight"},
      {"lm_head.weight", "lm_head.weight"}};
  EXPECT_EQ(llama_hf_names(shape), want);
  // The names a one-stage model's named_parameters gives, in the same order.
  const LlamaParts parts = build_llama(shape, 1);
  LlamaStage stage(parts, 0, 1, true, true);
  std::vector<std::string> own;
  for (const auto& item : stage->named_parameters()) own.push_back(item.key());
  std::vector<std::string> listed;
  for (const auto& [name, hf] : want) listed.push_back(name);
  EXPECT_EQ(own, listed);
  for (const auto& [name, hf] : want) EXPECT_EQ(llama_own_name(hf), name);
  shape.tie_embeddings = true;
  EXPECT_EQ(llama_hf_names(shape).back().first, "norm.weight");
  EXPECT_EQ(llama_hf_name("layers.31.mlp.up_proj.weight"), "model.layers.31.mlp.up_proj.weight");
  for (const char* bad : {"layers.0.mlp.up.weight", "blocks.0.attn.qkv.weight", "layers.x.mlp",
                          "layers.+1.mlp.up_proj.weight", "layers..mlp.up_proj.weight"}) {
    try {
      llama_hf_name(bad);
      ADD_FAILURE() << bad;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string("llama: '") + bad +
                    "' is not a parameter of a llama (expected embed_tokens.weight, "
                    "layers.<i>.<parameter of a block>, norm.weight or lm_head.weight)");
    }
  }
  EXPECT_THROW(llama_own_name("layers.0.mlp.up_proj.weight"), ConfigError);  // no "model."
}

TEST(LlamaShapeErrors, NameTheKey) {
  const auto error_of = [](const ModelOptions& m) -> std::string {
    try {
      llama_shape(m);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  };
  ModelOptions m;
  m.kind = ModelKind::kLlama;
  m.hidden = 32;
  m.heads = 4;
  m.kv_heads = 3;
  EXPECT_EQ(error_of(m),
            "model.kv_heads: 3 does not divide model.heads 4 (every key/value head serves an "
            "equal group of query heads)");
  m.kv_heads = 0;
  EXPECT_EQ(llama_shape(m).kv_heads, 4);
  m.hidden = 12;  // head size 3
  EXPECT_EQ(error_of(m),
            "model.heads: the head size model.hidden / model.heads = 3 is odd; the rotary "
            "embedding rotates pairs of a head's features");
  m.hidden = 32;
  m.dropout = 0.1;
  EXPECT_EQ(error_of(m), "model.dropout: 0.1; llama has no dropout (expected 0)");
  m.dropout = 0.0;
  m.tie_embeddings = true;
  const LlamaShape shape = llama_shape(m);
  EXPECT_EQ(shape.ffn, 128);
  LlamaShape tiny = small_shape(true);
  const LlamaParts parts = build_llama(tiny, 1);
  // Note [Tied weights]: across two stages the last holds a copy of the embedding, under its name.
  EXPECT_EQ(partition_llama(parts, PartitionOptions{}, 2), (std::vector<int64_t>{0, 1, 2}));
  // The last stage's copy weighs as an untied head: a large vocabulary splits 4 blocks 2 + 2.
  LlamaShape wide = small_shape(true);
  wide.layers = 4;
  wide.vocab = 4096;
  EXPECT_EQ(partition_llama(build_llama(wide, 1), PartitionOptions{}, 2),
            (std::vector<int64_t>{0, 2, 4}));
  wide.tie_embeddings = false;
  EXPECT_EQ(partition_llama(build_llama(wide, 1), PartitionOptions{}, 2),
            (std::vector<int64_t>{0, 2, 4}));
  LlamaStage first(parts, 0, 1, true, false), last(parts, 1, 2, false, true);
  EXPECT_EQ(llama_tied(0, 2, true),
            (std::map<std::string, std::string>{{"embed_tokens.weight", "embed_tokens.weight"}}));
  EXPECT_EQ(llama_tied(1, 2, true), llama_tied(0, 2, true));
  EXPECT_TRUE(llama_tied(1, 3, true).empty());
  EXPECT_TRUE(llama_tied(0, 1, true).empty());
  EXPECT_TRUE(llama_tied(0, 2, false).empty());
  const at::Tensor copy = last->named_parameters()["embed_tokens.weight"];
  EXPECT_FALSE(copy.is_same(parts.embed_tokens->weight));
  EXPECT_TRUE(at::equal(copy, parts.embed_tokens->weight));
  EXPECT_EQ(last->named_parameters().contains("lm_head.weight"), false);
  EXPECT_EQ(partition_llama(parts, PartitionOptions{}, 1), (std::vector<int64_t>{0, 2}));
}

// The selective policy on two blocks: the five GEMMs that read a normalized input are SAVE
// regions, so the norms' outputs are rederived, not kept: fp32, one slot per SAVE region with 2
// input storages (input_layernorm's and post_attention_layernorm's outputs) per block; bf16, the
// five regions' own bf16 casts. Gradients equal those without remat bitwise, and a replay runs
// the norms again but not the SAVE bodies.
TEST(LlamaRemat, SelectiveRederivesTheNormalizedInputsOfTheFiveGemms) {
  const LlamaShape shape = small_shape(false);
  const int64_t b = 2, t = shape.seq_len, h = shape.hidden;
  ModelOptions model;
  model.kind = ModelKind::kLlama;
  RematConfig selective;
  selective.policy = RematPolicyKind::kSelective;
  for (const pp::Precision precision : {pp::Precision::kFloat32, pp::Precision::kBFloat16}) {
    SCOPED_TRACE(pp::to_string(precision));
    const auto run = [&](bool remat, remat::RematReport* report) {
      const LlamaParts parts = build_llama(shape, 9);
      LlamaStage stage(parts, 0, shape.layers, false, false);  // two blocks, no embedding
      if (remat) remat::apply_policy(*stage, stage_policy(model, selective));
      at::manual_seed(4);
      const at::Tensor x = at::randn({b, t, h}).requires_grad_();
      at::Tensor out;
      std::shared_ptr<remat::InvocationGroup> group;
      {
        remat::InvocationScope scope({0, 0, 0});
        pp::PrecisionRegion region(precision, at::kCPU);
        out = stage->forward(x).to(at::kFloat);
        group = scope.group();
      }
      if (report != nullptr) *report = group->report();
      (out * at::linspace(-1, 1, out.numel()).reshape(out.sizes())).sum().backward();
      std::vector<at::Tensor> grads{x.grad()};
      for (const auto& p : stage->parameters()) grads.push_back(p.grad());
      if (remat) {
        for (const auto& block : *stage->layers) {
          const auto* l = block->as<LlamaBlock>().get();
          EXPECT_EQ(l->calls, 2) << "forward and replay";
          EXPECT_EQ(l->self_attn->q_proj->calls, 1) << "the SAVE body runs only in forward";
          EXPECT_EQ(l->mlp->up_proj->calls, 1);
        }
      }
      return grads;
    };
    remat::RematReport report;
    const std::vector<at::Tensor> with = run(true, &report), without = run(false, nullptr);
    ASSERT_EQ(with.size(), without.size());
    for (size_t i = 0; i < with.size(); ++i) EXPECT_TRUE(at::equal(with[i], without[i])) << i;
    EXPECT_EQ(report.fallback_total(), 0) << report.str();
    const bool bf16 = precision == pp::Precision::kBFloat16;
    EXPECT_EQ(report.rederived_slots, shape.layers * 5) << report.str();
    EXPECT_EQ(report.rederived_bytes,
              bf16 ? shape.layers * 5 * b * t * h * 2 : shape.layers * 2 * b * t * h * 4);
  }
}

}  // namespace
}  // namespace pipemat::models
