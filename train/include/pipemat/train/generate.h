#pragma once
// Sampling from a trained gpt or llama checkpoint (`pipemat generate`): the stages of every rank
// are loaded into this process (pp::load_stage_weights) and continue a prompt byte by byte.

#include <cstdint>
#include <string>

#include "pipemat/train/options.h"

namespace pipemat::train {

struct GenerateResult {
  std::string text;   // the prompt's continuation: exactly `tokens` bytes
  int64_t step = 0;   // training steps of the checkpoint
  std::string model;  // one line: the model's sizes
};

// Reads the run's config from the checkpoint's manifest (save_checkpoint's metadata), builds
// the gpt or llama of that config, loads every stage and samples `options.tokens` bytes after
// `options.prompt` (the last model.seq_len bytes of the text so far are the context): logits /
// temperature, restricted to the top_k most likely bytes (0: all), drawn from a generator
// seeded with options.seed. ConfigError when `dir` is not a checkpoint of a gpt or llama run
// (another model kind, or no config in its manifest); PipelineError when it is incomplete or
// damaged.
GenerateResult generate_text(const std::string& dir, const SampleOptions& options);

}  // namespace pipemat::train
