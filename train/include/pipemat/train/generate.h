#pragma once
// Sampling from a trained gpt or llama checkpoint (`pipemat generate`): the stages of every rank
// are loaded into this process (pp::load_stage_weights) and continue a prompt byte by byte.

#include <cstdint>
#include <string>

#include "pipemat/train/options.h"

namespace pipemat::train {

struct GenerateResult {
  std::string text;   // the prompt's continuation: exactly `tokens` bytes
  int64_t step = 0;   // training steps of the checkpoint; -1 for a weight file
  std::string model;  // one line: the model's sizes
};

// Reads the run's config from the checkpoint's manifest (save_checkpoint's metadata), builds
// the gpt or llama of that config, loads every stage and samples `options.tokens` bytes after
// `options.prompt` (the last model.seq_len bytes of the text so far are the context): logits /
// temperature, restricted to the top_k most likely bytes (0: all), drawn from a generator
// seeded with options.seed. ConfigError when `dir` is not a checkpoint of a gpt or llama run
// (another model kind, or no config in its manifest); PipelineError when it is incomplete or
// damaged. `dir` may also be a safetensors file or directory that `pipemat export` wrote (not a
// checkpoint: is_checkpoint_dir): the model's config is its metadata's (pipemat/train/weights.h),
// the whole model one stage; WeightsError when it does not hold the model's parameters.
GenerateResult generate_text(const std::string& dir, const SampleOptions& options);

// True when `path` is a directory to read as a checkpoint: it has a manifest.json, or neither
// a model.safetensors nor a model.safetensors.index.json; or it does not exist and does not end
// in ".safetensors" (so the error says what was looked for).
bool is_checkpoint_dir(const std::string& path);

}  // namespace pipemat::train
