#pragma once
// Sampling from a trained gpt or llama checkpoint (`pipemat generate`): the stages of every rank
// are loaded into this process (pp::load_stage_weights) and continue a prompt byte by byte, or
// token by token with a tokenizer (the run's data.tokenizer, or SampleOptions::tokenizer).

#include <cstdint>
#include <string>
#include <vector>

#include "pipemat/train/options.h"

namespace pipemat::train {

struct GenerateResult {
  std::string text;          // the prompt's continuation: `tokens` bytes, or tokens decoded
  std::vector<int64_t> ids;  // the ids sampled, `tokens` of them
  int64_t step = 0;          // training steps of the checkpoint; -1 for a weight file
  std::string model;         // one line: the model's sizes
};

// Reads the run's config from the checkpoint's manifest (save_checkpoint's metadata), builds
// the gpt or llama of that config, loads every stage and samples `options.tokens` tokens (bytes
// without a tokenizer) after `options.prompt` (the last model.seq_len tokens so far are the
// context): the most likely with options.greedy, else logits / temperature, restricted to the
// top_k most likely (0: all), drawn from a generator seeded with options.seed. With a
// tokenizer the prompt is encoded, the ids sampled are those below its vocab_size, and the text
// is decoded whole characters at a time (data::StreamDecoder). ConfigError when `dir` is not a
// checkpoint of a gpt or llama run (another model kind, or no config in its manifest);
// PipelineError when it is incomplete or damaged. `dir` may also be a safetensors file or
// directory that `pipemat export` wrote (not a checkpoint: is_checkpoint_dir): the model's
// config is its metadata's (pipemat/train/weights.h), the whole model one stage; or a Hugging
// Face Llama directory as transformers writes it (config.json, safetensors, a tokenizer), read
// as model.from reads it; WeightsError when it does not hold the model's parameters.
GenerateResult generate_text(const std::string& dir, const SampleOptions& options);

// True when `path` is a directory to read as a checkpoint: it has a manifest.json, or neither
// a model.safetensors nor a model.safetensors.index.json; or it does not exist and does not end
// in ".safetensors" (so the error says what was looked for).
bool is_checkpoint_dir(const std::string& path);

}  // namespace pipemat::train
