// The oracle (`pipemat train --reference`): the stages of a run chained in one process, with
// the same progress lines and metrics file as the pipeline's last rank.

#include "pipemat/train/train.h"

#include <torch/nn/utils/clip_grad.h>

#include <chrono>
#include <optional>

#include "pipemat/core/stats.h"
#include "pipemat/pp/compute.h"
#include "pipemat/pp/device.h"
#include "pipemat/pp/precision.h"
#include "pipemat/pp/reference.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/rng.h"
#include "pipemat/train/launched_run.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/weights.h"
#include "train_optimizer.h"
#include "train_report.h"

namespace pipemat::train {
namespace {

double since_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The same stages as the pipeline of a (resolved) config, chained in one process: no transport,
// no remat. Stage s of micro-batch i draws from forward_seed(seed, step, i, stage_stream(stage
// s)) when the model is random, as the pipeline's ranks do (Note [Random streams of a step]).
struct Chain {
  ModelRun run;
  std::vector<pp::PipelineStage> stages;
  std::vector<at::Tensor> params;
  pp::TiedCopies tied;
  std::vector<at::Tensor> normed;  // params but each tied weight's later copies
  uint64_t seed = 0;
  c10::Device device;  // training.device, as rank 0's (the reference is one process)
  pp::Precision precision = pp::Precision::kFloat32;

  explicit Chain(const TrainConfig& config)
      : seed(config.training.seed),
        device(pp::resolve_device(config.training.device, 0, "training.device")),
        precision(config.training.precision) {
    pp::PipelineOptions shape;
    shape.schedule = config.schedule;
    const int count = pp::stage_count(shape);
    // The chain computes the same bits on any split (Note [Layer streams]): partition auto
    // (Note [Split by cost]) runs the parameter split here, unprofiled.
    TrainConfig split = config;
    if (split.partition.by_cost) split.partition = {};
    run = make_model_run(split, count);
    std::vector<std::pair<int, torch::nn::Module*>> all;
    for (int s = 0; s < count; ++s) {
      stages.push_back(run.stage(s));
      all.emplace_back(s, stages.back().module.get());
    }
    if (!config.training.init_from.empty()) {  // the reference does not resume
      load_weights(config.training.init_from, "training.init_from",
                   model_weight_shapes(run, config.model.kind), run.global_name, config.model.kind,
                   all, config.training.allow_non_finite);
    }
    for (auto& stage : stages) {
      if (!device.is_cpu()) stage.module->to(device);
      for (const auto& p : stage.module->parameters()) params.push_back(p);
    }
    tied = pp::TiedCopies(stages);  // Note [Tied weights]
    normed = tied.normed(params);
  }

  pp::Tensors forward(pp::Tensors x, int64_t step, int64_t i) const {
    for (auto& t : x) t = on_device(t);
    for (size_t s = 0; s < stages.size(); ++s) {
      std::optional<remat::ThreadGeneratorScope> rng;
      if (run.random) {
        const uint64_t stage_seed = pp::forward_seed(seed, step, i, pp::stage_stream(stages[s]));
        rng.emplace(stage_seed);
        pp::seed_device(device, stage_seed);
      }
      pp::PrecisionRegion region(precision, device);  // Note [Mixed precision]
      x = stages[s].forward(x);
    }
    return x;
  }

  // The loss of one micro-batch, its targets on the device.
  at::Tensor loss(const pp::Tensors& outputs, pp::Tensors targets) const {
    for (auto& t : targets) t = on_device(t);
    return run.loss(pp::loss_inputs(outputs, precision), targets);
  }

  at::Tensor on_device(const at::Tensor& t) const {
    return t.defined() && !device.is_cpu() ? t.to(device) : t;
  }
};

// Note [Data x pipeline]: replica d's micro-batches d*M .. d*M + M-1 into a gradient of its
// own; returns each replica's loss. With one replica the gradient stays in the parameters, else
// `replica_grads` gets each replica's.
std::vector<double> backward_replicas(const Chain& chain, int64_t step, int64_t M, int64_t D,
                                      std::vector<std::vector<at::Tensor>>& replica_grads) {
  const std::vector<at::Tensor>& all = chain.params;
  std::vector<double> replica_loss;
  for (int64_t d = 0; d < D; ++d) {
    for (auto& p : all) p.mutable_grad().reset();
    double loss_sum = 0;
    for (int64_t i = d * M; i < (d + 1) * M; ++i) {
      const pp::MicroBatch b = chain.run.train_data(step, i);
      auto loss = chain.loss(chain.forward(b.inputs, step, i), b.targets) / static_cast<double>(M);
      loss_sum += loss.item<double>();
      loss.backward();
    }
    chain.tied.sum_gradients();
    replica_loss.push_back(loss_sum);
    if (D == 1) break;
    replica_grads.emplace_back();
    for (auto& p : all) replica_grads.back().push_back(p.grad());
  }
  return replica_loss;
}

// The validation loss after `step`: the mean over the eval micro-batches, forward only, in eval
// mode.
double reference_validation_loss(const Chain& chain, const TrainConfig& config, int64_t step) {
  for (auto& c : chain.stages) c.module->eval();
  c10::AutoGradMode no_grad(false);
  const int64_t E = config.training.eval_batches;
  double loss = 0;
  for (int64_t i = 0; i < E; ++i) {
    const pp::MicroBatch b = chain.run.eval_data(step, i);
    loss += (chain.loss(chain.forward(b.inputs, step, i), b.targets) / static_cast<double>(E))
                .item<double>();
  }
  for (auto& c : chain.stages) c.module->train();
  return loss;
}

}  // namespace

std::vector<StepMetrics> run_reference(const TrainConfig& given,
                                       std::vector<std::pair<std::string, at::Tensor>>* params,
                                       std::vector<std::pair<int64_t, double>>* validation,
                                       double* tokens_per_byte,
                                       const StopRequested& stop_requested) {
  const TrainConfig config = resolve_schedule(given).config;
  const Chain chain(config);
  if (tokens_per_byte != nullptr) *tokens_per_byte = chain.run.validation_tokens_per_byte;
  const ModelRun& run = chain.run;
  const std::vector<at::Tensor>& all = chain.params;
  auto optimizer = make_optimizer(config.training, all);
  const pp::LrSchedule lr_schedule = lr_schedule_of(config.training);
  std::vector<StepMetrics> out;
  const int64_t M = config.schedule.micro_batches;
  const int64_t D = config.parallel.data;
  const int64_t eval_every = run.eval_data ? config.training.eval_every : 0;
  for (int64_t step = 0; step < config.training.steps; ++step) {
    if (stop_requested && stop_requested()) break;
    StepMetrics m;
    m.step = step;
    remat::reset_peak_bytes();
    const int64_t bytes0 = remat::memory_stats().current_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::vector<at::Tensor>> replica_grads;
    const std::vector<double> replica_loss = backward_replicas(chain, step, M, D, replica_grads);
    if (D == 1) {
      m.loss = replica_loss[0];
    } else {
      for (double l : replica_loss) m.loss += l;
      m.loss /= static_cast<double>(D);
      pp::set_mean_gradients(all, replica_grads);  // Note [Data x pipeline]
    }
    if (config.training.clip_grad_norm > 0) {
      m.grad_norm = torch::nn::utils::clip_grad_norm_(chain.normed, config.training.clip_grad_norm);
      chain.tied.follow_clipped();
    }
    if (lr_schedule) lr_schedule(*optimizer, step);
    optimizer->step();
    m.step_ms = since_ms(t0);
    m.busy_ms = m.step_ms;
    m.start_bytes = bytes0;
    m.resident_peak_bytes = pp::peak_resident_bytes();
    m.peak_bytes = remat::memory_stats().peak_bytes - bytes0;
    out.push_back(std::move(m));
    if (eval_every > 0 && ((step + 1) % eval_every == 0 || step + 1 == config.training.steps) &&
        validation) {
      validation->push_back({step, reference_validation_loss(chain, config, step)});
    }
  }
  if (params) {
    params->clear();
    for (int s = 0; s < static_cast<int>(chain.stages.size()); ++s) {
      for (const auto& item : chain.stages[static_cast<size_t>(s)].module->named_parameters()) {
        params->emplace_back(run.global_name(s, item.key()), item.value());
      }
    }
  }
  return out;
}

std::function<void()> micro_batch_work(const TrainConfig& given) {
  auto chain = std::make_shared<const Chain>(resolve_schedule(given).config);
  auto batch = std::make_shared<const pp::MicroBatch>(chain->run.train_data(0, 0));
  return [chain, batch] {
    for (auto p : chain->params) p.mutable_grad().reset();
    chain->run.loss(chain->forward(batch->inputs, 0, 0), batch->targets).backward();
  };
}

void set_training_threads(const TrainConfig& config, int threads) {
  if (!config.training.thread_probe || threads == 1) {
    pp::set_compute_threads(threads);
    return;
  }
  pp::choose_compute_threads(threads, micro_batch_work(config));
}

std::optional<ReferenceFigures> measure_reference(const TrainConfig& config, int64_t steps,
                                                  int threads,
                                                  const StopRequested& stop_requested) {
  remat::install_tracking_allocator();
  set_training_threads(config, threads);
  TrainConfig short_run = config;
  short_run.training.steps = steps;
  // What this process holds already (the pipeline's stages when called after training) is not
  // the reference's: its bytes are counted from here.
  const int64_t base = remat::memory_stats().current_bytes;
  const std::vector<StepMetrics> run =
      run_reference(short_run, nullptr, nullptr, nullptr, stop_requested);
  if (static_cast<int64_t>(run.size()) < steps) return std::nullopt;  // stopped
  ReferenceFigures f;
  f.steps = steps;
  const pp::ComputeInfo compute = pp::compute_info();
  f.threads = compute.threads;
  f.choice = compute.choice;
  // The first third of the steps warms up (page faults, the allocator, LibTorch's caches).
  std::vector<double> times;
  for (size_t i = static_cast<size_t>(steps / 3); i < run.size(); ++i) {
    times.push_back(run[i].step_ms);
  }
  f.measured_steps = static_cast<int64_t>(times.size());
  f.step_ms = median(times);
  for (const StepMetrics& m : run)
    f.peak_bytes = std::max(f.peak_bytes, m.start_bytes + m.peak_bytes - base);
  return f;
}

TrainResult train_reference(const TrainConfig& config, std::ostream* progress) {
  remat::install_tracking_allocator();
  if (progress && config.output.progress) {
    const c10::Device device = pp::resolve_device(config.training.device, 0, "training.device");
    print_compute(*progress, 1,
                  {"", place_of_device(device, config.training.device), config.training.precision});
  }
  TrainResult result;
  result.last_stage_rank = true;
  double tokens_per_byte = 0;
  result.steps = run_reference(config, &result.params, &result.validation, &tokens_per_byte);
  MetricsFile metrics(config.output.metrics);
  Pace pace;
  pace.tokens_per_step =
      tokens_per_micro_batch(config.model) * config.schedule.micro_batches * config.parallel.data;
  size_t next_validation = 0;
  for (const auto& m : result.steps) {
    std::optional<double> validation;
    if (next_validation < result.validation.size() &&
        result.validation[next_validation].first == m.step) {
      validation = result.validation[next_validation++].second;
    }
    metrics.write(m, validation);
    if (progress && config.output.progress) {
      print_progress(*progress, config, m, false, pace);
      if (validation) print_validation(*progress, m.step, *validation, tokens_per_byte);
    }
  }
  return result;
}

}  // namespace pipemat::train
