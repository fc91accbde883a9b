#pragma once
// What a training run needs from its model, whatever the model kind: the stages (sharing one
// set of weights built from the seed, so the pipeline and the single-process reference hold
// the same numbers), the loss, the train and validation data, the remat policy and the
// global names of the parameters. `pipemat train`, the reference run and the benchmarks build
// one per rank (threads-as-ranks: one per thread) and use nothing model-specific besides.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <map>
#include "pipemat/train/options.h"

#include "pipemat/pp/pipeline.h"

namespace pipemat::train {

struct ModelRun {
  int stages = 0;
  pp::StageFactory stage;  // stage s; every call returns modules of the same weights
  // Drops the model's own reference to its weights: what no stage handed out holds is freed (a
  // pipeline rank keeps its own stages' weights only). `stage` must not be called afterwards.
  std::function<void()> release_unused;
  pp::LossFn loss;            // mean loss of one micro-batch (pp divides by micro-batches)
  pp::DataSource train_data;  // (step, micro-batch) -> inputs / targets
  pp::DataSource eval_data;   // (step, micro-batch), the same windows for every step; may be
                              // empty (no validation data)
  remat::RematPolicy policy;
  // remat.stages: the policy of each model stage (pp::PipelineOptions::stage_remat); empty:
  // `policy` on every stage.
  std::map<int, remat::RematPolicy> stage_policies;
  // "layers.<local>.x" of stage s -> "layers.<global>.x" (gpt: "blocks.<i>..."); other names
  // as they are.
  std::function<std::string(int stage, const std::string& name)> global_name;
  int64_t tokens_per_micro_batch = 0;  // for tokens/s
  // Validation tokens per byte of their text (TokenData): the loss per byte is the loss per
  // token times it; 0: unknown (and for the zoo's synthetic data).
  double validation_tokens_per_byte = 0;
  bool random = false;  // the forward draws random numbers (dropout)
  std::string summary;  // one line: the model and its data
};

// Builds the model of `config` split into `stages` stages (pp::stage_count of the schedule).
// ConfigError for a model or partition that does not fit; for gpt and llama also the data errors of
// load_text.
ModelRun make_model_run(const TrainConfig& config, int stages);

// The stages and global names of the model of `config` only (stage, release_unused,
// global_name, policy, summary): no data is read (a gpt's or llama's data.path need not exist),
// so the weights of a checkpoint or a weight file can be loaded where the training data is not.
ModelRun make_model_weights(const TrainConfig& config, int stages);

// Tokens of one micro-batch: gpt and llama batch x seq_len, the zoo's model.tokens.
int64_t tokens_per_micro_batch(const models::ModelOptions& model);

// Learning rate of step `step` (TrainingOptions: warmup, then none or cosine decay).
double lr_at(const TrainingOptions& training, int64_t step);

}  // namespace pipemat::train
