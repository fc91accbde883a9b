#pragma once
// The single-process reference of a pipeline of your own stages: every stage built in this
// process and chained per micro-batch, to compare a Pipeline with in one call.
//
//   pipemat::pp::ReferenceRun want = pipemat::pp::run_reference(options, factory, data, steps);
//   // want.steps[t].loss / .grad_norm equal StepMetrics::loss / ::grad_norm of step t,
//   // want.steps[t].gradients the gradients each stage holds after train_step,
//   // want.parameters the parameters after the last step, bitwise.
//
// Note [Single-process reference]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// run_reference does what a Pipeline does to the same options, factory and data, in one process
// and without a schedule, so that the results are the pipeline's bit for bit: the factory is
// called for every stage 0 .. stage_count(options) - 1; each step resets every gradient (to
// undefined), then for each micro-batch i = 0 .. M-1 in order (M: options.schedule.micro_batches,
// or the imported action list's) calls the data source, runs the stages in order on the inputs
// and backpropagates loss(outputs, targets) / M, so every parameter accumulates its
// micro-batches in micro-batch order as every pipeline stage does; then clips with
// torch::nn::utils::clip_grad_norm_ over all parameters in stage order (the pipeline's global
// norm), calls lr_schedule and steps one optimizer made by options.optimizer over all
// parameters in stage order (a per-parameter optimizer such as SGD or AdamW steps each
// parameter as the ranks' optimizers do). Copies of a tied weight (Note [Tied weights]) take
// the sum of their gradients in stage order after each replica's micro-batches, the norm leaves
// out every copy but the first, and the others take the first's clipped gradient. With options.seed
// the data source, each stage's forward and the loss draw from the streams of Note [Random streams
// of a step]; with options.precision every stage forward is a PrecisionRegion and the loss takes
// loss_inputs (Note [Mixed precision]); the modules and data go to options.device. With a data
// group of D ranks (Note [Data x pipeline]) each step runs the D x M global micro-batches, replica
// d's d*M .. d*M + M-1 into a gradient of its own, and sets the mean of the D gradients summed in
// replica order; the loss is the mean of the replicas' losses. No remat: recomputation does not
// change a pipeline's bits (options.remat and stage_remat are ignored). train::run_reference
// chains the zoo models of `pipemat train` the same way.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "pipemat/pp/pipeline.h"

namespace pipemat::pp {

// A parameter or gradient of stage `stage`, by its name in that stage's module.
struct StageTensor {
  int stage = -1;
  std::string name;
  at::Tensor tensor;  // undefined: no gradient reached the parameter this step
};

struct ReferenceStep {
  double loss = 0;       // the mean micro-batch loss (StepMetrics::loss)
  double grad_norm = 0;  // the global norm before clipping; 0 without clipping
  // Every parameter's gradient as the optimizer stepped with it (after clipping), in stage
  // order: what the pipeline's stage modules hold after train_step.
  std::vector<StageTensor> gradients;
};

struct ReferenceRun {
  std::vector<ReferenceStep> steps;
  std::vector<StageTensor> parameters;  // after the last step, in stage order
  std::vector<PipelineStage> stages;    // the stages the factory built, trained
};

// Note [Single-process reference]: `steps` (>= 0) training steps of the stages of `factory`,
// chained in this process. ConfigError for a missing loss or optimizer or a factory that
// returns another stage index, no module or no forward, as Pipeline.
ReferenceRun run_reference(const PipelineOptions& options, const StageFactory& factory,
                           const DataSource& data, int64_t steps);

// Note [Tied weights] in one process: the copies `stages` declare, by key, in stage order.
// PipelineError for a key with one copy or copies that differ; ConfigError for a name that is
// not a parameter of its stage's module.
class TiedCopies {
 public:
  TiedCopies() = default;
  explicit TiedCopies(const std::vector<PipelineStage>& stages);
  // Every copy's gradient becomes the sum of the copies' gradients in stage order (a copy
  // without one adds nothing), as a pipeline sets it after a step's actions.
  void sum_gradients() const;
  // `params` without the copies after each key's first: what the global norm counts.
  std::vector<at::Tensor> normed(const std::vector<at::Tensor>& params) const;
  // After clipping normed(...): each later copy takes the first copy's gradient.
  void follow_clipped() const;
  bool empty() const { return copies_.empty(); }

 private:
  std::map<std::string, std::vector<at::Tensor>> copies_;
};

// Note [Data x pipeline]: sets the gradient of params[k] to the mean of the replicas' gradients
// replica_grads[d][k], summed in replica order (g_0 + g_1 + ... then divided by D), a gradient a
// replica did not produce counting as zeros; none where no replica has one.
void set_mean_gradients(const std::vector<at::Tensor>& params,
                        const std::vector<std::vector<at::Tensor>>& replica_grads);

}  // namespace pipemat::pp
