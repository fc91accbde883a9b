#pragma once
// What a checkpoint's manifest.json says (Note [Checkpoint layout] in pipemat/pp/checkpoint.h).
// Without LibTorch: the manifest is read and checked before any tensor is.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pipemat::pp {

// Format 4 (Note [Checkpoint layout] in pipemat/pp/checkpoint.h): where one piece of a tensor
// lies: elements [begin, end) of the tensor's flat view, stored as the tensor `key` of `file`,
// whose bytes have the SHA-256 `sha256`.
struct CheckpointPiece {
  std::string file, key;
  int64_t begin = 0, end = 0;
  std::string sha256;
};

// Format 4: one tensor of the checkpoint by its global name (Note [Global names] in
// pipemat/pp/pipeline.h): a parameter or buffer ("model.layers.0.mlp.up_proj.weight"), a field of
// a parameter's optimizer state ("<parameter>:exp_avg", "<parameter>:step") or the generator
// state ("pipemat.rng"), with its dtype (safetensors' spelling: "F32", "BF16", "I64", "U8", ...),
// its whole shape, the stage that wrote it and its pieces, which cover its elements once, in
// order.
struct CheckpointTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  int stage = -1;  // -1: none (the generator state)
  std::vector<CheckpointPiece> pieces;
  int64_t numel() const;
};

// Format 2 and later: a file of the checkpoint as the manifest recorded it when it was written.
struct CheckpointFileRecord {
  std::string name;  // in the checkpoint's directory
  std::string sha256;
  uint64_t bytes = 0;
};

struct CheckpointManifest {
  int format = 0;  // 1: no digests of the rank files; 2: with them; 3: sharded optimizer;
                   // 4: every tensor by its global name
  int64_t step = 0;
  int world_size = 0;
  std::string schedule_kind;
  int stages = 0;
  int micro_batches = 0;
  std::vector<int> stage_to_rank;
  int replicas = 0;           // format 3: the replicas that each wrote an optimizer shard
  std::string metadata;       // save_checkpoint's `metadata`
  std::string run_id;         // "" when written before checkpoints named their run
  std::string config_digest;  // the run's
  std::vector<CheckpointFileRecord> files;  // format 2 and later, in name order
  // Format 4. replicas is the data degree that wrote it (sharded or not) and `sharded` whether
  // its optimizer state was split over the replicas; `optimizer` the optimizer's kind ("AdamW",
  // "Adam", "SGD", "RMSprop", "Adagrad"); `seed` the pipeline's (PipelineOptions::seed), "" for
  // none; `tensors` by name; `ties` each tie key (Note [Tied weights]) -> the name its weight
  // is stored under.
  bool sharded = false;
  std::string optimizer, seed;
  std::vector<CheckpointTensor> tensors;
  std::map<std::string, std::string> ties;
  // The tensor `name`, or null.
  const CheckpointTensor* find(const std::string& name) const;
};

}  // namespace pipemat::pp
