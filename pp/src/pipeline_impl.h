#pragma once
// Private to pp: the state of a Pipeline, shared by the files that implement it. Each member
// function is defined in the file its group names. What lives where in pp/src:
//   pipeline_impl.h     this file: Pipeline::Impl, the state the files below share.
//   pipeline.cpp        setup: plan, option and stage checks, the rank's generator and
//                       Note [Random streams of a step]; Pipeline's members (forward to Impl).
//   stages.cpp          make_stage, balance_by_size / _parameters, split_sequential.
//   stage_io.cpp        batch split into micro-batches, Note [Stage boundary signature] checks,
//                       the detached copies that go on the wire.
//   executor.cpp        train_step: dispatches the rank's actions to a StepRun, then the tail:
//                       the gradient all-reduce, clipping, the optimizer step and the metrics.
//   step_run.h          StepRun, one step in progress: its state and a method per action.
//   step_actions.cpp    the actions: F, B, I, W, R, SEND / RECV.
//   gradients.cpp       loss scaling, clipping by the global gradient norm.
//   data_parallel.cpp   Note [Data x pipeline]: equal replicas, the mean gradient and loss.
//   tied.cpp            Note [Tied weights]: the copies checked, their gradients summed.
//   sharded_optimizer.cpp  Note [Sharded optimizer]: slices, reduce-scatter, norms, the gather,
//                       the optimizer state in and out of checkpoints.
//   metrics.cpp         the loss on every rank; step metrics and timelines on the last rank.
//   evaluate.cpp        evaluate: forward only, in eval mode.
//   split_backward.h/.cpp  B, and I / W (Note [Split backward]) on the autograd engine: pp's
//                       only use of torch/csrc (Note [Autograd internals of pp's backward]).
//   checkpoint_*.cpp    what checkpoint.h declares (Note [Checkpoint layout]): checkpoint_state
//                       (a rank's state by global name), checkpoint_write (save), checkpoint_load
//                       (the load planner), manifest (the manifest and its tensor index),
//                       checkpoint_dir (directories, runs, verify), checkpoint.cpp (the ranks'
//                       agreement, crash injection, formats 1 to 3); optimizer_state (the
//                       elementwise optimizers' state by field).
//   compute.cpp, profile.cpp  what compute.h, profile.h declare.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/comm/tensor.h"
#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::pp {

// What one stage boundary carries (Note [Stage boundary signature] in pipemat/pp/pipeline.h):
// the number of tensors and the dtype of each (-1: undefined).
using Signature = std::vector<int>;

struct Pipeline::Impl {
  comm::Transport& transport;
  PipelineOptions options;
  schedule::Schedule plan;
  int rank = 0;
  int last_stage = 0;
  std::map<int, PipelineStage> stages;
  std::map<int, std::vector<at::Tensor>> stage_params;
  std::vector<at::Tensor> params;
  int64_t parameter_bytes = 0;  // of `params` (remat::storage_bytes), set with the stages
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t next_step = 0;
  std::map<int, Signature> boundary;  // boundary s -> s + 1, Note [Stage boundary signature]
  at::Generator generator;            // PipelineOptions::seed
  // This rank's module paths of the stages that take PipelineOptions::remat, until the first
  // step checks the policy against those of every rank (check_remat_paths).
  std::vector<std::string> remat_paths;
  bool remat_checked = false;

  // pipeline.cpp: checks the options, builds the plan, this rank's stages and the optimizer.
  Impl(comm::Transport& t, PipelineOptions o, const StageFactory& build);

  // Message tags and where the stages are.
  int tag_of(const schedule::Action& a) const { return schedule::message_id(plan, a); }
  // Tags above the schedule's messages: metrics, timelines, clipping norms, losses, one never
  // sent (Note [A bad boundary fails on both sides]), evaluation.
  int reserved_tag(int k) const { return 2 * plan.stages_count * plan.micro_batches + k; }
  int metrics_tag() const { return reserved_tag(0); }
  int timeline_tag() const { return reserved_tag(1); }
  int norms_tag() const { return reserved_tag(2); }
  int loss_tag() const { return reserved_tag(3); }
  int unsent_tag() const { return reserved_tag(4); }
  int eval_tag(int from_stage, int64_t micro_batch, int64_t micro_batches) const {
    const int64_t tag = reserved_tag(5) + from_stage * micro_batches + micro_batch;
    PIPEMAT_CHECK(tag <= comm::kMaxUserTag, ConfigError, "evaluate: ", micro_batches,
                  " micro-batches over ", plan.stages_count,
                  " stages need more message tags "
                  "than the transport has; evaluate fewer micro-batches per call");
    return static_cast<int>(tag);
  }
  // The module paths of PipelineOptions::remat's stages, exchanged once at the first step
  // (every message is received there, before any action); below checkpoint.cpp's kAgreementTag.
  static int remat_paths_tag() { return comm::kMaxUserTag - 1; }
  // Note [Tied weights]: the declarations, exchanged once at the first step; the gradients of
  // the copies, once per step after every action.
  static int tie_declarations_tag() { return comm::kMaxUserTag - 2; }
  static int tie_gradients_tag() { return comm::kMaxUserTag - 3; }
  int last_rank() const { return plan.rank_of(last_stage); }
  bool is_first_stage_rank() const { return plan.rank_of(0) == rank; }
  bool is_last_stage_rank() const { return last_rank() == rank; }
  // Note [Data x pipeline]: replica d of D evaluates [d*E/D, (d+1)*E/D) of E micro-batches.
  static std::pair<int64_t, int64_t> eval_share(int replica, int replicas, int64_t items) {
    return {replica * items / replicas, (replica + 1) * items / replicas};
  }
  // Note [Overlapped gradient all-reduce]: this rank's stage -> the position in its action list
  // of its last B or W of a step, after which its gradients are final (set with the plan).
  std::map<int, size_t> final_backward;
  // Note [Overlapped gradient all-reduce]: with a data group, stage -> its buckets, ranges
  // [first, end) of its parameters in parameter order, each closed once it holds
  // gradient_bucket_bytes (set with the stages).
  std::map<int, std::vector<std::pair<size_t, size_t>>> buckets;
  // Note [Weight tail]: stage -> the positions of its W actions in the run of W actions that ends
  // this rank's list; only the stages whose tail runs bucket by bucket (a data group,
  // PipelineOptions::weight_tail, more than one bucket), whose buckets the tail posts.
  std::map<int, std::vector<size_t>> weight_tails;
  // Tags of the data group: only this rank's replicas of its stages talk on it.
  enum DataTag : int {
    kParametersTag,
    kGradientsTag,
    kLossTag,
    kEvalTag,
    kGatherTag,     // Note [Sharded optimizer]: the updated slices
    kNormsTag,      // ... the gradient norms
    kPiecesTag,     // ... pieces of a parameter cut by a slice boundary, to its norm's replica
    kTimelinesTag,  // PipelineOptions::trace_replicas: a replica's timelines, to replica 0
  };
  // What replica `from` sent has the count, dtypes and shapes of this replica's `mine` (`what`
  // names it in the error; step -1: outside a step).
  void check_same(const Tensors& got, const Tensors& mine, int from, const char* what,
                  int64_t step) const;
  // Note [Sharded optimizer] (set with the stages when sharded()): stage -> per bucket (as
  // `buckets`) the slices of replicas 0 .. D-1; stage -> per bucket this replica's pieces as
  // tensors (flat views of the parameters); stage -> per parameter the replicas holding its
  // pieces, with the piece's index in that replica's slice, in element order (the first computes
  // its gradient norm: owner_of).
  std::map<int, std::vector<std::vector<ShardSlice>>> slices;
  std::map<int, std::vector<std::vector<at::Tensor>>> my_pieces;
  struct PieceRef {
    int replica = 0;
    size_t bucket = 0, piece = 0;
  };
  std::map<int, std::vector<std::vector<PieceRef>>> pieces_of;
  // What the optimizer steps: `params`, or with sharded() this replica's pieces, stage then bucket
  // order. Their gradients are the ones clipping scales.
  std::vector<at::Tensor> optimized;
  bool sharded() const {
    return options.shard_optimizer && options.data_group != nullptr &&
           options.data_group->world_size() > 1;
  }
  int owner_of(int stage, size_t i) const { return pieces_of.at(stage)[i].front().replica; }
  // Note [Data x pipeline]: the global index of this replica's first micro-batch of a step.
  int64_t micro_batch_offset() const {
    return options.data_group ? options.data_group->rank() * plan.micro_batches : 0;
  }

  // pipeline.cpp: ConfigError at the first step for a PipelineOptions::remat pattern that
  // matches on no stage of any rank; collective (the ranks exchange remat_paths).
  void check_remat_paths();
  // tied.cpp: Note [Tied weights]. One tie key's copies in stage order, with where they live.
  struct TieCopy {
    int stage = 0;
    int rank = 0;
    std::string name;  // in the stage's module
    at::Tensor param;  // the copy itself, on this rank only (undefined for other ranks' copies)
  };
  struct Tie {
    std::string key;
    std::vector<TieCopy> copies;
  };
  std::vector<Tie> ties;  // key order; set by check_ties
  bool ties_checked = false;
  // (stage, index in stage_params) of every copy but the lowest stage's: left out of the norm.
  std::set<std::pair<int, size_t>> tie_followers;
  // This rank's stages that hold a copy (known from the stages alone, set with them): their
  // data-group buckets leave at the step's end, after the copies' gradients are summed.
  std::set<int> tied_stages;
  // Collective at the first step: exchanges the declarations and checks them (PipelineError).
  void check_ties();
  // After every action of a step: each copy's gradient becomes the sum of all copies'.
  void sum_tied_gradients(int64_t step);
  bool is_tie_follower(int stage, size_t i) const { return tie_followers.count({stage, i}) > 0; }

  // pipeline.cpp: Note [Random streams of a step].
  void reseed(int64_t step, int64_t micro_batch, int stream);

  // stage_io.cpp: what goes into the stages and across their boundaries.
  DataSource split_batch(const MicroBatch& batch, int64_t parts, const char* call) const;
  const Signature* boundary_mismatch(int b, const Tensors& ts);
  std::string check_sent(int stage, int64_t step, int64_t micro_batch, const Tensors& out);
  void check_received(int stage, int from_rank, int64_t step, int64_t micro_batch,
                      const Tensors& in);
  static Tensors as_received(const Tensors& out);
  // `ts` on options.device: the same tensors on the CPU; else copies that keep requires_grad
  // (a received tensor stays a leaf).
  Tensors on_device(Tensors ts) const;
  // What a rank sends, on the host (through pinned memory from a GPU); unchanged on the CPU and
  // where a device lane carries it (Note [Device lanes]).
  Tensors on_host(Tensors ts) const;

  // executor.cpp: the action executor; step_run.h: one step in progress.
  class StepRun;
  StepMetrics train_step(const DataSource& data);
  StepMetrics train_step(const MicroBatch& batch);

  // gradients.cpp: loss scaling and global gradient clipping.
  at::Tensor scaled_loss(const Tensors& out, const Tensors& targets, int64_t micro_batches,
                         int64_t step, int64_t micro_batch);
  double clip_global_norm(double max_norm, int64_t step);
  // Note [Data x pipeline]: replica 0's parameters to every replica (construction), the mean
  // gradient and the mean loss over the data group.
  void equalize_parameters();
  // Note [Overlapped gradient all-reduce]: a stage's buckets go to its data group when its last
  // backward of the step ends (post), and are summed into its gradients at the step's end.
  // One list sent to every other rank of the data group, and theirs being received.
  struct Posted {
    Tensors mine;
    std::vector<comm::TensorListWork> sends, recvs;  // recvs: per replica (own: empty)
  };
  struct Bucket {
    size_t index = 0;           // in buckets[stage]
    size_t first = 0, end = 0;  // the stage's parameters [first, end)
    // Unsharded: [produced flags (int64 0/1), gradients or zeros]; sharded: [produced flags per
    // piece, the slice flat] of this replica's slice.
    Posted posted;
  };
  // Sends `mine` to every other replica and posts the receives of theirs.
  Posted post_data(int tag, Tensors mine);
  // Every replica's list in replica order (this rank's own at its index), each checked to have
  // this rank's count, dtypes and shapes; returns once this rank's sends are done too, so that
  // what they sent may be written.
  std::vector<Tensors> collect_data(Posted& posted, const char* what, int64_t step);
  std::vector<Tensors> exchange_data(int tag, Tensors mine, const char* what, int64_t step);
  struct GradientExchange {
    int stage = 0;
    std::vector<Bucket> buckets;
  };
  // Sets `buckets`, and keeps the `weight_tails` that run bucket by bucket.
  void plan_buckets();
  Bucket post_bucket(int stage, size_t index);
  GradientExchange post_gradients(int stage);
  void finish_gradients(GradientExchange& exchange, int64_t step);
  double average_loss(double loss, int64_t step);
  // sharded_optimizer.cpp, Note [Sharded optimizer]: sets slices, my_pieces, pieces_of and
  // optimized.
  void make_shards();
  // ConfigError unless `optimizer` is elementwise (stepping a piece = stepping its elements).
  void check_shardable() const;
  // A bucket's slices to their owners; this replica's slice summed into its pieces' gradients.
  Bucket post_slices(int stage, size_t index);
  void finish_slices(int stage, Bucket& bucket, int64_t step);
  // Every owner's updated slices into every replica's parameters.
  void gather_parameters(int64_t step);
  // Note [Sharded optimizer]: with sharded(), every parameter's gradient norm from its owner:
  // stage -> the stacked norms of its parameters that have a gradient, in parameter order.
  std::map<int, at::Tensor> sharded_norms(int64_t step);
  // Note [Sharded optimizer], checkpoints of format 3 (checkpoint.cpp): one optimizer over all
  // of this rank's parameters (params, built by PipelineOptions::optimizer) holding the state of
  // the shards every replica of a run wrote (`shards[d]` replica d's, any D), joined per
  // parameter; PipelineError naming `where` when they are not one run's shards of this rank's
  // parameters. Then load_optimizer_state: what Pipeline's function of that name does.
  std::unique_ptr<torch::optim::Optimizer> join_optimizer_shards(
      std::vector<torch::serialize::InputArchive>& shards, const std::string& where) const;
  void load_optimizer_state(torch::serialize::InputArchive& archive);
  void load_optimizer_state(const torch::optim::Optimizer& full);
  // An evaluation's per-micro-batch losses, each from the replica that evaluated it (replica d:
  // d*E/D .. (d+1)*E/D - 1 of the E in its `share`).
  at::Tensor gather_shares(const at::Tensor& share, int64_t micro_batches);

  // metrics.cpp: the step's loss and metrics across ranks.
  double share_loss(double loss);
  void build_measured(StepMetrics& m) const;
  void exchange_metrics(StepMetrics& m);
  // PipelineOptions::trace_replicas, on the last stage's rank after exchange_metrics: replicas
  // 1 .. D-1 send their timelines to replica 0, which fills m.replica_timelines.
  void gather_replica_timelines(StepMetrics& m);

  // evaluate.cpp
  EvalResult evaluate(const DataSource& data, const EvalOptions& eo);
};

// pipeline.cpp: every rank's `lines`, in rank order, on every rank: an all-to-all of one small
// message each (collective over `transport`).
std::vector<std::string> lines_of_all_ranks(comm::Transport& transport, int tag,
                                            const std::vector<std::string>& lines);

}  // namespace pipemat::pp
