// The config's keys: one entry per key (Note [Config field table] in config_fields.h), in
// document order, with the codec that reads and writes it and its row of docs/config.md.

#include "config_fields.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "pipemat/core/parse.h"
#include "pipemat/models/model.h"

namespace pipemat::train::config_detail {
namespace {

// Upper bounds of sizes: a typo must be a config error naming the key, never a crash in the
// allocator. Together with the weight and activation limits of check_consistency they keep
// every model the zoo builds inside this kind of machine.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxWidth = 65536;  // hidden, ffn, heads
constexpr int64_t kMaxTokens = 1 << 20;
constexpr int64_t kMaxVocab = int64_t{1} << 22;  // above every released vocabulary (152k)
constexpr int64_t kMaxExperts = 1024;
constexpr double kMaxRate = 1e6;  // learning rate (float32 optimizers overflow far above)
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// The member of a (const or mutable) TrainConfig at `path`, for the codecs of config_fields.h.
#define PIPEMAT_MEMBER(path) \
  [](auto& c) -> auto& { return c.path; }

// Enum spellings come from the modules that own the enums, so a rename there shows up here.
std::vector<schedule::ScheduleKind> schedule_kinds() {
  // kImported is read from a torch CSV, not configurable by name.
  return {schedule::ScheduleKind::kGPipe,        schedule::ScheduleKind::kOneFOneB,
          schedule::ScheduleKind::kInterleaved,  schedule::ScheduleKind::kZeroBubbleH1,
          schedule::ScheduleKind::kZeroBubbleH2, schedule::ScheduleKind::kZeroBubbleV};
}
std::vector<schedule::RecomputeMode> recompute_modes() {
  return {schedule::RecomputeMode::kNone, schedule::RecomputeMode::kLazy,
          schedule::RecomputeMode::kPretrigger};
}
std::vector<comm::TransportKind> transport_kinds() {
  return {comm::TransportKind::kAuto, comm::TransportKind::kMpi, comm::TransportKind::kTcp,
          comm::TransportKind::kLocal};
}

std::vector<comm::LaneKind> lane_kinds() { return {comm::LaneKind::kNone, comm::LaneKind::kNccl}; }

// model: the model kind and its shape.
std::vector<ConfigField> model_fields() {
  return {
      {"model", "kind", choice(PIPEMAT_MEMBER(model.kind), models::model_kind_values()),
       "`gpt`, `llama`, `mlp`, `rmsnorm-gemm`, `transformer`, `moe`, `save-chain`",
       "model (gpt, llama: byte-level language models on `data`) or zoo layer kind"},
      {"model", "layers", integer(PIPEMAT_MEMBER(model.layers), 1, kMaxLayers), ">= 1",
       "number of layers (gpt, llama: decoder blocks)"},
      {"model", "hidden", integer(PIPEMAT_MEMBER(model.hidden), 1, kMaxWidth),
       ">= 1; a multiple of `heads` for `transformer`, `gpt` and `llama`", "hidden size"},
      {"model", "tokens", integer(PIPEMAT_MEMBER(model.tokens), 1, kMaxTokens), ">= 1",
       "tokens (rows) per micro-batch"},
      {"model", "heads", integer(PIPEMAT_MEMBER(model.heads), 1, kMaxWidth), ">= 1",
       "attention heads (`transformer`, `gpt`, `llama`: query heads; for `llama` hidden / heads "
       "is even)"},
      {"model", "ffn", integer(PIPEMAT_MEMBER(model.ffn), 0, kMaxWidth), ">= 0",
       "inner size of `mlp` / `transformer` / `gpt` / `llama` MLPs; `0` means 4 * hidden"},
      {"model", "experts", integer(PIPEMAT_MEMBER(model.experts), 1, kMaxExperts), ">= 1",
       "experts per layer (`moe`)"},
      {"model", "top_k", integer(PIPEMAT_MEMBER(model.top_k), 1, kMaxExperts),
       ">= 1; <= `experts` for `moe`", "experts per token (`moe`)"},
      {"model", "seq_len", integer(PIPEMAT_MEMBER(model.seq_len), 1, kMaxTokens), ">= 1",
       "bytes per sequence (`gpt`, `llama`; the position table's size and the sampling context)"},
      {"model", "batch", integer(PIPEMAT_MEMBER(model.batch), 1, kMaxTokens), ">= 1",
       "sequences per micro-batch (`gpt`, `llama`)"},
      {"model", "vocab", integer(PIPEMAT_MEMBER(model.vocab), models::kByteVocab, kMaxVocab),
       "256 .. 4194304",
       "token ids of the embedding and the head (`gpt`, `llama`; `model.from` sets it from "
       "`vocab_size`): the text's bytes are its first 256 ids, so at least 256; a larger "
       "vocabulary's other ids are rows no byte uses (the ids `generate` samples stay bytes)"},
      {"model", "dropout", number(PIPEMAT_MEMBER(model.dropout), 0, false, 0.9), "0 .. 0.9",
       "dropout after the embedding and on both residual branches of every block (`gpt`); with "
       "dropout every rank draws per (step, micro-batch, stage) streams, so the pipeline equals a "
       "single-process run bitwise; `llama` has none (0 only)"},
      {"model", "kv_heads", integer(PIPEMAT_MEMBER(model.kv_heads), 0, kMaxWidth),
       ">= 0; `heads` a multiple of it",
       "key/value heads of `llama`'s grouped-query attention; `0` means `heads`"},
      {"model", "rope_theta", number(PIPEMAT_MEMBER(model.rope_theta), 0, true, 1e12),
       "> 0 .. 1e12", "base of `llama`'s rotary embedding: inv_freq = 1 / theta^(2i / head size)"},
      {"model", "norm_eps", number(PIPEMAT_MEMBER(model.norm_eps), 0, true, 1), "> 0 .. 1",
       "epsilon of `llama`'s RMSNorms (computed in float32, as Hugging Face's LlamaRMSNorm)"},
      {"model", "tie_embeddings", boolean(PIPEMAT_MEMBER(model.tie_embeddings)), "",
       "`llama`: the head multiplies by the embedding's weight (no head of its own); across "
       "stages the last stage holds a copy whose gradient is summed with the first stage's "
       "every step, so both stay equal"},
      {"model", "from", text(PIPEMAT_MEMBER(model.from), "a directory with a config.json"),
       "a directory; `llama` only",
       "read the `llama` shape from a Hugging Face `config.json` there, as transformers' "
       "LlamaConfig reads it (docs/training.md): it sets layers, hidden, heads, kv_heads, ffn, "
       "vocab (from `vocab_size`), rope_theta (from `rope_theta` or, as transformers 5 writes "
       "it, `rope_parameters.rope_theta`), norm_eps, tie_embeddings and caps seq_len at "
       "max_position_embeddings; those keys must not be given too; `model_type: llama` and the "
       "shape are required, other fields absent take LlamaConfig's defaults (vocab_size "
       "32000); a key twice, NaN, a vocab_size below 256, a `rope_scaling` or a "
       "`rope_type` other than `default`, biases, an activation other than silu, attention "
       "dropout or a pad_token_id are errors naming the field; empty: none"},
  };
}

// data: the text or tokens of gpt and llama.
std::vector<ConfigField> data_fields() {
  return {
      {"data", "path",
       text(PIPEMAT_MEMBER(data.path),
            "a text file or a directory of text files, e.g. /usr/share/games/fortunes"),
       "a regular text file or a directory of them, at most 1 GiB in all; required for `gpt` and "
       "`llama`",
       "the text, e.g. `/usr/share/games/fortunes` (Debian's `fortunes` package)"},
      {"data", "validation", number(PIPEMAT_MEMBER(data.validation), 0, true, 0.5), "> 0 .. 0.5",
       "fraction of the text held out for the validation loss (of the documents, when indexed)"},
      {"data", "format", choice(PIPEMAT_MEMBER(data.format), data_format_values()),
       "`text`, `indexed`",
       "`text`: `data.path` is text, trained on as bytes, or as token ids with `data.tokenizer`; "
       "`indexed`: `data.path` is the prefix of a Megatron indexed dataset (PREFIX.bin + "
       "PREFIX.idx, e.g. written by `pipemat prepare`) of token ids below `model.vocab`"},
      {"data", "tokenizer",
       text(PIPEMAT_MEMBER(data.tokenizer),
            "a tokenizer.json, a SentencePiece .model or a directory holding one"),
       "a path, or empty",
       "the tokenizer of the text and of `pipemat generate`: a Hugging Face `tokenizer.json` "
       "(byte-level BPE) or a SentencePiece `.model`; its ids must be below `model.vocab`; empty: "
       "bytes (with `model.from`, the tokenizer found in that directory)"},
  };
}

// partition: the layers of each stage.
std::vector<ConfigField> partition_fields() {
  return {
      {"partition", "layers_per_stage", layer_split_codec(),
       "`auto`, or entries >= 1 summing to `model.layers`",
       "layers of each model stage in order; empty: contiguous ranges balanced by parameter "
       "count; `auto`: the contiguous split whose simulated step is shortest, from a profile of "
       "the layers, the embedding, the head and the loss in the run's precision and remat policy, "
       "taken before the run starts (Note [Split by cost], docs/performance.md)"},
      {"partition", "memory_budget", memory_budget_codec(),
       "sizes > 0 (e.g. `2GiB`, `512MiB`, bytes), one for every rank or one per rank; only with "
       "`layers_per_stage: auto`",
       "the bytes each rank may hold: `auto` takes the fastest split whose predicted peak "
       "(weights, gradients, optimizer state and the schedule's activations) fits on every rank, "
       "and an error naming the closest split when none does; empty: no budget"},
  };
}

// schedule: the pipeline schedule.
std::vector<ConfigField> schedule_fields() {
  return {
      {"schedule", "kind", choice(PIPEMAT_MEMBER(schedule.kind), schedule_kinds()),
       "`gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zb-h2`, `zb-v`",
       "pipeline schedule (see docs/schedules.md)"},
      {"schedule", "ranks", integer(PIPEMAT_MEMBER(schedule.ranks), 1, kIntMax), "1 .. 2147483647",
       "pipeline ranks P; must equal the number of processes. Formerly `schedule.stages`, which is "
       "still read with a warning (giving both is an error)",
       "", "stages"},
      {"schedule", "micro_batches", integer(PIPEMAT_MEMBER(schedule.micro_batches), 1, kIntMax),
       "1 .. 2147483647", "micro-batches M per step"},
      {"schedule", "virtual_stages", integer(PIPEMAT_MEMBER(schedule.virtual_stages), 1, kIntMax),
       "1 .. 2147483647", "model stages per rank for `interleaved`; `zb-v` always uses 2"},
      {"schedule", "recompute", choice(PIPEMAT_MEMBER(schedule.recompute), recompute_modes()),
       "`none`, `lazy`, `pretrigger`",
       "where checkpointed stages replay: not at all, inside their backward, or as an R action of "
       "their own ahead of the gradient"},
      {"schedule", "csv",
       text(PIPEMAT_MEMBER(schedule_csv),
            "the path of a torch.distributed.pipelining CSV schedule, e.g. \"my-schedule.csv\""),
       "a regular file of at most 1 GiB",
       "a torch.distributed.pipelining CSV schedule (one row per rank, compute-only or with "
       "SEND/RECV cells) that replaces the generated one: its rows set the ranks, its actions the "
       "stages and micro-batches (`kind`, `ranks`, `micro_batches`, `virtual_stages` are taken "
       "from it); `recompute` still places R actions unless the file has them. UNSHARD / RESHARD / "
       "REDUCE_GRAD cells are accepted as no-ops and reported once"},
  };
}

// parallel: data parallelism over pipeline replicas.
std::vector<ConfigField> parallel_fields() {
  return {
      {"parallel", "data", integer(PIPEMAT_MEMBER(parallel.data), 1, 1024), "1 .. 1024",
       "data-parallel replicas D of the pipeline: the job has D x `schedule.ranks` ranks, a step "
       "D x `schedule.micro_batches` micro-batches (each replica its share), and every replica "
       "ends the step with the mean gradient of all of them"},
      {"parallel", "bucket_bytes",
       integer(PIPEMAT_MEMBER(parallel.bucket_bytes), 1, int64_t{1} << 40), "1 .. 2^40",
       "with `parallel.data` above 1: the size of the gradient messages of a stage's data group "
       "(whole parameters, about this many bytes each; 26214400 = 25 MiB); a stage's messages "
       "leave when its last backward of the step ends and overlap the rest of the step"},
      {"parallel", "weight_tail", boolean(PIPEMAT_MEMBER(parallel.weight_tail)), "",
       "with `parallel.data` above 1 and a split backward (zb-h1, zb-h2, zb-v): the W actions "
       "that end a rank's step run bucket by bucket over their micro-batches (the gradients of "
       "every micro-batch still added in schedule order), so a stage's first buckets leave while "
       "the rest computes; `false`: one W after the other, every bucket at the end"},
      {"parallel", "shard_optimizer", boolean(PIPEMAT_MEMBER(parallel.shard_optimizer)), "",
       "with `parallel.data` above 1: each replica owns 1/D of the elements of every gradient "
       "bucket (up to one element) and keeps the optimizer state of those only; the gradients "
       "are reduce-scattered to their owners and the updated parameters gathered after the step "
       "(bitwise the unsharded run); needs an elementwise optimizer (sgd, adamw); each replica "
       "writes its own optimizer shard into checkpoints; the run summary gives each rank's "
       "parameter, gradient and optimizer-state bytes"},
  };
}

// remat: the recompute policy, with the keys of its list entries.
std::vector<ConfigField> remat_fields() {
  return {
      {"remat", "policy", choice(PIPEMAT_MEMBER(remat.policy), models::remat_policy_values()),
       "`none`, `full`, `selective`, `custom`",
       "`none`: no checkpoint; `full`: every layer a checkpoint unit; `selective`: every layer a "
       "unit with the model kind's GEMM-like member saved (rmsnorm-gemm: `gemm`; moe: `experts`; "
       "transformer: `attn.qkv`, `mlp.up`; gpt: `attn.qkv`, `mlp.up`; llama: "
       "`self_attn.{q,k,v}_proj`, `mlp.{gate,up}_proj`, so the norms feeding them are rederived; "
       "mlp: `up`; save-chain: the chain); `custom`: the lists below"},
      {"remat", "early_stop", boolean(PIPEMAT_MEMBER(remat.early_stop)), "",
       "stop a replay once every tensor the backward needs exists again"},
      {"remat", "checkpoint", pattern_list(),
       "non-empty patterns; only with `policy: custom`, which needs at least one",
       "checkpoint units"},
      {"remat", "exclude", exclude_list(), "only with `policy: custom`",
       "SAVE regions inside the units, each `{path: ..., save_output: ...}`"},
      {"remat.exclude[]", "path", list_entry_key("string"), "a non-empty pattern",
       "the module run once and kept in replay", "(required)"},
      {"remat.exclude[]", "save_output", list_entry_key("boolean"), "",
       "cache the region's output for replay; `false` keeps only placeholders, for an output that "
       "goes whole into the next SAVE region",
       "`true`"},
      {"remat", "stages", stage_list(),
       "one entry per model stage (`schedule.ranks` x chunks per rank: 2 for `zb-v`, "
       "`virtual_stages` for `interleaved`): a policy name, or a mapping with the keys below",
       "a policy per stage instead of `remat.policy` on every stage, e.g. `[selective, none]`: the "
       "first stage of a 1F1B pipeline holds P micro-batches in flight, the last one. A mapping is "
       "the stage's own custom policy, e.g. a choice per layer from `pipemat plan --out`"},
      {"remat.stages[]", "checkpoint", list_entry_key("list of strings"),
       "non-empty patterns, relative to the stage", "the stage's checkpoint units", "(required)"},
      {"remat.stages[]", "exclude", list_entry_key("list of mappings"),
       "entries as in `remat.exclude`", "the stage's SAVE regions", "`[]`"},
  };
}

// transport: how the ranks talk.
std::vector<ConfigField> transport_fields() {
  return {
      {"transport", "kind", choice(PIPEMAT_MEMBER(transport.kind), transport_kinds()),
       "`auto`, `mpi`, `tcp`, `local`",
       "`auto`: mpi under mpirun, tcp when `PIPEMAT_MASTER` is set"},
      {"transport", "lane", choice(PIPEMAT_MEMBER(transport.lane), lane_kinds()), "`none`, `nccl`",
       "`nccl`: the tensors of ranks on GPUs go GPU to GPU over NCCL (needs `training.device` "
       "cuda, one GPU per rank and a build with NCCL); `none`: through host memory"},
      {"transport", "timeout", timeout_codec(), "0 .. 31536000, fractions down to 0.001",
       "deadline of every wait and of the tcp rendezvous; `0`: `PIPEMAT_COMM_TIMEOUT` or 300 s"},
      {"transport", "master", master_codec(), "`host:port` with a port in 1 .. 65535, or empty",
       "tcp rendezvous address of rank 0; empty: `PIPEMAT_MASTER`"},
      {"transport", "connect_retries",
       integer(PIPEMAT_MEMBER(transport.connect_retries), 1, kIntMax), "1 .. 2147483647",
       "tcp connection attempts before giving up"},
  };
}

// training: the optimizer, its schedule, threads and evaluation.
std::vector<ConfigField> training_fields() {
  return {
      {"training", "steps", integer(PIPEMAT_MEMBER(training.steps), 1), ">= 1", "optimizer steps"},
      {"training", "optimizer", choice(PIPEMAT_MEMBER(training.optimizer), optimizer_values()),
       "`sgd`, `adamw`", "LibTorch optimizer"},
      {"training", "lr", number(PIPEMAT_MEMBER(training.lr), 0, true, kMaxRate), "> 0",
       "learning rate"},
      {"training", "momentum", number(PIPEMAT_MEMBER(training.momentum), 0, false), ">= 0",
       "SGD momentum"},
      {"training", "weight_decay", number(PIPEMAT_MEMBER(training.weight_decay), 0, false), ">= 0",
       "weight decay (SGD and AdamW)"},
      {"training", "clip_grad_norm", number(PIPEMAT_MEMBER(training.clip_grad_norm), 0, false),
       ">= 0",
       "clip the gradients by their global L2 norm over all pipeline ranks (as "
       "`torch::nn::utils::clip_grad_norm_` over the whole model); `0`: no clipping"},
      {"training", "seed", unsigned_integer(PIPEMAT_MEMBER(training.seed)),
       "0 .. 18446744073709551615", "seed of parameters, data windows and dropout"},
      {"training", "threads", integer(PIPEMAT_MEMBER(training.threads), 0, 1024),
       "0 to 1024, at most 4 per hardware thread of the machine",
       "compute threads per rank: LibTorch's intra-op threads (OpenMP's and MKL's); `0`: the "
       "machine's hardware threads divided by the ranks on it (at least 1). The first progress "
       "line says which LibTorch and BLAS run and with how many threads"},
      {"training", "thread_probe", boolean(PIPEMAT_MEMBER(training.thread_probe)), "",
       "when a rank would compute with more than 1 thread: first time one micro-batch's forward "
       "and backward with 1 thread and with those threads (alternately, 3 rounds each) and keep "
       "the faster, so that more threads never run slower than one; the first progress line "
       "gives both times. `false`: the threads as asked, unmeasured"},
      {"training", "warmup", integer(PIPEMAT_MEMBER(training.warmup), 0), ">= 0",
       "steps of linear warmup: step t uses lr * (t + 1) / warmup"},
      {"training", "lr_decay", choice(PIPEMAT_MEMBER(training.lr_decay), lr_decay_values()),
       "`none`, `cosine`",
       "after the warmup: a constant lr, or a cosine from `lr` to `min_lr` at the last step"},
      {"training", "min_lr", number(PIPEMAT_MEMBER(training.min_lr), 0, false, kMaxRate),
       "0 .. `lr`", "the cosine's end"},
      {"training", "eval_every", integer(PIPEMAT_MEMBER(training.eval_every), 0),
       ">= 0; `gpt` and `llama` only",
       "validation loss (forward only, eval mode) after every this many steps and after the last; "
       "`0`: none"},
      {"training", "eval_batches", integer(PIPEMAT_MEMBER(training.eval_batches), 1, 1 << 20),
       "1 .. 1048576", "validation micro-batches per evaluation (the same windows every time)"},
      {"training", "stop_after", integer(PIPEMAT_MEMBER(training.stop_after), 0), ">= 0",
       "stop this process after this many steps (with a checkpoint when `checkpoint.dir` is set) "
       "while the LR schedule and the evaluations still span `training.steps`: an interruption on "
       "purpose that `--resume` continues (`pipemat train --stop-after N`); `0`: run to "
       "`training.steps`"},
      {"training", "precision", choice(PIPEMAT_MEMBER(training.precision), precision_values()),
       "`fp32`, `bf16`",
       "`bf16`: every stage forward runs under autocast to bf16 (on the rank's device type), a "
       "region of its own per forward; stage outputs cross ranks as bf16; parameters, gradients, "
       "the data-parallel exchange, clipping, the optimizer and the loss stay float32; remat "
       "replays under the autocast state of its forward. The first progress line names it"},
      {"training", "allow_non_finite", boolean(PIPEMAT_MEMBER(training.allow_non_finite)), "",
       "`false`: a NaN or an infinity in a loaded weight (a checkpoint's tensor, "
       "`training.init_from`, what `generate` and `export` read) is refused naming the file, the "
       "tensor and the index, and so is one in the weights before the first step; a step whose "
       "loss or clipped gradient norm is not finite (nan, inf) stops the run at that step with "
       "exit code 6, before the step's checkpoint; the last complete checkpoint stays. `true`: "
       "load such weights and train on (experiments with divergence)"},
      {"training", "device", text(PIPEMAT_MEMBER(training.device), "cpu, cuda or cuda:N"),
       "`cpu`, `cuda`, `cuda:N`",
       "where each rank computes: its stages, inputs, targets, received tensors and optimizer "
       "state. `cuda`: the rank's own GPU (its index among its host's ranks, modulo the GPUs "
       "it sees); needs a pipemat built with CUDA (docs/gpu.md)"},
      {"training", "init_from",
       text(PIPEMAT_MEMBER(training.init_from), "a .safetensors file or a directory (empty: none)"),
       "a file or directory",
       "start from these weights instead of the seed's: a safetensors file (`pipemat export` "
       "writes one) or a directory with `model.safetensors.index.json`. It must hold exactly the "
       "model's parameters by their single-process names (one error lists every missing, extra "
       "or mis-shaped tensor); any dtype is converted; each rank reads only its stages' tensors. "
       "A run that resumes (`--resume`) loads its checkpoint instead; empty: none"},
  };
}

// checkpoint: saving and resuming.
std::vector<ConfigField> checkpoint_fields() {
  return {
      {"checkpoint", "dir",
       text(PIPEMAT_MEMBER(checkpoint.dir), "a directory (empty: no checkpoints)"), "a directory",
       "where checkpoints are written and `latest` is looked up; empty: no checkpoints"},
      {"checkpoint", "every", integer(PIPEMAT_MEMBER(checkpoint.every), 0), ">= 0",
       "save after every this many steps (and after the last); `0`: only after the last (with a "
       "dir)"},
      {"checkpoint", "keep_last", integer(PIPEMAT_MEMBER(checkpoint.keep_last), 0, 1000000),
       "0 to 1000000",
       "keep the newest this many complete checkpoints of this run (the one just written always "
       "among them); `0`: all"},
      {"checkpoint", "resume",
       text(PIPEMAT_MEMBER(checkpoint.resume), "a step-NNNNNN directory or latest (empty: step 0)"),
       "a step directory or `latest`",
       "continue from there (`--resume`), on any layout: another `schedule.ranks`, "
       "`partition.layers_per_stage`, `schedule.kind` or virtual stages, `parallel.data`, "
       "`parallel.shard_optimizer` or transport (the first line says `resharded from ... to "
       "...`); the model, the micro-batches per step (`schedule.micro_batches` x `parallel.data`) "
       "and `training.seed` must be the checkpoint's (checkpoints of pipemat before format 4 "
       "resume on their own layout only); empty: step 0"},
      {"checkpoint", "overwrite", boolean(PIPEMAT_MEMBER(checkpoint.overwrite)), "",
       "a run that does not resume into a `dir` that holds checkpoints (another run's) is refused "
       "before training; `true`: remove them (step directories only) and start there"},
  };
}

// sample: the text generated after training (gpt).
std::vector<ConfigField> sample_fields() {
  return {
      {"sample", "tokens", integer(PIPEMAT_MEMBER(sample.tokens), 0, kMaxTokens),
       "0 .. 1048576; > 0 needs `checkpoint.dir` and `gpt` or `llama`",
       "bytes to generate; `0`: no sample"},
      {"sample", "prompt", text(PIPEMAT_MEMBER(sample.prompt), "the text the sample continues"), "",
       "the text the sample continues"},
      {"sample", "temperature", number(PIPEMAT_MEMBER(sample.temperature), 0, true, 100),
       "> 0 .. 100", "softmax temperature"},
      {"sample", "top_k", integer(PIPEMAT_MEMBER(sample.top_k), 0, 256), "0 .. 256",
       "sample among the k most likely bytes; `0`: all"},
      {"sample", "seed", unsigned_integer(PIPEMAT_MEMBER(sample.seed)), "0 .. 18446744073709551615",
       "seed of the sampling generator"},
  };
}

// output: metrics, pictures and progress.
std::vector<ConfigField> output_fields() {
  return {
      {"output", "metrics",
       text(PIPEMAT_MEMBER(output.metrics), "a file path (empty: no metrics file)"), "a path",
       "JSON lines, one per step (with `val_loss` after an evaluation), written by the last "
       "stage's rank; empty: none. A resumed run appends to it"},
      {"output", "timeline_svg",
       text(PIPEMAT_MEMBER(output.timeline_svg), "a file path (empty: no timeline)"), "a path",
       "measured timeline of the last step (all ranks); next to it `<name>.predicted.svg`, the "
       "simulator's timeline with the measured mean action costs; empty: none"},
      {"output", "trace", text(PIPEMAT_MEMBER(output.trace), "a file path (empty: no trace)"),
       "a path",
       "every step of every rank of the job (every replica's with parallel.data) as Chrome "
       "trace-event JSON, which "
       "Perfetto and chrome://tracing open: per rank a compute, a communication, a data-parallel "
       "and a step track, each action with its stage, micro-batch and bytes, and the simulated "
       "timeline as one more process; empty: none (docs/performance.md)"},
      {"output", "loss_svg",
       text(PIPEMAT_MEMBER(output.loss_svg), "a file path (empty: no loss curve)"), "a path",
       "the loss curve: train loss of every step and validation loss of every evaluation against "
       "the step; empty: none"},
      {"output", "progress", boolean(PIPEMAT_MEMBER(output.progress)), "",
       "one human-readable line per step on stdout (loss, tokens/s, step time, bubble, peak "
       "memory, percent done, ETA, remat counters) and one per evaluation"},
      {"output", "reference_steps", integer(PIPEMAT_MEMBER(output.reference_steps), 0, 1000000),
       "0 .. 1000000",
       "after training, the last stage's rank runs this many steps of the same model in one "
       "process (`pipemat train --reference`, the ranks' threads) and the run summary compares "
       "the pipeline's tokens/s and peak memory per rank with it; `0`: the summary without it"},
  };
}

std::vector<ConfigField> make_fields() {
  std::vector<ConfigField> fields;
  for (const auto& section :
       {model_fields, data_fields, partition_fields, schedule_fields, parallel_fields, remat_fields,
        transport_fields, training_fields, checkpoint_fields, sample_fields, output_fields}) {
    std::vector<ConfigField> keys = section();
    fields.insert(fields.end(), std::make_move_iterator(keys.begin()),
                  std::make_move_iterator(keys.end()));
  }
  return fields;
}

#undef PIPEMAT_MEMBER

}  // namespace

const std::vector<ConfigField>& config_fields() {
  static const std::vector<ConfigField> kFields = make_fields();
  return kFields;
}

const Names& section_names() {
  static const Names kNames = [] {
    Names names;
    for (const ConfigField& field : config_fields()) {
      if (!field.in_list_entry() && !contains(names, field.section)) names.push_back(field.section);
    }
    return names;
  }();
  return kNames;
}

const Names& section_keys(const std::string& section) {
  static const std::map<std::string, Names> kKeys = [] {
    std::map<std::string, Names> keys;
    for (const ConfigField& field : config_fields()) keys[field.section].push_back(field.name);
    return keys;
  }();
  const auto it = kKeys.find(section);
  PIPEMAT_INTERNAL_ASSERT(it != kKeys.end(), "no config section '", section, "'");
  return it->second;
}

const std::map<std::string, std::string>& section_aliases(const std::string& section) {
  static const std::map<std::string, std::map<std::string, std::string>> kAliases = [] {
    std::map<std::string, std::map<std::string, std::string>> aliases;
    for (const ConfigField& field : config_fields()) {
      aliases[field.section];
      if (!field.alias.empty()) aliases[field.section][field.alias] = field.name;
    }
    return aliases;
  }();
  const auto it = kAliases.find(section);
  PIPEMAT_INTERNAL_ASSERT(it != kAliases.end(), "no config section '", section, "'");
  return it->second;
}

const ConfigField* find_field(const std::string& section, const std::string& name) {
  for (const ConfigField& field : config_fields()) {
    if (field.section == section && (field.name == name || field.alias == name)) return &field;
  }
  return nullptr;
}

}  // namespace pipemat::train::config_detail
