#pragma once
// Options of a pipeline training run: one struct per concern, filled from YAML (config.h) or
// built directly by tests. Plain values with defaults; validated by load_config / the runtime.

#include <cstdint>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/remat/policy.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::models {

// The model: a stack of `layers` identical layers of one kind from the model zoo, fed with
// synthetic data (fixed seeds, no downloads). Input and target of a micro-batch are
// [tokens, hidden]; the loss is the mean squared error on the last stage.
struct ModelOptions {
  std::string kind = "rmsnorm-gemm";  // mlp | rmsnorm-gemm | transformer | moe | save-chain
  int64_t layers = 8;
  int64_t hidden = 64;
  int64_t tokens = 32;  // tokens (rows) per micro-batch
  int64_t heads = 4;    // transformer
  int64_t ffn = 0;      // mlp / transformer inner size; 0 = 4 * hidden
  int64_t experts = 4;  // moe
  int64_t top_k = 2;    // moe
};

// How layers map to stages. `layers_per_stage` empty: balanced by parameter count (contiguous
// ranges, as equal as the layer sizes allow); otherwise one entry per stage, summing to
// model.layers. The number of stages is schedule.stages * schedule.virtual_stages (2 per rank
// for zb-v); stage s runs on the rank the schedule's stage_to_rank gives.
struct PartitionOptions {
  std::vector<int64_t> layers_per_stage;
};

// Which modules recompute. `none`: no checkpoint. `full`: every layer a checkpoint unit.
// `selective`: every layer a checkpoint unit with the model kind's GEMM-like member a SAVE region
// (rmsnorm-gemm: gemm; moe: experts; transformer: attn.qkv and mlp.up; mlp: up; save-chain: the
// chain). `custom`: the `checkpoint` / `exclude` paths given (paths relative to a stage, e.g.
// "layers.*" and "layers.*.gemm").
struct RematConfig {
  std::string policy = "selective";  // none | full | selective | custom
  remat::RematPolicy custom;          // used with policy == "custom"
  bool early_stop = true;
};

struct TrainingOptions {
  int64_t steps = 5;
  std::string optimizer = "sgd";  // sgd | adamw
  double lr = 0.01;
  double momentum = 0.0;       // sgd
  double weight_decay = 0.0;   // sgd, adamw
  double clip_grad_norm = 0.0; // global L2 norm over all ranks; 0: no clipping
  uint64_t seed = 0;
  int64_t threads = 0;  // compute threads per rank (LibTorch and OpenBLAS); 0: cores / ranks
};

struct OutputOptions {
  std::string metrics;        // JSON lines path, written by the last stage's rank; empty: none
  std::string timeline_svg;   // measured timeline of the last step; empty: none
  bool progress = true;       // one human-readable line per step on stdout
};

// Checkpoints of the pipeline run (pp/checkpoint.h): `every` steps (0: never) and after the last
// step, under `dir`, keeping the newest `keep_last` (0: all). `resume`: a step-NNNNNN directory
// or "latest" (the newest complete checkpoint under `dir`); empty: start from step 0.
struct CheckpointOptions {
  std::string dir;
  int64_t every = 0;
  int64_t keep_last = 0;
  std::string resume;
};

struct TrainConfig {
  ModelOptions model;
  PartitionOptions partition;
  schedule::ScheduleOptions schedule;  // kind, stages (= ranks), micro_batches, virtual_stages,
                                       // recompute (none | lazy | pretrigger)
  std::string schedule_csv;            // schedule.csv: a torch CSV action list replacing the
                                       // generated schedule (kind, stages, micro-batches)
  RematConfig remat;
  comm::TransportOptions transport;    // kind (auto | mpi | tcp | local), timeout, tcp rendezvous
  TrainingOptions training;
  CheckpointOptions checkpoint;
  OutputOptions output;
};

}  // namespace pipemat::models
