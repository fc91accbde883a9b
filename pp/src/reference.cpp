// Note [Single-process reference] (pipemat/pp/reference.h): the stages of a pipeline chained in
// one process.

#include "pipemat/pp/reference.h"

#include <torch/nn/utils/clip_grad.h>

#include <map>
#include <optional>
#include <string>
#include <utility>

#include "pipemat/pp/device.h"
#include "pipemat/pp/precision.h"
#include "pipemat/remat/rng.h"

namespace pipemat::pp {
namespace {

struct Chain {
  const PipelineOptions& options;
  std::vector<PipelineStage> stages;
  std::vector<at::Tensor> params;  // stage order, each in parameters() order
  TiedCopies tied;                 // Note [Tied weights]
  std::vector<at::Tensor> normed;  // params but the tied copies after the first

  Chain(const PipelineOptions& o, const StageFactory& factory) : options(o) {
    const int count = stage_count(options);
    for (int s = 0; s < count; ++s) {
      PipelineStage stage = factory(s);
      PIPEMAT_CHECK(stage.index == s, ConfigError,
                    "run_reference: the stage factory returned stage ", stage.index, " for stage ",
                    s);
      PIPEMAT_CHECK(stage.module != nullptr, ConfigError, "run_reference: stage ", s,
                    " has no module");
      PIPEMAT_CHECK(static_cast<bool>(stage.forward), ConfigError, "run_reference: stage ", s,
                    " has no forward");
      if (!options.device.is_cpu()) stage.module->to(options.device);
      for (const auto& p : stage.module->parameters()) params.push_back(p);
      stages.push_back(std::move(stage));
    }
    tied = TiedCopies(stages);
    normed = tied.normed(params);
  }

  // Note [Random streams of a step]: a fresh stream per draw site when the options are seeded.
  void enter(std::optional<remat::ThreadGeneratorScope>& rng, int64_t step, int64_t i,
             int s) const {
    if (!options.seed) return;
    const uint64_t seed = forward_seed(*options.seed, step, i, s);
    rng.emplace(seed);
    seed_device(options.device, seed);
  }

  Tensors on_device(Tensors ts) const {
    if (options.device.is_cpu()) return ts;
    for (auto& t : ts) {
      if (t.defined()) t = copy_to_device(t, options.device);
    }
    return ts;
  }

  // The scaled loss of global micro-batch i of `step`, backpropagated; returns its value.
  double micro_batch(const DataSource& data, int64_t step, int64_t i, int64_t M) const {
    MicroBatch b;
    {
      std::optional<remat::ThreadGeneratorScope> rng;
      enter(rng, step, i, kDataStream);
      b = data(step, i);
    }
    Tensors x = on_device(std::move(b.inputs));
    for (size_t s = 0; s < stages.size(); ++s) {
      std::optional<remat::ThreadGeneratorScope> rng;
      enter(rng, step, i, stage_stream(stages[s]));
      PrecisionRegion region(options.precision, options.device);  // Note [Mixed precision]
      x = stages[s].forward(x);
    }
    at::Tensor loss;
    {
      std::optional<remat::ThreadGeneratorScope> rng;
      enter(rng, step, i, kLossStream);
      loss = options.loss(loss_inputs(x, options.precision), on_device(std::move(b.targets)));
    }
    PIPEMAT_CHECK(loss.defined() && loss.numel() == 1 && at::isFloatingType(loss.scalar_type()),
                  PipelineError, "run_reference: the loss of micro-batch ", i, " of step ", step,
                  " must be a floating scalar");
    if (loss.dim() != 0) loss = loss.reshape({});
    loss = loss / static_cast<double>(M);
    const double value = loss.item<double>();
    if (loss.requires_grad()) loss.backward();
    return value;
  }

  std::vector<StageTensor> named(bool gradients) const {
    std::vector<StageTensor> out;
    for (const PipelineStage& stage : stages) {
      for (const auto& item : stage.module->named_parameters()) {
        const at::Tensor& p = item.value();
        at::Tensor t = gradients ? (p.grad().defined() ? p.grad().detach().clone() : at::Tensor())
                                 : p.detach().clone();
        out.push_back({stage.index, item.key(), std::move(t)});
      }
    }
    return out;
  }
};

}  // namespace

TiedCopies::TiedCopies(const std::vector<PipelineStage>& stages) {
  for (const PipelineStage& stage : stages) {
    for (const auto& [name, key] : stage.tied) {
      PIPEMAT_CHECK(stage.module->named_parameters().contains(name), ConfigError, "stage ",
                    stage.index, " declares '", name, "' tied (key '", key,
                    "') but its module has no parameter of that name");
      copies_[key].push_back(stage.module->named_parameters()[name]);
    }
  }
  for (const auto& [key, copies] : copies_) {
    PIPEMAT_CHECK(copies.size() >= 2, PipelineError, "tied weight '", key,
                  "' has one copy; a tie needs a copy on every stage that uses the weight");
    for (const at::Tensor& c : copies) {
      PIPEMAT_CHECK(c.sizes() == copies[0].sizes() && c.scalar_type() == copies[0].scalar_type() &&
                        at::equal(c, copies[0]),
                    PipelineError, "the copies of tied weight '", key,
                    "' differ; they must start equal");
    }
  }
}

std::vector<at::Tensor> TiedCopies::normed(const std::vector<at::Tensor>& params) const {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : params) {
    bool follower = false;
    for (const auto& [key, copies] : copies_) {
      for (size_t k = 1; k < copies.size(); ++k) follower = follower || copies[k].is_same(p);
    }
    if (!follower) out.push_back(p);
  }
  return out;
}

void TiedCopies::sum_gradients() const {
  for (const auto& [key, copies] : copies_) {
    at::Tensor sum;
    for (const at::Tensor& c : copies) {
      if (!c.grad().defined()) continue;  // adds nothing
      if (sum.defined()) {
        sum.add_(c.grad());
      } else {
        sum = c.grad().detach().clone();
      }
    }
    if (!sum.defined()) continue;
    for (size_t k = 0; k < copies.size(); ++k) {
      at::Tensor c = copies[k];
      c.mutable_grad() = k == 0 ? sum : sum.clone();
    }
  }
}

void TiedCopies::follow_clipped() const {
  for (const auto& [key, copies] : copies_) {
    if (!copies[0].grad().defined()) continue;
    for (size_t k = 1; k < copies.size(); ++k) {
      at::Tensor c = copies[k];
      c.mutable_grad() = copies[0].grad().clone();
    }
  }
}

// Note [Data x pipeline]: the mean of the replicas' gradients, summed in replica order; a
// gradient a replica did not produce counts as zeros, and none where no replica has one.
void set_mean_gradients(const std::vector<at::Tensor>& params,
                        const std::vector<std::vector<at::Tensor>>& replica_grads) {
  const auto D = static_cast<int64_t>(replica_grads.size());
  for (size_t k = 0; k < params.size(); ++k) {
    bool any = false;
    for (const auto& g : replica_grads) any = any || g[k].defined();
    if (!any) {
      params[k].mutable_grad().reset();
      continue;
    }
    const auto grad_of = [&](int64_t d) {
      const at::Tensor& g = replica_grads[static_cast<size_t>(d)][k];
      return g.defined() ? g : at::zeros_like(params[k]);
    };
    at::Tensor sum = grad_of(0).clone();
    for (int64_t d = 1; d < D; ++d) sum.add_(grad_of(d));
    sum.div_(static_cast<int>(D));
    params[k].mutable_grad() = sum;
  }
}

ReferenceRun run_reference(const PipelineOptions& options, const StageFactory& factory,
                           const DataSource& data, int64_t steps) {
  PIPEMAT_CHECK(static_cast<bool>(options.loss), ConfigError,
                "run_reference: PipelineOptions::loss is not set");
  PIPEMAT_CHECK(static_cast<bool>(options.optimizer), ConfigError,
                "run_reference: PipelineOptions::optimizer is not set");
  PIPEMAT_CHECK(steps >= 0, ConfigError, "run_reference: steps must be >= 0, got ", steps);
  const Chain chain(options, factory);
  auto optimizer = options.optimizer(chain.params);
  const int64_t M =
      options.actions ? options.actions->micro_batches : options.schedule.micro_batches;
  const int64_t D = options.data_group ? options.data_group->world_size() : 1;
  ReferenceRun run;
  for (int64_t step = 0; step < steps; ++step) {
    ReferenceStep r;
    std::vector<std::vector<at::Tensor>> replica_grads;
    for (int64_t d = 0; d < D; ++d) {
      for (auto& p : chain.params) p.mutable_grad().reset();
      double loss = 0;
      for (int64_t i = d * M; i < (d + 1) * M; ++i) loss += chain.micro_batch(data, step, i, M);
      chain.tied.sum_gradients();
      r.loss += loss;
      if (D == 1) break;
      replica_grads.emplace_back();
      for (auto& p : chain.params) replica_grads.back().push_back(p.grad());
    }
    if (D > 1) {
      r.loss /= static_cast<double>(D);
      set_mean_gradients(chain.params, replica_grads);
    }
    if (options.clip_grad_norm > 0) {
      r.grad_norm = torch::nn::utils::clip_grad_norm_(chain.normed, options.clip_grad_norm);
      chain.tied.follow_clipped();
    }
    r.gradients = chain.named(/*gradients=*/true);
    if (options.lr_schedule) options.lr_schedule(*optimizer, step);
    optimizer->step();
    run.steps.push_back(std::move(r));
  }
  run.parameters = chain.named(/*gradients=*/false);
  run.stages = chain.stages;
  return run;
}

}  // namespace pipemat::pp
