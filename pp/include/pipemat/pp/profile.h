#pragma once
// The remat profiler: for one layer of a user's model, every candidate policy generated from the
// layer's module tree, each measured in one forward / replay / split backward with the tracking
// allocator. Its output is what the planner (pipemat::plan) chooses from.
//
// Candidates: "none" (keep every activation), "full" (the layer is one checkpoint unit) and, for
// every non-empty set S of the layer's SAVE leaves, "save:<S>" (a checkpoint unit whose members
// in S are SAVE regions: their outputs are cached, so replay skips them). A SAVE leaf is a
// descendant module that remat can declare a SAVE region (a Remat<H> member or a Sequential entry,
// remat/policy.h) and that holds no such descendant itself. With more than
// ProfileOptions::max_save_leaves leaves, those with the most parameters are used (the GEMMs,
// whose replay a SAVE region skips; ties: module order).
//
// Measurement of a candidate, on a fresh copy of the layer with the policy applied, repeated
// ProfileOptions::repeats times after ProfileOptions::warmup unmeasured rounds (times: the
// median; bytes: those of the last repeat):
//   resident  bytes alive after the forward that it allocated (its output included: the next
//             layer keeps it as its input);
//   replayed  bytes a pre-triggered replay adds (InvocationGroup::pretrigger, the R action);
//   temporaries  F's and R's peaks above what they leave, B's above its start when it
//             accumulates into existing gradients (plan::Candidate);
//   times     forward, replay (R), I and W (the split backward of the pipeline) in ms, and the
//             fused backward (B) on a second forward and replay, into the gradients W left.

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <string>
#include <vector>

#include "pipemat/plan/plan.h"
#include "pipemat/plan/split.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/remat/policy.h"

namespace pipemat::pp {

struct ProfileOptions {
  int repeats = 3;          // measured rounds per candidate (times: their median)
  int warmup = 1;           // unmeasured rounds per candidate before them
  int max_save_leaves = 6;  // 2^6 - 1 selective candidates at most
  // Non-empty: the selective candidates are exactly these sets of SAVE leaves (paths relative to
  // the layer, e.g. {"attn.qkv", "mlp.up"}), not every subset of the largest max_save_leaves.
  std::vector<std::vector<std::string>> save_sets = {};
  // Each forward in the region the pipeline gives it (Note [Mixed precision] in
  // pipemat/pp/precision.h), so bytes and times are those of the run's precision.
  Precision precision = Precision::kFloat32;
};

// One candidate's declaration, with paths relative to the layer: "" is the layer itself.
struct LayerPolicy {
  bool checkpoint = false;
  std::vector<remat::ExcludeRule> exclude;  // paths below the layer, e.g. "attn.qkv"
};

struct LayerCandidates {
  plan::LayerProfile profile;         // profile.candidates[k] measures policies[k]
  std::vector<LayerPolicy> policies;  // same order
  std::vector<std::string> save_leaves;
};

// Profiles the layer that `make_layer` builds (called once per candidate and repeat setup; each
// call must return a layer of the same structure; the weights need not be equal) on `input`
// (one micro-batch, as the layer receives it). `name` labels the profile (e.g. "layers.*").
// The layer's output must be one tensor. Installs the tracking allocator. On a CUDA `input` the
// layer is moved to its device and measured there: bytes from the CUDA caching allocator, times
// read after the device finished (the same for profile_stage on CUDA inputs, with the stage
// module already on that device).
LayerCandidates profile_layer(const std::string& name,
                              const std::function<torch::nn::AnyModule()>& make_layer,
                              const at::Tensor& input, const ProfileOptions& options = {});

// The stage-relative RematPolicy of per-layer choices: layer i of the stage is
// `layer_prefix` + i (e.g. "layers.3"), with the candidate policies[choice[i]] of profiles[i].
remat::RematPolicy stage_policy_of(const std::vector<const LayerCandidates*>& layers,
                                   const std::vector<int>& choice, const std::string& layer_prefix);

// One measured micro-batch of a whole pipeline stage without remat: what the planner adds to
// its layers' sums (the stage input held until the backward, an embedding, a head, the loss) and
// what each backward pass allocates above the bytes alive when it starts.
struct StageProfile {
  double input_bytes = 0;         // the stage's inputs, held from F until the backward
  double resident_bytes = 0;      // alive after F (and the loss on the last stage), inputs excluded
  double forward_peak_bytes = 0;  // F's peak above its start (the outputs included)
  // Peaks above the bytes alive when the pass starts, accumulating into gradients that exist
  // (every backward of a step but the stage's first): the fused B (which frees each saved
  // activation as it goes), I and W of the split backward.
  double backward_peak_bytes = 0;
  double first_backward_peak_bytes = 0;  // B's peak into no gradients (the step's first B)
  double input_peak_bytes = 0;
  double weight_peak_bytes = 0;
  // What I leaves alive for W beyond what F left (the gradients W's roots received; the input
  // gradients are sent and freed): held per micro-batch from I until W.
  double input_held_bytes = 0;
  // The gradients of the outputs (0 on the last stage): what the next stage sends back, alive on
  // this rank while B or I runs.
  double output_gradient_bytes = 0;
  double forward = 0;          // ms, the loss included on the last stage
  double backward = 0;         // ms, the fused B
  double backward_input = 0;   // ms, I
  double backward_weight = 0;  // ms, W
  Tensors outputs;             // detached: the next stage's inputs
};

// Runs `stage` (its remat policy as built: give one without) on `inputs` as the pipeline does:
// floating inputs as leaves that require grad (received activations), others as they are; with
// `loss` (the last stage) on `targets`; then a split backward (I, then W) that creates the
// parameters' gradients, and on two more forwards a fused and a split backward that accumulate
// into them, each with a random output gradient on other stages. `warmup` rounds
// first, unmeasured (first calls allocate and fault in memory, start kernels); times: the median
// of the `repeats` rounds after them; bytes: those of the last. Installs the tracking allocator.
// `precision`: each forward in the region the pipeline gives it, the loss on loss_inputs (Note
// [Mixed precision]).
StageProfile profile_stage(const PipelineStage& stage, const Tensors& inputs, const LossFn& loss,
                           const Tensors& targets, int repeats = 3, int warmup = 1,
                           Precision precision = Precision::kFloat32);

// Note [Split by cost] for a user's Sequential: each entry is profiled as its own stage
// (profile_stage: on the sample's inputs for the first, on the entry before's outputs for the
// others, with the loss on the last), its times and bytes taken as one layer's cost, and
// plan::choose_split chooses the contiguous split with the shortest simulated step for
// `schedule` (R costs a forward where schedule.recompute pre-triggers). Each entry's fixed bytes
// are 4 x 4 bytes per parameter (weights, gradients and AdamW's two states; used with budgets).
// What it leaves out: the first stage's I is nearly empty in a pipeline whatever it holds (its
// input needs no gradient); entry 0's profile sees that, the later entries' do not.
struct CostBalance {
  std::vector<int64_t> bounds;            // as balance_by_parameters returns them
  double step_ms = 0;                     // the split's simulated step
  std::vector<int64_t> parameter_bounds;  // balance_by_parameters(model, stages)
  double parameter_step_ms = 0;           // its simulated step
  std::vector<plan::LayerCost> entries;   // each entry's measured cost, in model order
};

// ConfigError for fewer entries than the schedule's stages, a schedule the generator refuses,
// and a profile that fails (naming the entry).
CostBalance balance_by_cost(const torch::nn::Sequential& model,
                            const schedule::ScheduleOptions& schedule, const MicroBatch& sample,
                            const LossFn& loss, int repeats = 3, int warmup = 1,
                            Precision precision = Precision::kFloat32);

}  // namespace pipemat::pp
