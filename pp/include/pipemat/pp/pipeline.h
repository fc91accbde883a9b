#pragma once
// pp's public headers, pp/include/pipemat/pp/:
//   pipeline.h    this file: Pipeline with its options, metrics and evaluation; stages from
//                 modules, callables and a split Sequential; forward_seed, stage_count.
//   checkpoint.h  save, find and resume checkpoints of a run on any layout, verify them, or
//                 load their weights into modules (Note [Checkpoint layout]).
//   tensor_dtype.h  LibTorch's scalar types as safetensors dtypes.
//   compute.h     compute threads, the BLAS in use, retain_freed_memory.
//   profile.h     the remat profiler: a layer's candidate policies, measured (for plan/).
//   reference.h   run_reference: every stage of a factory trained in one process, the
//                 pipeline's results bit for bit (Note [Single-process reference]).
//
// pp as a library: pipeline-train your own LibTorch model.
//
//   pipemat::pp::PipelineOptions options;
//   options.schedule = {schedule::ScheduleKind::kOneFOneB, /*ranks=*/2, /*micro_batches=*/4};
//   options.loss = [](const Tensors& out, const Tensors& target) {
//     return torch::cross_entropy_loss(out[0], target[0]);
//   };
//   options.optimizer = [](const std::vector<at::Tensor>& params) {
//     return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
//   };
//   options.clip_grad_norm = 1.0;
//   auto transport = comm::make_transport();               // mpirun / tcp / local
//   Pipeline pipe(*transport, options, [&](int stage) {    // only this rank's stages are built
//     return stage == 0 ? make_stage(stage, Embed(...)) : make_stage(stage, Head(...));
//   });
//   for (int64_t step = 0; step < steps; ++step) {
//     StepMetrics m = pipe.train_step([&](int64_t step, int64_t micro_batch) {
//       return MicroBatch{{ids(step, micro_batch)}, {targets(step, micro_batch)}};
//     });
//   }
//
// Stages. A stage is any module (for its parameters, buffers, train/eval mode and remat paths)
// plus a forward `Tensors -> Tensors`. make_stage adapts a module whose forward takes one tensor,
// 2-4 tensors or a std::vector<at::Tensor>, and returns a tensor, a std::tuple / std::pair of
// tensors or a std::vector<at::Tensor>; any other signature goes through a callable. The
// tensors a stage returns are the next stage's inputs in the same order; the first stage gets
// MicroBatch::inputs, the last stage's outputs go to the loss with MicroBatch::targets.
//
// Note [Stage boundary signature]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What a stage boundary carries: any number of tensors of any dtype (int64 ids, bool masks,
// float32 / bfloat16 activations); shapes may change from micro-batch to micro-batch and step
// to step (sequence length), and travel with the data. The number of tensors and their dtypes
// (the boundary's signature) are learned by both of its ranks from the first micro-batch that
// crosses the boundary and must stay the same: a stage that returns another count or dtype
// later gets a PipelineError on its own rank (naming the stage, step, micro-batch and both
// signatures), and the next stage's rank, which still receives the message, reports the same
// mismatch naming both ranks, so neither side hangs. A received tensor requires grad exactly
// when the sent one did; gradients flow back only for those (a mask gets none).
//
// Loss scaling. The user loss of micro-batch i is divided by the number of micro-batches M
// before backward, so the accumulated gradients are those of the mean of the micro-batch losses
// (for equal-sized micro-batches and a mean-reduced loss: the loss of the whole batch). The loss
// a step reports is that mean (the sum of the scaled losses in micro-batch order). A plain
// single-process loop that matches pipemat bitwise computes `(loss(out_i, t_i) / M).backward()`
// per micro-batch.
//
// Gradient clipping. clip_grad_norm > 0 clips by the global L2 norm over the parameters of all
// stages on all ranks, identical to torch::nn::utils::clip_grad_norm_ over the parameters of the
// whole model in stage order (every rank gathers every parameter's gradient norm, in stage
// order, and reduces them the same way clip_grad_norm_ does). With a sharded optimizer each
// norm comes from the replica holding the parameter's first element, the same bits (Note [Sharded
// optimizer]).
//
// Collectives and threading. train_step and evaluate are collective: every rank of the pipeline
// calls them, in the same order, with the same step. One thread drives one Pipeline; several
// Pipelines (ranks) may live in one process on local transports, one thread each. The
// transport must outlive the Pipeline. Errors: ConfigError (options that do not fit the
// transport or schedule), PipelineError (stage I/O, loss, batch), CommError / TimeoutError (a
// peer failed or went silent: the step is lost and the Pipeline should be destroyed), and
// whatever the user's forward, loss or data source throws (the peers then see this rank go away).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/precision.h"
#include "pipemat/remat/policy.h"
#include "pipemat/remat/stats.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::pp {

using Tensors = std::vector<at::Tensor>;

// The forward of one stage.
using StageForward = std::function<Tensors(const Tensors& inputs)>;

struct PipelineStage {
  int index = -1;                             // stage index in [0, stages)
  std::shared_ptr<torch::nn::Module> module;  // parameters, buffers, mode, remat paths
  StageForward forward;
  // Note [Tied weights]: parameters of this stage that are one weight with a parameter of
  // another stage (an embedding and the head that multiplies by it): the parameter's name in
  // module->named_parameters() -> a tie key, the same on every stage that holds a copy.
  std::map<std::string, std::string> tied;
  // Note [Global names]: the name of a parameter or buffer of this stage (its name in
  // module->named_parameters() / named_buffers()) in the whole model, by which checkpoints store
  // it. Unset: "stage<index>." + the name, which binds a checkpoint to this stage split.
  std::function<std::string(const std::string& name)> global_name;
  // Note [Random streams of a step]: the forward's random ops key their streams by layer
  // (remat::LayerStream), so the stream its forward starts from is the one of (seed, step,
  // micro-batch), the same for every stage that sets this (kLayerStream), not the stage's own.
  bool layer_streams = false;
};

// Note [Global names]
// ~~~~~~~~~~~~~~~~~~~
// A checkpoint (Note [Checkpoint layout] in pipemat/pp/checkpoint.h) stores every parameter,
// buffer and piece of optimizer state under the name the whole model gives it, not under its
// rank or stage, so it resumes on any stage split that holds the same names: another pipeline
// degree, layers_per_stage, schedule kind, virtual stages or data degree. A stage names its
// tensors with PipelineStage::global_name: split_sequential gives each entry's path in the whole
// Sequential ("3.weight" wherever entry 3 goes); `pipemat train`'s models give the names `pipemat
// export` writes ("model.layers.5.mlp.up_proj.weight" of a llama). A stage without one gets
// "stage<s>.<name>", which another split renames: such a checkpoint resumes where the stages
// keep their indices and contents. Two stages that give one name must hold copies of one tied
// weight (Note [Tied weights]); the weight is stored once.

// Note [Tied weights]
// ~~~~~~~~~~~~~~~~~~~
// One weight used by two stages (tied input and output embeddings: the first stage looks ids up
// in it, the last multiplies by it) lives as one copy per stage, each an ordinary parameter of
// its stage, declared in PipelineStage::tied under one key. At its first step the pipeline
// exchanges every rank's declarations: a key held by fewer than two stages, copies of another
// shape or dtype, or copies whose bytes differ (SHA-256) are a PipelineError on every rank,
// naming the key, the stages and their ranks. After each step's backward every holder of a key
// sends its gradient to the holders on other ranks (copies on one rank, as under ZB-V, are summed
// in place), and each sets the sum of all copies' gradients in stage order (a copy without a
// gradient adds nothing), before anything else touches the gradients: the data group's
// reduce (those stages post their buckets at the step's end, after the sum), clipping and the
// step. So every copy holds the same gradient bits, the global norm counts the weight once (the
// copy on the lowest stage; the others are left out of it), and a per-element optimizer gives
// every copy the same update: the copies stay equal bit for bit. The gradient is the one weight's
// (the sum of its uses), in the order "each stage's micro-batches, then the stages", which
// run_reference follows (Note [Single-process reference]). A stage that holds both uses (a
// one-stage model) shares the weight itself and declares nothing; autograd then adds the two uses
// of each micro-batch before the micro-batches, so its bits differ from those of the same model
// on two or more stages, which all agree (Layout invariance in Note [Random streams of a step]).

// Builds stage `stage`; called once for every stage the schedule puts on this rank.
using StageFactory = std::function<PipelineStage(int stage)>;

// One micro-batch: the first stage's inputs and the last stage's targets. A rank that holds
// neither may return empty vectors; a rank that holds only one of them may leave the other empty.
struct MicroBatch {
  Tensors inputs;
  Tensors targets;
};
using DataSource = std::function<MicroBatch(int64_t step, int64_t micro_batch)>;

// Loss of one micro-batch on the last stage: a scalar tensor.
using LossFn = std::function<at::Tensor(const Tensors& outputs, const Tensors& targets)>;

// Creates the optimizer over this rank's parameters (its stages in ascending order, each in
// module->parameters() order).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>& params)>;

// Called before the optimizer step of every training step (e.g. set each param group's lr).
using LrSchedule = std::function<void(torch::optim::Optimizer& optimizer, int64_t step)>;

struct PipelineOptions {
  // The generated schedule (kind, ranks, micro-batches, virtual stages, recompute placement).
  schedule::ScheduleOptions schedule;
  // Any action list instead (e.g. schedule::import_torch_csv): validated, and when it has no
  // SEND/RECV actions, given R actions for schedule.recompute and lowered to communication.
  std::optional<schedule::Schedule> actions;
  // Applied to every stage's module by path (remat::apply_policy; paths relative to the stage
  // module; a pattern that matches nothing on a stage is skipped there); empty: no recompute.
  // A pattern that matches on none of the stages it applies to (those of every rank without a
  // stage_remat entry) is a ConfigError naming it and the nearest module path, thrown by the
  // first train_step on every rank: the ranks exchange their stages' paths there, so every rank
  // passes the same `remat`.
  remat::RematPolicy remat;
  // Per model stage (global index) instead of `remat`: a stage listed here gets its own policy
  // (an empty one: no recompute on that stage), e.g. none on the last stage, which holds one
  // micro-batch in flight under 1F1B, and selective on the first, which holds P. ConfigError for
  // an index outside the schedule's stages, and for a pattern that matches nothing on its stage.
  std::map<int, remat::RematPolicy> stage_remat;
  LossFn loss;                 // required
  OptimizerFactory optimizer;  // required
  LrSchedule lr_schedule;      // optional
  double clip_grad_norm = 0;   // max global L2 norm of the gradients; 0: no clipping
  // Set: this rank's random ops (dropout in the stages, the data source, the loss) draw from a
  // generator of its own (remat::ThreadGeneratorScope, Note [Per-thread CPU generators]), so
  // ranks running as threads never share generator state, reseeded before every draw site
  // (Note [Random streams of a step]). Unset: LibTorch's process-wide generator.
  std::optional<uint64_t> seed;
  // Every rank sends its step time, busy time, remat counters and action timeline to the last
  // stage's rank, which fills the bubble and timeline fields of StepMetrics.
  bool collect_timelines = true;
  // With collect_timelines and a data group of D > 1: the last stage's rank of every replica sends
  // its pipeline's timelines to replica 0's, whose StepMetrics::replica_timelines then hold them
  // (Note [Step trace]: a trace of every rank of the job). One message per replica and step.
  bool trace_replicas = false;
  // Note [Data x pipeline]: this pipeline is replica `data_group->rank()` of
  // `data_group->world_size()` identical pipelines, and `data_group` connects this rank with the
  // ranks that hold its stages in the other replicas (comm::make_group). Null: one pipeline.
  comm::Transport* data_group = nullptr;
  // Note [Overlapped gradient all-reduce]: a stage's gradients go to its data group in messages
  // of whole parameters of about this many bytes (a parameter larger than it is one message).
  int64_t gradient_bucket_bytes = int64_t{25} << 20;
  // Note [Weight tail]: the W actions that end a rank's step run bucket by bucket (false: one W
  // after the other). The same gradients either way.
  bool weight_tail = true;
  // Note [Sharded optimizer]: with a data group of D > 1, each replica owns 1/D of the elements of
  // every gradient bucket and `optimizer` is called with those only (flat views of the
  // parameters); the gradients are reduce-scattered to their owners and the updated parameters
  // gathered after the step. The same bits as unsharded. No effect without a data group.
  bool shard_optimizer = false;
  // Where this rank's stage modules, micro-batch inputs and targets, received tensors and
  // optimizer state live (pipemat/pp/device.h names devices: resolve_device). On a CUDA device
  // the device is current while the rank runs a step or an evaluation, a set seed seeds its
  // generator too, and tensors cross ranks through host memory (pipemat/comm/tensor.h).
  c10::Device device = c10::Device(c10::kCPU);
  // kBFloat16: every stage forward in an autocast region to bf16 of its own, parameters,
  // gradients, optimizer and the loss in float32 (Note [Mixed precision] in
  // pipemat/pp/precision.h).
  Precision precision = Precision::kFloat32;
};

// Note [Random streams of a step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With PipelineOptions::seed the rank's generator is reseeded before every draw site of a
// step: the forward of stage s on micro-batch i of step t with forward_seed(seed, t, i,
// stage_stream(stage)), the data source's call for (t, i) with forward_seed(seed, t, i,
// kDataStream), the loss with kLossStream; evaluation the same with its step. So what a forward
// draws depends on (seed, step, micro-batch, stage) only, not on the order the schedule runs the
// actions, on which rank holds the stage or on the transport, and a single-process loop that
// reseeds the same way (see forward_seed) draws the same dropout masks. A checkpoint unit
// records the generator state at its entry (after the reseed) and its replay rewinds to it,
// wherever the schedule puts the replay.
//
// Layout invariance. stage_stream(stage) is the stage's index s by default: another split of
// the same layers (pipeline degree, layers_per_stage, schedule kind, virtual stages) gives a
// layer another stage and so other masks. A stage with PipelineStage::layer_streams starts from
// kLayerStream instead, the same stream for every such stage, and each of its layers draws inside
// a remat::LayerStream keyed by its index in the whole model (Note [Layer streams] in
// pipemat/remat/rng.h): layer L's draws then depend on (seed, step, micro-batch, L) only, and a
// model whose stages all do this trains to the same bits on every split at a given data degree.
// pipemat train's GPT does (its embedding's dropout keyed -1, block i's two dropouts keyed i); the
// Llama and the zoo's models draw nothing in their forward. The step's reductions keep one order
// on every split: each gradient sums its micro-batches in micro-batch order (and its replicas in
// replica order), the loss the same, and the clipping norm stacks the per-parameter norms in
// stage order, the model's order for contiguous stages (a tied weight's at its first copy; with
// Note [Sharded optimizer] each norm is still its whole parameter's). Still tied to the split: a
// draw of a layer_streams stage outside every LayerStream (from the shared kLayerStream stream,
// at its place in that stage's forward); a tied weight on one stage against two or more (Note
// [Tied weights]: one stage adds each micro-batch's two uses first, several stages sum each
// copy's micro-batches and then the copies; all splits of two or more stages agree); and a user
// stage whose forward is not the same function of its layers wherever the split falls (one that
// casts its output at its end, say). docs/training.md lists what the tests cover.

// Note [Overlapped gradient all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a data group, a stage's gradients are final when its last backward action of the step
// ends: its last B, or under a split backward its last W (I produces no weight gradient). Right
// then the rank posts that stage's buckets to the ranks of its data group (sends and receives,
// non-blocking) and goes on with its actions: the exchange overlaps the rest of the rank's
// backward (its other stages under interleaved and ZB-V: the V's later stage ends its backward
// first) and its idle tail, while the other ranks of the pipeline are still computing. At the
// step's end the rank waits for what is still in flight and sums each bucket in replica order.
// StepMetrics::allreduce_ms is the time from the first post to the last sum, allreduce_wait_ms
// the part of it the rank spent waiting at the end; the rest was hidden behind its actions.

// Note [Weight tail]
// ~~~~~~~~~~~~~~~~~~
// Under a split backward (ZB-H1, ZB-H2, ZB-V) a rank's list ends with a run of W actions, the
// weight gradients it deferred into the bubbles: ZB-H1's last rank of 4 ends with W4 W5 W6 W7 of
// 8 micro-batches. Run one after the other, they finish the stage's gradients only with the last
// W, so every bucket leaves at the very end and its all-reduce has nothing left to hide behind.
// With a data group and more than one bucket, the rank runs that tail bucket by bucket instead:
// for the stage's first bucket the W of every micro-batch of the tail, in schedule order, then
// that bucket leaves; then the next bucket, and so on (SplitBackward::run_weight over a range of
// parameters, the graph kept until the last range). Each parameter's gradient is still the sum
// of the same per-micro-batch gradients added in the same order, so the bits are those of the
// schedule's order; only the buckets' departure moves: the first one after 1/B of the tail's
// time instead of after all of it, and its all-reduce overlaps the other B - 1 parts. The tail's
// stages run in the order of their first W in it. The step's timeline shows the tail as its
// first W (the others take no time there): the total is the same, the split between the W
// actions is not measured. PipelineOptions::weight_tail = false (parallel.weight_tail) runs the
// W actions one after the other, for comparison.

// Note [Data x pipeline]
// ~~~~~~~~~~~~~~~~~~~~~~
// D replicas of one pipeline train on one global batch of D x M micro-batches per step:
// replica d runs the schedule over its M micro-batches, which are global micro-batches
// d*M .. d*M + M-1: the data source is called with the global index and the random streams of
// Note [Random streams of a step] are drawn for it, so a replica draws what the single process
// draws for those micro-batches. At construction the replicas' parameters are made equal
// (replica 0's are copied to the others). Every rank sums its stages' gradients over its data
// group (Note [Overlapped gradient all-reduce]: each stage's as soon as they are final) in
// replica order (g_0 + g_1 + ... + g_{D-1}, a gradient
// a replica did not produce counting as zeros) and divides by D, so every replica holds the same
// bits and the mean gradient of the global batch; clipping, the LR schedule and the optimizer
// then run as in one pipeline and keep the replicas equal. The step's loss is the mean of the
// replicas' losses, summed in replica order. evaluate() splits its E micro-batches between the
// replicas (replica d: d*E/D .. (d+1)*E/D - 1) and sums their losses in micro-batch order, as
// one pipeline does. A single process that accumulates each replica's
// micro-batches into a gradient of its own and combines them the same way
// (pp::run_reference with a data group, train::run_reference with parallel.data) gives the same
// bits.

// Note [Sharded optimizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// PipelineOptions::shard_optimizer (parallel.shard_optimizer) with D replicas: the optimizer
// state (AdamW's two moments, SGD's momentum) of a rank's parameters is split over the D ranks of
// its data group instead of being held by each. Ownership is by element: each bucket of Note
// [Overlapped gradient all-reduce] is laid out flat (its parameters' elements one after the
// other) and replica d owns elements [d*N/D, (d+1)*N/D) of its N (shard_slices), so a replica's
// share is exactly 1/D of every bucket up to one element, a bucket smaller than D elements
// leaving some replicas nothing. A slice is made of pieces: the contiguous runs of each parameter
// inside it. The optimizer factory is called with this replica's pieces, each a flat view of its
// parameter's elements (so an update of a piece writes the parameter): its state is created for
// those alone, and the LR schedule is unchanged. It must be an elementwise optimizer (torch's
// SGD, Adam, AdamW, RMSprop or Adagrad, which update each element from its own gradient and state
// only): stepping a piece then gives the bits stepping the whole parameter gives. Buckets close
// where the parameters' dtype changes, so a slice has one dtype.
//
// Reduce-scatter. A bucket leaves at the same place as unsharded (after the stage's last B or W,
// the weight tail bucket by bucket), but a replica sends replica d only d's slice of it (its
// gradients, zeros where it produced none, flat) with a flag per piece saying which it produced,
// and the owner sums the D slices in replica order (g_0 + ... + g_{D-1}) and divides by D: the
// unsharded exchange's elementwise ops on the same elements, so the owner's gradient has the
// unsharded bits. A piece nobody produced has no gradient, as its parameter would not.
// Parameters keep no gradient after the exchange: the reduced ones belong to the pieces.
//
// Clipping. The global norm keeps its definition (clip_grad_norm_'s: the per-parameter norms
// stacked in stage order, then their norm). A parameter's norm is computed by the replica that
// holds its first element, on the whole reduced gradient as unsharded: a parameter cut by a slice
// boundary has its other pieces sent to that replica first (at most D - 1 pieces per bucket).
// The replicas then exchange the norms (one float per parameter) so every rank stacks the same
// values in the same order, and the coefficient scales the pieces' gradients.
//
// Gather. After the optimizer step each replica sends its updated slice of every bucket (one flat
// tensor) to the other replicas, which copy it into their parameters before train_step returns:
// every replica leaves the step with every parameter, bitwise those of the unsharded run.
// StepMetrics::gather_ms is the time spent there. It runs at the step's tail, not before each
// stage's first forward of the next step, because train_step's caller may read the parameters
// between steps (evaluate, a checkpoint, the modules themselves); measured on configs/dp-pp.yaml
// it is a few ms of a 500 ms step (docs/training.md). StepMetrics::optimizer_state_bytes gives
// the state this rank holds.
//
// Checkpoints hold each replica's slices: to save, every replica calls save_checkpoint, and each
// writes its own optimizer shard (its pieces' state, each an element range of its parameter under
// the parameter's global name) beside the rank files replica 0 writes (parameters once); the
// manifest indexes every piece. To load, each replica reads the pieces that hold its own
// elements and keeps those (Pipeline::load_optimizer_state). So a checkpoint resumes sharded or
// unsharded, with any D and on any layout (Note [Checkpoint layout] in pipemat/pp/checkpoint.h);
// no replica holds more than its own state while it saves.

// Note [Sharded optimizer]: elements [begin, end) of parameter `param` (its index in the bucket)
// in the parameter's flat view.
struct ShardPiece {
  size_t param = 0;
  int64_t begin = 0, end = 0;
  bool operator==(const ShardPiece&) const = default;
};
// One replica's slice of a bucket: elements [begin, end) of its flat layout, as pieces in order.
struct ShardSlice {
  int64_t begin = 0, end = 0;
  std::vector<ShardPiece> pieces;
  bool operator==(const ShardSlice&) const = default;
};
// The slices of replicas 0 .. replicas-1 of a bucket whose parameters have `numels` elements:
// replica d's is [d*N/D, (d+1)*N/D). A parameter without elements is an empty piece of the first
// slice that ends past its position (of the last slice where none does).
std::vector<ShardSlice> shard_slices(const std::vector<int64_t>& numels, int replicas);

// The bytes of the tensors in `optimizer`'s per-parameter state (their storages' sizes) for
// torch's AdamW, Adam, SGD, Adagrad and RMSprop states; other state types count 0.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

// Start and end of one executed action, microseconds from the start of the step (Note [Step
// trace]). Compute actions (F, B, I, W, R) and sends; a receive is shown by the compute action
// that takes its message (`received`).
struct ActionTiming {
  schedule::Action action;
  double start_us = 0;  // compute start (after its input arrived); a send: when it was issued
  double end_us = 0;    // a send: when the call that issued it returned
  double wait_us = 0;   // time blocked in the receive of its input before start_us
  // Tracking-allocator bytes above the step's start (StepMetrics::start_bytes) when the action
  // started and at its peak: which action holds a rank's peak and what is alive then (compute
  // actions; this process's bytes, so all ranks' when they run as threads).
  int64_t start_bytes = 0;
  int64_t peak_bytes = 0;
  // A compute action whose input came from another rank (RECV_F / RECV_B of its stage and
  // micro-batch): true, with the bytes it received; a send: the bytes it sent.
  bool received = false;
  int64_t bytes = 0;
};

// The parts of a rank's step that are not actions of its schedule (Note [Step trace]).
enum class StepPart : uint8_t {
  kLoss,      // the last stage's loss of a micro-batch (inside its F; `stage`, `micro_batch`)
  kSendWait,  // the wait for the step's unfinished sends after the last action
  kTiedSum,   // Note [Tied weights]: the sum of a tied weight's gradients
  kGradientExchange,  // the data group's reduce, from the first bucket's post to the last sum
  kGradientWait,      // the part of it this rank waited for after its last action
  kClip,              // the global gradient norm and clipping
  kOptimizer,         // the LR schedule and the optimizer step
  kGather,            // Note [Sharded optimizer]: the wait for the updated parameters
};
// "LOSS", "SEND_WAIT", "TIED_SUM", "GRADIENT_EXCHANGE", "GRADIENT_WAIT", "CLIP", "OPTIMIZER",
// "GATHER".
const char* step_part_name(StepPart part);

struct StepSpan {
  StepPart part = StepPart::kLoss;
  double start_us = 0, end_us = 0;   // from the start of the step
  int stage = -1, micro_batch = -1;  // kLoss only
  int64_t bytes = 0;                 // kGradientExchange: the gradient bytes the rank posted
};

// One pipeline's timelines as its last stage's rank gathers them (StepMetrics::rank_timelines,
// rank_spans, rank_step_ms and rank_clock_start_us), by pipeline rank.
struct PipelineTimelines {
  std::vector<std::vector<ActionTiming>> timelines;
  std::vector<std::vector<StepSpan>> spans;
  std::vector<double> step_ms;
  std::vector<double> clock_start_us;
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;       // mean micro-batch loss; the same on every rank
  double grad_norm = 0;  // global gradient norm before clipping (0 without clipping)
  double step_ms = 0;    // wall time of the step on this rank (max over ranks on the last)
  double busy_ms = 0;    // time in compute actions on this rank
  double bubble = 0;     // 1 - sum(busy) / (ranks * makespan), on the last stage's rank
  // Tracking-allocator peak during the step (this process), above start_bytes: tensors and,
  // when the tracking allocator was installed before the Pipeline was built, the transport's
  // receive buffers (the stage inputs and output gradients this rank holds).
  int64_t peak_bytes = 0;
  // Note [Overlapped gradient all-reduce]: with a data group, this rank's gradient exchange from
  // its first post to its last sum, and the part of it waited for at the step's end.
  double allreduce_ms = 0;
  double allreduce_wait_ms = 0;
  // The same exchange as ms from the step's start: its first post and its last sum (0, 0: none).
  double allreduce_start_ms = 0, allreduce_end_ms = 0;
  double data_ms = 0;          // in the data source (its calls for this rank's micro-batches)
  double recv_wait_ms = 0;     // blocked in receives of stage inputs; on the last stage's rank
                               // (with collect_timelines) summed over all ranks
  remat::RematCounters remat;  // this rank's; on the last stage's rank summed over all ranks
  // This rank's compute actions and sends, and the other parts of its step (Note [Step trace]).
  std::vector<ActionTiming> timeline;
  std::vector<StepSpan> spans;
  // The step's start on this rank's steady clock (us since the clock's epoch; after the barrier
  // that starts the step when timelines are collected): where a job's steps lie on one clock.
  double clock_start_us = 0;
  // On the last stage's rank (with collect_timelines): every rank's timeline, spans and step
  // time, by rank (this rank's included). Empty elsewhere.
  std::vector<std::vector<ActionTiming>> rank_timelines;
  std::vector<std::vector<StepSpan>> rank_spans;
  std::vector<double> rank_step_ms;
  std::vector<double> rank_clock_start_us;  // each rank's clock_start_us
  // On replica 0's last stage's rank with PipelineOptions::trace_replicas: those of replicas
  // 1 .. D-1 (replica d at d - 1). Empty elsewhere.
  std::vector<PipelineTimelines> replica_timelines;
  // On the last stage's rank (with collect_timelines): every rank's measured timeline (ms) as a
  // simulation result, and the simulator's prediction for the same schedule with the measured
  // mean cost of each action type (F, B, I, W, R; zero comm latency).
  schedule::SimulationResult measured;
  schedule::CostModel measured_costs;
  // The same means per model stage (size stages_count; a stage that ran no action of a type
  // has measured_costs' value for it).
  std::vector<schedule::CostModel> measured_stage_costs;
  double simulated_bubble = 0;
  // Note [Measured message delay]
  // The median, over compute actions that waited (50 us or more) for a cross-rank input, of
  // (start - when the peer issued its send): what a message took from being sent to being usable,
  // protocol and progress included (0 when no action waited). The simulator's bubble with it as
  // the per-message comm cost.
  double message_delay_ms = 0;
  double simulated_bubble_comm = 0;
  // The simulator's timeline with each stage's own means (measured_stage_costs, with
  // message_delay_ms as the comm cost; ms from the step's start), on the last stage's rank: what
  // the trace draws beside the measurement.
  schedule::SimulationResult simulated;
  int64_t max_rank_peak_bytes = 0;  // max of peak_bytes over ranks (local: one process)
  // The tracking allocator's bytes when the step started (weights, optimizer state and what else
  // the process holds), this rank's; start_bytes + peak_bytes is its peak during the step.
  int64_t start_bytes = 0;
  // The most resident memory this rank's process has held so far, at the step's end
  // (pp::peak_resident_bytes): what the operating system gave it, not only tensors.
  int64_t resident_peak_bytes = 0;
  // On the last stage's rank (with collect_timelines): start_bytes, peak_bytes and
  // resident_peak_bytes of every rank, by rank (local: the one process's, the same for every
  // rank). Empty elsewhere.
  std::vector<int64_t> rank_start_bytes, rank_peak_bytes, rank_resident_peak_bytes;
  // On a CUDA device: the most bytes of tensors the CUDA caching allocator held for this rank's
  // device during the step (pp::device_memory); 0 on the CPU. On the last stage's rank, every
  // rank's, by rank (with collect_timelines).
  int64_t device_peak_bytes = 0;
  std::vector<int64_t> rank_device_peak_bytes;
  // On the last stage's rank (with collect_timelines and a data group): every rank's
  // allreduce_start_ms and allreduce_end_ms, by rank. Empty elsewhere.
  std::vector<std::pair<double, double>> rank_allreduce_ms;
  // Note [Sharded optimizer]: the bytes of this rank's optimizer state after the step
  // (optimizer_state_bytes), and on the last stage's rank (with collect_timelines) every rank's of
  // its pipeline, by rank. gather_ms: this rank's wait for the updated parameters (0 unsharded).
  int64_t optimizer_state_bytes = 0;
  std::vector<int64_t> rank_optimizer_state_bytes;
  // The bytes of this rank's parameters, and of the gradients it holds when the gradient
  // exchange has ended (before clipping and the step: whole gradients, or with Note [Sharded
  // optimizer] its slices), each storage counted once; per rank as above.
  int64_t parameter_bytes = 0, gradient_bytes = 0;
  std::vector<int64_t> rank_parameter_bytes, rank_gradient_bytes;
  double gather_ms = 0;
};

struct EvalOptions {
  int64_t micro_batches = 1;
  bool keep_outputs = false;  // return the last stage's outputs (on its rank; with a data group,
                              // those of this replica's share)
  int64_t step = 0;           // passed to the data source
};

struct EvalResult {
  double loss = 0;               // mean micro-batch loss; the same on every rank
  std::vector<Tensors> outputs;  // per micro-batch, on the last stage's rank (keep_outputs)
};

namespace detail {
struct PipelineAccess;  // pp/src/checkpoint_state.cpp: a rank's state by global name
}  // namespace detail

class Pipeline {
 public:
  // Builds the schedule, calls `build` for each stage of this rank, applies the remat policy to
  // each stage module and creates the optimizer. Not collective (no messages). ConfigError when
  // the schedule's ranks differ from the transport's world size, a required option is missing,
  // a stage_remat pattern matches nothing on its stage, or `build` returns a stage with another
  // index, no module or no forward.
  Pipeline(comm::Transport& transport, PipelineOptions options, const StageFactory& build);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One training step: the action list of this rank with micro-batches from `data` (called on
  // the ranks of the first and of the last stage, with this step's index and the micro-batch),
  // then clipping, the LR schedule and the optimizer step; gradients are reset first. The first
  // step throws ConfigError on every rank, before any action, for a PipelineOptions::remat
  // pattern that matches on no stage of any rank.
  StepMetrics train_step(const DataSource& data);
  // The same with the step's batch split along dim 0 into schedule micro-batches (every tensor
  // of `inputs` on the first stage's rank and of `targets` on the last's; others may be empty).
  // PipelineError when dim 0 does not divide into the micro-batches.
  StepMetrics train_step(const MicroBatch& batch);

  // Forward only, in eval mode (train mode is restored after), with no autograd graph and no
  // remat state: each micro-batch flows through the stages in order. Collective.
  EvalResult evaluate(const DataSource& data, const EvalOptions& options);
  EvalResult evaluate(const MicroBatch& batch, const EvalOptions& options);

  // Completed training steps: the next train_step is step `step()`. set_step is for resuming.
  int64_t step() const;
  void set_step(int64_t step);

  const schedule::Schedule& schedule() const;
  int rank() const;
  bool is_first_stage_rank() const;
  bool is_last_stage_rank() const;
  // This rank's stages, ascending.
  std::vector<int> stages() const;
  const PipelineStage& stage(int index) const;
  // This rank's parameters, in stage then module order (with Note [Sharded optimizer] the
  // optimizer got this replica's pieces of them instead).
  const std::vector<at::Tensor>& parameters() const;
  // With Note [Sharded optimizer] it steps this replica's pieces only.
  torch::optim::Optimizer& optimizer();
  // Note [Sharded optimizer] is in effect (shard_optimizer with a data group of D > 1).
  bool shards_optimizer() const;
  // The data group (PipelineOptions::data_group), or null.
  comm::Transport* data_group() const;
  // Loads state saved from, or held by, an optimizer over all of this rank's parameters;
  // sharded, this replica keeps the state of its pieces' elements.
  void load_optimizer_state(torch::serialize::InputArchive& archive);
  void load_optimizer_state(const torch::optim::Optimizer& full);
  // This rank's generator (PipelineOptions::seed); undefined without a seed.
  at::Generator generator() const;

 private:
  friend struct detail::PipelineAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- Stages from modules ----------------------------------------------------------------------

namespace detail {

template <typename M, typename = void>
struct TakesTensors : std::false_type {};
template <typename M>
struct TakesTensors<
    M, std::void_t<decltype(std::declval<M&>().forward(std::declval<const Tensors&>()))>>
    : std::true_type {};

template <typename M, typename Seq, typename = void>
struct TakesN : std::false_type {};
template <typename M, size_t... I>
struct TakesN<M, std::index_sequence<I...>,
              std::void_t<decltype(std::declval<M&>().forward(
                  (static_cast<void>(I), std::declval<at::Tensor>())...))>> : std::true_type {};

inline Tensors to_tensors(at::Tensor t) { return {std::move(t)}; }
inline Tensors to_tensors(Tensors v) { return v; }
template <typename... T>
Tensors to_tensors(std::tuple<T...> t) {
  return std::apply([](auto&&... x) { return Tensors{at::Tensor(x)...}; }, std::move(t));
}
template <typename A, typename B>
Tensors to_tensors(std::pair<A, B> p) {
  return {at::Tensor(p.first), at::Tensor(p.second)};
}

[[noreturn]] void throw_arity(int stage, size_t expected, size_t got);

template <typename M, size_t... I>
Tensors call_n(M& m, const Tensors& in, int stage, std::index_sequence<I...>) {
  if (in.size() != sizeof...(I)) throw_arity(stage, sizeof...(I), in.size());
  return to_tensors(m.forward(in[I]...));
}

template <typename M>
StageForward forward_of(std::shared_ptr<M> m, int stage) {
  if constexpr (TakesTensors<M>::value) {
    return [m](const Tensors& in) { return to_tensors(m->forward(in)); };
  } else if constexpr (TakesN<M, std::make_index_sequence<1>>::value) {
    return [m, stage](const Tensors& in) {
      return call_n(*m, in, stage, std::make_index_sequence<1>());
    };
  } else if constexpr (TakesN<M, std::make_index_sequence<2>>::value) {
    return [m, stage](const Tensors& in) {
      return call_n(*m, in, stage, std::make_index_sequence<2>());
    };
  } else if constexpr (TakesN<M, std::make_index_sequence<3>>::value) {
    return [m, stage](const Tensors& in) {
      return call_n(*m, in, stage, std::make_index_sequence<3>());
    };
  } else {
    static_assert(TakesN<M, std::make_index_sequence<4>>::value,
                  "make_stage: the module's forward must take 1-4 tensors or a "
                  "std::vector<at::Tensor>; pass a callable for other signatures");
    return [m, stage](const Tensors& in) {
      return call_n(*m, in, stage, std::make_index_sequence<4>());
    };
  }
}

}  // namespace detail

// A stage from a module holder (`Block(...)` of TORCH_MODULE) or a shared_ptr to a module; its
// forward is adapted as the top of this file says.
template <typename M>
PipelineStage make_stage(int index, std::shared_ptr<M> module) {
  PipelineStage s;
  s.index = index;
  s.forward = detail::forward_of(module, index);
  s.module = std::move(module);
  return s;
}
template <typename M>
PipelineStage make_stage(int index, torch::nn::ModuleHolder<M> module) {
  return make_stage(index, module.ptr());
}
// A stage from an AnyModule: one input tensor is passed as at::Tensor, several as
// std::vector<at::Tensor>; it returns at::Tensor, std::vector<at::Tensor> or a tuple of 2 or 3
// tensors (else PipelineError). Remat paths are relative to the module it holds.
PipelineStage make_stage(int index, torch::nn::AnyModule module);
// A stage from a callable; `module` owns the parameters the callable uses.
PipelineStage make_stage(int index, std::shared_ptr<torch::nn::Module> module,
                         StageForward forward);

// ---- Stages from a Sequential -----------------------------------------------------------------

// Stage boundaries ("first entry of every stage, then the end": stages + 1 ascending values)
// for contiguous parts of items with the given sizes, balanced by size: stage s ends where the
// running total first reaches (s + 1) / stages of the sum, every stage keeps at least one item.
// ConfigError when there are fewer items than stages.
std::vector<int64_t> balance_by_size(const std::vector<double>& sizes, int stages);
// balance_by_size over the parameter counts of the Sequential's entries.
std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int stages);
// Stage s is a Sequential of the entries [bounds[s], bounds[s + 1]) of `model` under their names
// (the modules are shared, not copied), its global names those of `model` (Note [Global
// names]). Its first entry gets at::Tensor when the stage receives
// one tensor and std::vector<at::Tensor> when it receives several; its last entry returns
// at::Tensor, std::vector<at::Tensor> or a tuple of 2 or 3 tensors. ConfigError for bounds that
// are not strictly ascending from 0 to model->size().
StageFactory split_sequential(torch::nn::Sequential model, std::vector<int64_t> bounds);

// The seed of the random stream `stream` (a stage's stage_stream, or kDataStream /
// kLossStream) on micro-batch `micro_batch` of step `step` (Note [Random streams of a step]). A
// single-process loop that matches a seeded pipeline bitwise runs stage s of micro-batch i under
// remat::ThreadGeneratorScope(forward_seed(seed, step, i, stage_stream(stage s))).
inline constexpr int kDataStream = -1;
inline constexpr int kLossStream = -2;
inline constexpr int kLayerStream = -3;  // every PipelineStage::layer_streams stage's forward
uint64_t forward_seed(uint64_t seed, int64_t step, int64_t micro_batch, int stream);
// The stream a stage's forward starts from: kLayerStream with PipelineStage::layer_streams,
// else its index.
inline int stage_stream(const PipelineStage& stage) {
  return stage.layer_streams ? kLayerStream : stage.index;
}

// Number of model stages the options give (ranks x virtual stages, or the imported list's).
int stage_count(const PipelineOptions& options);

// The schedule a Pipeline of `options` executes: the generated one, or options.actions with R
// actions for schedule.recompute, lowered to communication; validated (ScheduleError).
schedule::Schedule executed_schedule(const PipelineOptions& options);

}  // namespace pipemat::pp
