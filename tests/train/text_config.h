#pragma once
// The small text-model runs of the gpt and llama tests: what they share besides the model keys.

#include <string>

#include "pipemat/models/model.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/train/config.h"

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

}  // namespace pipemat::train::testing
