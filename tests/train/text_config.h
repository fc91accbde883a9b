#pragma once
// The small text-model runs of the gpt and llama tests: their keys besides the model's, and the
// check that the pipeline equals the single process.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "pipemat/models/model.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/train/config.h"
#include "pipemat/train/train.h"

namespace pipemat::train::testing {

// 3 steps of 2 ranks x 4 micro-batches under schedule `kind` (2 virtual stages when
// interleaved), remat `policy` (pre-triggered recompute unless none), AdamW with clipping,
// warm-up and cosine decay, an evaluation every 2 steps, on the text file `text_path`. The
// caller sets model.kind and the model's shape.
inline TrainConfig text_config(const std::string& text_path, const std::string& kind,
                               const std::string& policy) {
  TrainConfig c;
  c.model.seq_len = 16;
  c.model.batch = 2;
  c.data.path = text_path;
  c.data.validation = 0.25;
  c.schedule.kind = schedule::parse_schedule_kind(kind);
  c.schedule.ranks = 2;
  c.schedule.micro_batches = 4;
  c.schedule.virtual_stages = kind == "interleaved" ? 2 : 1;
  c.schedule.recompute =
      policy == "none" ? schedule::RecomputeMode::kNone : schedule::RecomputeMode::kPretrigger;
  c.remat.policy = models::parse_remat_policy(policy).value();
  c.training.steps = 3;
  c.training.optimizer = OptimizerKind::kAdamW;
  c.training.lr = 0.01;
  c.training.weight_decay = 0.01;
  c.training.clip_grad_norm = 0.5;
  c.training.warmup = 1;
  c.training.lr_decay = LrDecay::kCosine;
  c.training.min_lr = 0.001;
  c.training.eval_every = 2;
  c.training.eval_batches = 2;
  c.output.progress = false;
  return c;
}

// text_config with a small llama: 4 blocks, hidden 16, 4 heads over 2 key/value heads, ffn 24.
inline TrainConfig llama_config(const std::string& text_path, const std::string& kind,
                                const std::string& policy) {
  TrainConfig c = text_config(text_path, kind, policy);
  c.model.kind = models::ModelKind::kLlama;
  c.model.layers = 4;
  c.model.hidden = 16;
  c.model.heads = 4;
  c.model.kv_heads = 2;
  c.model.ffn = 24;
  c.model.rope_theta = 1000.0;
  return c;
}

// Trains text_config's 3 steps in the pipeline and in the single process: every loss and gradient
// norm, both validations (after step 2, eval_every, and after the last) and every parameter
// equal, bitwise. Returns the single process's run.
inline TrainResult expect_pipeline_equals_reference(const TrainConfig& c) {
  const TrainResult pipe = train_in_process(c, nullptr);
  TrainResult ref = train_reference(c, nullptr);
  EXPECT_EQ(pipe.steps.size(), 3u);
  EXPECT_EQ(ref.steps.size(), 3u);
  for (size_t s = 0; s < 3 && s < pipe.steps.size() && s < ref.steps.size(); ++s) {
    EXPECT_EQ(pipe.steps[s].loss, ref.steps[s].loss) << "loss of step " << s;
    EXPECT_EQ(pipe.steps[s].grad_norm, ref.steps[s].grad_norm) << "gradient norm of step " << s;
  }
  EXPECT_EQ(pipe.validation.size(), 2u);
  EXPECT_EQ(ref.validation.size(), 2u);
  for (size_t i = 0; i < 2 && i < pipe.validation.size() && i < ref.validation.size(); ++i) {
    EXPECT_EQ(pipe.validation[i].first, ref.validation[i].first);
    EXPECT_EQ(pipe.validation[i].second, ref.validation[i].second) << "validation " << i;
  }
  // A name twice: the copies of a tied weight (Note [Tied weights]), equal bit for bit.
  const auto by_name = [](const std::vector<std::pair<std::string, at::Tensor>>& params) {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, value] : params) {
      const auto [it, fresh] = out.emplace(name, value);
      if (!fresh) {
        EXPECT_TRUE(at::equal(it->second, value)) << "the copies of tied " << name;
      }
    }
    return out;
  };
  std::map<std::string, at::Tensor> want = by_name(ref.params);
  const std::map<std::string, at::Tensor> got = by_name(pipe.params);
  EXPECT_EQ(got.size(), want.size());
  EXPECT_EQ(pipe.params.size(), ref.params.size());
  for (const auto& [name, value] : got) {
    EXPECT_TRUE(want.count(name)) << name;
    if (want.count(name)) {
      EXPECT_TRUE(at::equal(value, want[name])) << "parameter " << name;
    }
  }
  return ref;
}

}  // namespace pipemat::train::testing
