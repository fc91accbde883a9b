#pragma once
// Checkpoints of a pipeline run (Note [Checkpoint layout]): every rank writes its stages'
// parameters and buffers, its optimizer state, the step counter and its generator state; rank 0
// writes the manifest last. Resuming loads them into a Pipeline built with the same options.
//
//   <root>/step-000004/rank-0.pt, rank-1.pt, ..., manifest.json
//
// Crash safety: each file is written to "<name>.tmp", fsynced and renamed; the manifest only
// after every rank's file is durable (a barrier), so a checkpoint is complete exactly when its
// manifest exists. latest_checkpoint() skips incomplete ones; load_checkpoint() refuses them.
// The data source and the LR schedule are functions of the step, so the step restores them.

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "pipemat/comm/transport.h"
#include "pipemat/pp/pipeline.h"

namespace pipemat::pp {

// Collective. Saves the state after pipeline.step() completed steps under `root` and returns
// the checkpoint's directory. With keep_last > 0 rank 0 then removes the oldest complete
// checkpoints beyond the newest keep_last. PipelineError naming the file on an I/O failure.
// `metadata` is stored in the manifest as is (e.g. the run's config, for sampling later).
std::string save_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& root,
                            int keep_last = 0, const std::string& metadata = "");

// The directory of the newest complete checkpoint under `root`, or "" when there is none.
std::string latest_checkpoint(const std::string& root);

// Collective. Loads the checkpoint in `dir` (a step-NNNNNN directory) into this rank's stages,
// optimizer, generator and step. ConfigError when the manifest was written by another pipeline
// (world size, schedule kind, stages, micro-batches or stage map differ: the field and both
// values); PipelineError when it is incomplete (no manifest, a missing or truncated rank file) or
// a parameter's name, shape or count differs. Nothing is changed before every check of this rank
// passed. Resuming on another stage layout (re-partitioning) is not supported.
void load_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& dir);

// What a complete checkpoint's manifest says. PipelineError when `dir` is incomplete (no
// manifest) or the manifest is not one pipemat wrote.
struct CheckpointManifest {
  int64_t step = 0;
  int world_size = 0;
  std::string schedule_kind;
  int stages = 0;
  int micro_batches = 0;
  std::vector<int> stage_to_rank;
  std::string metadata;  // save_checkpoint's `metadata`
};
CheckpointManifest read_checkpoint_manifest(const std::string& dir);

// Not collective: loads the parameters and buffers of every stage of the checkpoint in `dir`
// into `stages` (one module per stage, in stage order, built as the pipeline built them), e.g.
// to sample from a trained model in one process. ConfigError when the number of stages
// differs; PipelineError (naming the file, stage and name) when a rank file is missing or
// damaged or a parameter's name, shape or dtype differs. Optimizer and generator states are
// not read.
void load_stage_weights(const std::string& dir, const std::vector<torch::nn::Module*>& stages);

}  // namespace pipemat::pp
