#pragma once
// What a checkpoint's manifest.json says (Note [Checkpoint layout] in pipemat/pp/checkpoint.h).
// Without LibTorch: the manifest is read and checked before any tensor is.

#include <cstdint>
#include <string>
#include <vector>

namespace pipemat::pp {

struct CheckpointManifest {
  int format = 0;  // 1: no digests of the rank files; 2: with them; 3: sharded optimizer
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
};

}  // namespace pipemat::pp
