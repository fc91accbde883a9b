#pragma once
// Options of a pipeline training run: one struct per concern, filled from YAML (config.h) or
// built directly by tests. Plain values with defaults; validated by load_config / the runtime.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/models/model.h"
#include "pipemat/pp/precision.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::train {

// training.optimizer and training.lr_decay are spelled as words, like the model's choices
// (pipemat/models/model.h): to_string, parse_* (nullopt for any other text) and the *_values()
// lists in the order messages and docs list them.
enum class OptimizerKind { kSgd, kAdamW };
enum class LrDecay { kNone, kCosine };
enum class DataFormat { kText, kIndexed };  // data.format

const char* to_string(OptimizerKind optimizer);  // sgd | adamw
const char* to_string(LrDecay decay);            // none | cosine
const char* to_string(DataFormat format);        // text | indexed

std::optional<OptimizerKind> parse_optimizer(const std::string& text);
std::optional<LrDecay> parse_lr_decay(const std::string& text);

const std::vector<OptimizerKind>& optimizer_values();
const std::vector<LrDecay>& lr_decay_values();
const std::vector<DataFormat>& data_format_values();
const std::vector<pp::Precision>& precision_values();  // fp32 | bf16

// The text of a gpt model (text_data.h): a file or a directory of text files, of which the
// fraction `validation` (in 4 KiB blocks spread over the text) is held out for evaluation.
//
// data.format indexed: `path` is the prefix of a Megatron indexed dataset (PREFIX.bin and
// PREFIX.idx, pipemat/data/indexed_dataset.h) of token ids, split by documents. data.tokenizer: a
// tokenizer.json, a SentencePiece .model or a directory holding one (pipemat/data/tokenizer.h);
// text is then trained on as its token ids, and generate encodes and decodes with it. Without
// one, text is bytes (ids 0 .. 255).
struct DataOptions {
  std::string path;
  double validation = 0.05;
  DataFormat format = DataFormat::kText;
  std::string tokenizer;
};

struct TrainingOptions {
  int64_t steps = 5;
  OptimizerKind optimizer = OptimizerKind::kSgd;
  double lr = 0.01;
  double momentum = 0.0;        // sgd
  double weight_decay = 0.0;    // sgd, adamw
  double clip_grad_norm = 0.0;  // global L2 norm over all ranks; 0: no clipping
  uint64_t seed = 0;
  int64_t threads = 0;  // compute threads per rank (LibTorch, OpenMP, MKL); 0: cores / ranks
  // Above 1 thread: measure 1 thread against them first and keep the faster (Note [Threads are
  // measured, not assumed] in pp/compute.h); false: run the threads as asked.
  bool thread_probe = true;
  // Learning rate of step t: lr * (t + 1) / warmup during the first `warmup` steps, then
  // constant (lr_decay none) or a cosine from lr down to min_lr at the last step (cosine).
  int64_t warmup = 0;
  LrDecay lr_decay = LrDecay::kNone;
  double min_lr = 0.0;
  // Forward-only validation loss every `eval_every` steps and after the last (0: never), over
  // `eval_batches` micro-batches of the validation text (gpt; the same windows every time).
  int64_t eval_every = 0;
  int64_t eval_batches = 8;
  // Stop this process after step `stop_after` (1-based; 0: at training.steps), saving a
  // checkpoint when checkpoint.dir is set: a run interrupted on purpose, which `--resume`
  // continues. The LR schedule and the evaluations still follow training.steps.
  int64_t stop_after = 0;
  // Where each rank computes: cpu, cuda (the rank's own GPU: its index among the ranks of its
  // host, modulo the GPUs it sees) or cuda:N (pipemat/pp/device.h).
  std::string device = "cpu";
  // fp32, or bf16: each stage forward under autocast to bf16, parameters, gradients, optimizer
  // and loss in float32 (Note [Mixed precision] in pipemat/pp/precision.h).
  pp::Precision precision = pp::Precision::kFloat32;
  // false: a non-finite loss or clipped gradient norm stops the run (DivergedError in train.h);
  // true: the run trains on.
  bool allow_non_finite = false;
  // A safetensors file or directory to start from instead of the seed's weights
  // (pipemat/train/weights.h); a resumed run loads its checkpoint instead. Empty: none.
  std::string init_from;
};

// A text sample after training (gpt): the trained stages are loaded into one process from the
// final checkpoint and continue `prompt` by `tokens` bytes (0: no sample), drawn with
// `temperature` from the `top_k` most likely bytes (0: all) with a generator seeded by `seed`.
struct SampleOptions {
  int64_t tokens = 0;
  std::string prompt = "\n";
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 0;
  bool greedy = false;    // the most likely token each time (temperature and top_k unused)
  std::string tokenizer;  // generate's own; empty: the run's data.tokenizer
};

// Note [Data x pipeline] (pp/pipeline.h): `data` replicas of the pipeline, each over its own
// schedule.ranks ranks; the job has data x schedule.ranks ranks, rank w holding pipeline rank
// w / data of replica w % data.
struct ParallelOptions {
  int64_t data = 1;
  // Note [Overlapped gradient all-reduce] (pp/pipeline.h): gradient message size.
  int64_t bucket_bytes = int64_t{25} << 20;
  // Note [Weight tail] (pp/pipeline.h): a rank's trailing W actions run bucket by bucket.
  bool weight_tail = true;
  // Note [Sharded optimizer] (pp/pipeline.h): each replica keeps the optimizer state of its
  // share of the parameters.
  bool shard_optimizer = false;
};

struct OutputOptions {
  std::string metrics;       // JSON lines path, written by the last stage's rank; empty: none
  std::string timeline_svg;  // measured timeline of the last step; empty: none
  // Chrome trace-event JSON of every step (Note [Step trace] in pipemat/pp/trace.h), written by
  // the last stage's rank of replica 0; empty: none.
  std::string trace;
  std::string loss_svg;  // train (and validation) loss against the step; empty: none
  bool progress = true;  // one human-readable line per step on stdout
  // Steps of the single-process reference that the last stage's rank runs after training, for
  // the run summary's comparison (tokens/s, peak memory); 0: none.
  int64_t reference_steps = 0;
};

// Checkpoints of the pipeline run (pp/checkpoint.h): `every` steps (0: never) and after the last
// step, under `dir`, keeping the newest `keep_last` (0: all) of this run. `resume`: a
// step-NNNNNN directory or "latest" (the newest complete checkpoint under `dir`); empty: start
// from step 0. A run that does not resume refuses a `dir` holding checkpoints unless
// `overwrite`, which removes them first (docs/training.md, "Checkpoint directories").
struct CheckpointOptions {
  std::string dir;
  int64_t every = 0;
  int64_t keep_last = 0;
  std::string resume;
  bool overwrite = false;
};

struct TrainConfig {
  models::ModelOptions model;
  DataOptions data;
  models::PartitionOptions partition;
  // kind, stages (the YAML key schedule.ranks: pipeline ranks), micro_batches, virtual_stages,
  // recompute (none | lazy | pretrigger).
  schedule::ScheduleOptions schedule;
  std::string schedule_csv;  // schedule.csv: a torch CSV action list replacing the generated
                             // schedule (kind, ranks, micro-batches)
  ParallelOptions parallel;
  models::RematConfig remat;
  comm::TransportOptions transport;  // kind (auto | mpi | tcp | local), timeout, tcp rendezvous
  TrainingOptions training;
  CheckpointOptions checkpoint;
  SampleOptions sample;
  OutputOptions output;
  // What parse_config noticed without failing (a deprecated key, Note [Deprecated keys] in
  // config.h), one message each, located like an error ("x.yaml:3: schedule.stages: ...").
  // Commands print them to stderr as "pipemat: warning: ..."; nothing else reads them.
  std::vector<std::string> warnings;
};

}  // namespace pipemat::train
