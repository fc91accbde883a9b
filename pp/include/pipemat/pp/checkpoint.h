#pragma once
// Checkpoints of a pipeline run (Note [Checkpoint layout]): every rank writes its stages'
// parameters, buffers and optimizer state by their names in the whole model (Note [Global names]
// in pipemat/pp/pipeline.h); rank 0 writes the manifest last, which indexes every tensor. A
// checkpoint resumes on any layout whose stages hold the same names.
//
//   <root>/step-000004/rank-0.safetensors, rank-1.safetensors, ..., manifest.json
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
// Format 4 (what save_checkpoint writes). Each rank of the pipeline (replica 0 of its data group)
// writes rank-<r>.safetensors: its stages' parameters and buffers under their global names (a
// tied weight once, from the lowest stage holding a copy), their optimizer state as
// "<name>:<field>" ("model.norm.weight:exp_avg", ...) and "<name>:step" (an int64), and on rank
// 0 the generator state ("pipemat.rng"). With a sharded optimizer (Note [Sharded optimizer] in
// pipemat/pp/pipeline.h) every replica d of D writes its pieces' state to
// rank-<r>.shard-<d>-of-<D>.safetensors, each piece a flat run [begin, end) of its parameter's
// elements, stored as "<name>:<field>@<begin>". Every file's metadata names the run and the step.
// manifest.json holds the format (4), the step, the layout that wrote it (world size, schedule
// kind, stages, micro-batches, stage map, data replicas, sharded), what must not change on
// resume (the micro-batches of a step: micro-batches x replicas; the seed; the optimizer's kind),
// the run, the caller's metadata, "files" (each file's SHA-256 and size), "tensors" (each
// tensor by name: dtype, shape, the stage that wrote it, and its pieces: file, key, element
// range and the SHA-256 of its bytes) and "ties" (each tie key -> the name its weight is stored
// under). Optimizer options (the learning rate, betas) are not stored: the factory makes them and
// the LR schedule sets them from the step. An optimizer other than torch's SGD, Adam, AdamW,
// RMSprop and Adagrad (whose state pp cannot name per element) is stored as each rank's own
// archive (optimizer->save), the U8 tensor "pipemat.optimizer.rank-<r>": such a checkpoint
// resumes on the layout that wrote it only (a ConfigError naming both layouts elsewhere).
// Formats 1 to 3 (written before format 4; they still load, on the layout that wrote them):
// rank-<r>.pt torch archives keyed by stage ("params/<stage>/<name>"), with "optimizer" (format 3:
// per replica rank-<r>.shard-<d>-of-<D>.pt) and "rng"; format 1 records no digests.

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

// What load_checkpoint did on this rank: the bytes it read from the checkpoint's files (headers
// included), the bytes of the tensors it read, and the manifest of what it loaded (its layout:
// describe_layout).
struct CheckpointLoad {
  int64_t bytes_read = 0;    // format 4; 0 for the older formats
  int64_t tensor_bytes = 0;  // format 4
  // The most bytes of tensors the load held at once above what the process held before it (the
  // tracking allocator's, pipemat/remat/memory.h: 0 when it is not installed; ranks as threads
  // share one process and so one count). Format 4.
  int64_t peak_bytes = 0;
  // The same of every rank of the pipeline, by rank (format 4; empty for the older formats).
  std::vector<int64_t> rank_bytes_read, rank_tensor_bytes, rank_peak_bytes;
  CheckpointManifest from;
};

// Collective. Loads the checkpoint in `dir` (a step-NNNNNN directory) into this rank's stages,
// optimizer, generator and step, on any layout (Note [Checkpoint load planner] in
// src/checkpoint_load.cpp): each rank reads the tensors its stages hold by their global names,
// and nothing else. ConfigError when what a resume keeps differs: the micro-batches of a step
// (micro-batches x data replicas), the seed, the optimizer's kind (naming both values).
// PipelineError when the checkpoint is incomplete (no manifest, a missing file), when a piece's
// SHA-256 or a file's size differs from the manifest's record (a damaged or replaced file: the
// file, the tensor and both digests named), when a file names another run or step than the
// manifest, when a tensor this pipeline needs is missing or has another shape or dtype (naming
// it, both shapes and the stage), or when the checkpoint holds a tensor no stage holds (a model
// with a layer more or other names). Nothing is changed on any rank before every rank's checks
// passed. A NaN or an infinity in a tensor read is a PipelineError naming it and the index,
// unless `allow_non_finite` (Note [Non-finite values at load] in pipemat/pp/finite.h).
// Formats 1 to 3 load only on the layout that wrote them (ConfigError naming the field that
// differs otherwise).
CheckpointLoad load_checkpoint(Pipeline& pipeline, comm::Transport& transport,
                               const std::string& dir, bool allow_non_finite = false);

// "2 ranks (1f1b, D=1)", "4 ranks (zb-v, 8 virtual stages, D=2 sharded)": the layout a
// checkpoint was written on, or a pipeline's; with the layers of each stage when given ("2 ranks
// (1f1b, [2,2], D=1)").
std::string describe_layout(const CheckpointManifest& manifest,
                            const std::vector<int64_t>& layers_per_stage = {});
std::string describe_layout(const Pipeline& pipeline,
                            const std::vector<int64_t>& layers_per_stage = {});

// What a complete checkpoint's manifest says (CheckpointManifest:
// pipemat/pp/checkpoint_manifest.h), checked against itself and against the files the directory
// holds. PipelineError when `dir` is incomplete (no manifest), the manifest is not one pipemat
// wrote, or a field disagrees with the directory (naming the field: "field 'replicas' is 3 but ...
// holds the optimizer shards of 2 replicas").
CheckpointManifest read_checkpoint_manifest(const std::string& dir);

// Not collective: loads the parameters and buffers of `stages` (e.g. every stage of a model built
// in one process, to sample from it or export it) from the checkpoint in `dir`, by their global
// names (format 4: any number of stages, any split; formats 1 to 3: every stage of the
// checkpoint, in stage order). PipelineError (naming the file, the stage and the name) when a
// file is missing or damaged (checked against the manifest's digests) or a tensor is missing or
// has another shape or dtype, or (unless `allow_non_finite`) a tensor read is not finite;
// ConfigError for formats 1 to 3 when the number of stages differs. Optimizer and generator
// states are not loaded, and not checked.
void load_stage_weights(const std::string& dir, const std::vector<const PipelineStage*>& stages,
                        bool allow_non_finite = false);

// One file of a checkpoint as verify_checkpoint found it.
struct CheckpointFileCheck {
  std::string file;     // its path
  uint64_t bytes = 0;   // read
  std::string problem;  // empty: byte for byte the file the manifest recorded
};

// Not collective: reads every file the manifest of the checkpoint in `dir` records, whole, and
// checks its size and SHA-256 against the record and (format 4) that it holds every piece the
// index puts in it, of its dtype and size. One entry per file, in name order; a file that is
// missing, damaged or replaced has its `problem`. PipelineError when `dir` is incomplete or its
// manifest is damaged (the manifest itself cannot be checked against anything else); format 1
// records no digests: ConfigError.
std::vector<CheckpointFileCheck> verify_checkpoint(const std::string& dir);

}  // namespace pipemat::pp
