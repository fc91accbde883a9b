#pragma once
// Checkpoints of a pipeline run (Note [Checkpoint layout]): every rank writes its stages'
// parameters and buffers, its optimizer state, the step counter and its generator state; rank 0
// writes the manifest last. Resuming loads them into a Pipeline built with the same options.
//
//   <root>/step-000004/rank-0.pt, rank-1.pt, ..., manifest.json
//
// Crash safety: each file is written to "<name>.tmp", fsynced and renamed; the manifest only
// after every rank's file is durable (every rank reports its outcome to every other), so a
// checkpoint is complete exactly when its manifest exists. latest_checkpoint() skips incomplete
// ones; load_checkpoint() refuses them. The data source and the LR schedule are functions of the
// step, so the step restores them.

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "pipemat/comm/transport.h"
#include "pipemat/pp/checkpoint_manifest.h"
#include "pipemat/pp/pipeline.h"

namespace pipemat::pp {

// Note [Checkpoint layout]
// rank-<r>.pt is a torch archive with "step" (int64), "run" (the run's id, a string), "stages"
// (int64: this rank's stages), "params/<stage>/<name>" and "buffers/<stage>/<name>" (dots of
// module paths become '|'), "optimizer" (the optimizer's own archive) and "rng" (the generator
// state, with PipelineOptions::seed). manifest.json holds the format version (2), the step, what
// must match on resume (world size, schedule kind, stages, micro-batches and the stage map), the
// run, and "files": each rank file's SHA-256 and size, checked before anything of it is loaded
// (Note [Verified checkpoints] in src/checkpoint.cpp).
// With a sharded optimizer (Note [Sharded optimizer] in pipemat/pp/pipeline.h) the format is 3:
// the rank files hold no "optimizer"; every replica d of D writes
// rank-<r>.shard-<d>-of-<D>.pt ("step", "run" and "shard": its optimizer over its slices and the
// layout that places them), "replicas" is D, and "files" records the shard files too. A load
// joins the D shards of its rank and keeps what its own layout needs, so any D, sharded or not,
// resumes it.

// Note [Checkpoint runs]
// Every checkpoint names the run that wrote it: a random id made when a run starts
// (new_checkpoint_run) and kept when a run resumes (resumed_run), with the digest of the config
// it was started with (the caller's; `pipemat train` stores the SHA-256 of its config). A run
// prunes only its own complete checkpoints, never the one it has just written, and only after
// that one is complete; a complete checkpoint of another run is never overwritten or removed.
struct CheckpointRun {
  std::string id;             // 32 lowercase hex digits
  std::string config_digest;  // may be empty
};

// A new run: a fresh random id (from std::random_device) and `config_digest`.
CheckpointRun new_checkpoint_run(const std::string& config_digest = "");

// The run that wrote the complete checkpoint in `dir`, to continue it. A checkpoint written
// before checkpoints named their run gets a new id (its directory's older checkpoints then belong
// to no run, and are never pruned). PipelineError when `dir` is incomplete.
CheckpointRun resumed_run(const std::string& dir);

// A step-NNNNNN directory under a checkpoint root.
struct CheckpointEntry {
  std::string dir;
  int64_t step = 0;
  bool complete = false;      // its manifest exists and is one pipemat wrote
  bool damaged = false;       // its manifest exists but is not one (see `problem`)
  std::string problem;        // why a damaged manifest cannot be read
  std::string run_id;         // "" when incomplete or written before checkpoints named their run
  std::string config_digest;  // of that run
};

// Every step-NNNNNN directory under `root` in step order (other files and directories are not
// checkpoints and are left out); empty when `root` does not exist. A directory without a
// manifest is incomplete (a save was interrupted); one whose manifest cannot be read is neither
// complete nor a silent skip: `damaged`, with the reason. Rank files are checked on load, not
// here.
std::vector<CheckpointEntry> list_checkpoints(const std::string& root);

// Removes one checkpoint directory, its manifest first (so an interrupted removal leaves an
// incomplete checkpoint, never a complete-looking one with files missing). PipelineError
// naming the path on failure. Not collective.
void remove_checkpoint(const std::string& dir);

// Collective. Saves the state after pipeline.step() completed steps under `root` as a checkpoint
// of `run` and returns the checkpoint's directory. With keep_last > 0 rank 0 then removes the
// oldest complete checkpoints of the same run beyond the newest keep_last, counting the new one
// (which is always kept), once the new one is complete. `metadata` is stored in the manifest as
// is (e.g. the run's config, for sampling later).
// Every rank ends with the same outcome: PipelineError on every rank (naming the rank, the file
// and the OS's reason, e.g. "No space left on device") when any rank could not write its part;
// the incomplete directory this save created is then removed and the run's earlier
// checkpoints are untouched. PipelineError too when `root`/step-NNNNNN is a complete checkpoint
// of another run (it is never overwritten) or `run.id` is empty. A complete checkpoint of the
// same run at the same step (a resumed run passing it again) is replaced: its manifest goes
// first.
// With a sharded optimizer (Note [Sharded optimizer]) every replica calls it, collective over
// the data group as well: each writes its optimizer shard, replica 0 the rank files and the
// manifest (so parameters once); every replica returns the directory, or throws when the save
// failed anywhere (its own error, or PeerFailedError naming replica 0 of its rank).
std::string save_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& root,
                            const CheckpointRun& run, int keep_last = 0,
                            const std::string& metadata = "");

// The directory of the newest complete checkpoint under `root` (of run `run_id` when given), or
// "" when there is none. A damaged manifest newer than it is not skipped in silence:
// PipelineError naming the manifest and what is wrong with it.
std::string latest_checkpoint(const std::string& root, const std::string& run_id = "");

// Collective. Loads the checkpoint in `dir` (a step-NNNNNN directory) into this rank's stages,
// optimizer, generator and step. ConfigError when the manifest was written by another pipeline
// (world size, schedule kind, stages, micro-batches or stage map differ: the field and both
// values); PipelineError when it is incomplete (no manifest, a missing rank file), when a rank
// file's SHA-256 or size differs from the manifest's record (a damaged or replaced file: both
// digests named), when a rank file names another run or step than the manifest, or when a
// parameter's name, shape or count differs. Nothing is changed before every check of this rank
// passed. Resuming on another stage layout (re-partitioning) is not supported.
// A NaN or an infinity in any tensor of a rank or shard file (parameters, buffers, optimizer
// state) is a PipelineError naming the file, the tensor and the index, unless
// `allow_non_finite` (Note [Non-finite values at load] in pipemat/pp/finite.h).
void load_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& dir,
                     bool allow_non_finite = false);

// What a complete checkpoint's manifest says (CheckpointManifest:
// pipemat/pp/checkpoint_manifest.h), checked against itself and against the files the directory
// holds. PipelineError when `dir` is incomplete (no manifest), the manifest is not one pipemat
// wrote, or a field disagrees with the directory (naming the field: "field 'replicas' is 3 but ...
// holds the optimizer shards of 2 replicas").
CheckpointManifest read_checkpoint_manifest(const std::string& dir);

// Not collective: loads the parameters and buffers of every stage of the checkpoint in `dir`
// into `stages` (one module per stage, in stage order, built as the pipeline built them), e.g.
// to sample from a trained model in one process. ConfigError when the number of stages
// differs; PipelineError (naming the file, stage and name) when a rank file is missing or
// damaged (checked against the manifest's digests) or a parameter's name, shape or dtype
// differs, or (unless `allow_non_finite`) a parameter or buffer read is not finite. Optimizer
// and generator states are not loaded, and not checked.
void load_stage_weights(const std::string& dir, const std::vector<torch::nn::Module*>& stages,
                        bool allow_non_finite = false);

}  // namespace pipemat::pp
