// `pipemat plan` (train/plan.h): the config's profiles, its planning problem and the plan.

#include "pipemat/train/plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/models/gpt.h"
#include "pipemat/models/llama.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/pp/compute.h"
#include "pipemat/pp/device.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/pp/profile.h"
#include "pipemat/train/model_run.h"
#include "train_optimizer.h"

namespace pipemat::train {
namespace {

constexpr double kFloatBytes = 4.0;

int optimizer_states(const TrainingOptions& t) {
  if (t.optimizer == OptimizerKind::kAdamW) return 2;
  return t.momentum > 0 ? 1 : 0;
}

// The layers of the model kind: their paths in a stage, one fresh layer, its input.
struct LayerKind {
  std::string prefix;  // "layers" / "blocks"
  std::function<torch::nn::AnyModule()> make;
  at::Tensor input;
  std::vector<int64_t> bounds;  // first layer of every stage, then the end
};

LayerKind layer_kind(const TrainConfig& config, int stages) {
  LayerKind kind;
  const models::ModelOptions& m = config.model;
  if (m.kind == models::ModelKind::kGpt) {
    models::GptShape shape = models::gpt_shape(m);
    kind.bounds = models::partition_gpt(models::build_gpt(shape, config.training.seed),
                                        config.partition, stages);
    kind.prefix = "blocks";
    kind.make = [shape] { return torch::nn::AnyModule(models::GptBlock(shape)); };
    kind.input = at::randn({m.batch, shape.seq_len, shape.hidden});
    return kind;
  }
  if (m.kind == models::ModelKind::kLlama) {
    models::LlamaShape shape = models::llama_shape(m);
    kind.bounds = models::partition_llama(models::build_llama(shape, config.training.seed),
                                          config.partition, stages);
    kind.prefix = "layers";
    kind.make = [shape] { return torch::nn::AnyModule(models::LlamaBlock(shape)); };
    kind.input = at::randn({m.batch, shape.seq_len, shape.hidden});
    return kind;
  }
  models::ModelOptions one = m;
  one.layers = 1;
  kind.bounds = models::partition_layers(models::build_layers(m, config.training.seed),
                                         config.partition, stages);
  kind.prefix = "layers";
  kind.make = [one, seed = config.training.seed] {
    return models::build_layers(one, seed).front();
  };
  kind.input = at::randn({m.tokens, m.hidden});
  return kind;
}

// The candidate of `layer` whose SAVE regions are the selective policy's for the kind.
int selective_candidate(const pp::LayerCandidates& layer, const TrainConfig& config,
                        const std::string& prefix) {
  models::RematConfig selective = config.remat;
  selective.policy = models::RematPolicyKind::kSelective;
  const remat::RematPolicy policy = models::stage_policy(config.model, selective);
  std::vector<std::pair<std::string, bool>> want;
  const std::string head = prefix + ".*.";
  for (const remat::ExcludeRule& rule : policy.exclude) {
    if (rule.path.compare(0, head.size(), head) != 0) return -1;
    want.emplace_back(rule.path.substr(head.size()), rule.save_output);
  }
  std::sort(want.begin(), want.end());
  for (size_t k = 0; k < layer.policies.size(); ++k) {
    const pp::LayerPolicy& p = layer.policies[k];
    if (!p.checkpoint) continue;
    std::vector<std::pair<std::string, bool>> got;
    for (const remat::ExcludeRule& rule : p.exclude) got.emplace_back(rule.path, rule.save_output);
    std::sort(got.begin(), got.end());
    if (got == want) return static_cast<int>(k);
  }
  return -1;
}

// Median ms of the optimizer step of `params` (their gradients set), with the gradient norms
// and their scaling when the config clips (as pp's clipping computes them).
double optimizer_ms(const TrainingOptions& training, const std::vector<at::Tensor>& params,
                    c10::Device device, int repeats, int warmup) {
  if (params.empty()) return 0.0;
  const auto optimizer = make_optimizer(training, params);
  std::vector<double> times;
  for (int r = 0; r < warmup + repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (training.clip_grad_norm > 0) {
      std::vector<at::Tensor> norms;
      for (const auto& p : params) {
        if (p.grad().defined()) norms.push_back(p.grad().data().norm(2.0));
      }
      const double total = norms.empty() ? 0.0 : at::stack(norms).norm(2.0).item<double>();
      const double scale = training.clip_grad_norm / (total + 1e-6);
      if (scale < 1.0) {
        for (const auto& p : params) {
          if (p.grad().defined()) p.grad().data().mul_(scale);
        }
      }
    }
    optimizer->step();
    pp::synchronize_device(device);  // a CUDA step returns before its kernels ran
    if (r >= warmup) {
      times.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The candidates of one layer of the kind. Note [Plan inputs]: every candidate gets the times
// of `none` for F, I, W and B (only what it keeps and replays differs).
pp::LayerCandidates profile_layer_kind(const LayerKind& kind, const PlanOptions& options,
                                       pp::Precision precision) {
  pp::ProfileOptions profile_options;
  profile_options.precision = precision;
  profile_options.repeats = options.repeats;
  profile_options.warmup = options.warmup;
  profile_options.max_save_leaves = options.max_save_leaves;
  profile_options.save_sets = options.save_sets;
  pp::LayerCandidates layer =
      pp::profile_layer(kind.prefix + ".*", kind.make, kind.input, profile_options);
  const plan::Candidate none = layer.profile.candidates.front();
  for (plan::Candidate& c : layer.profile.candidates) {
    c.forward = none.forward;
    c.backward_input = none.backward_input;
    c.backward_weight = none.backward_weight;
    c.backward = none.backward;
  }
  return layer;
}

// The bytes of a stage beyond its layers' candidates, from its whole profile.
plan::StageBytes stage_bytes(const pp::StageProfile& whole, double gradients) {
  plan::StageBytes bytes;
  bytes.gradients = gradients;
  bytes.backward_input = std::max(0.0, whole.input_peak_bytes);
  bytes.input_held = std::max(0.0, whole.input_held_bytes);
  bytes.backward_weight = std::max(0.0, whole.weight_peak_bytes);
  bytes.received_input = whole.input_bytes;
  bytes.received_gradient = whole.output_gradient_bytes;
  bytes.first_backward_gradients =
      std::clamp(whole.first_backward_peak_bytes - whole.backward_peak_bytes, 0.0, gradients);
  return bytes;
}

// Note [Plan inputs]: the stage's sums under `none` are the whole stage's measurements; what
// its `layers` layers (each `none`) leave is the stage's own "fixed" entry.
plan::Candidate stage_rest(const pp::StageProfile& whole, const plan::Candidate& none,
                           int64_t layers) {
  const double n = static_cast<double>(layers);
  plan::Candidate rest;
  rest.name = "fixed";
  rest.resident_bytes = whole.input_bytes + whole.resident_bytes - n * none.resident_bytes;
  rest.forward = whole.forward - n * none.forward;
  rest.backward_input = whole.backward_input - n * none.backward_input;
  rest.backward_weight = whole.backward_weight - n * none.backward_weight;
  rest.backward = whole.backward - n * none.backward;
  rest.forward_temporary_bytes = std::max(0.0, whole.forward_peak_bytes - whole.resident_bytes);
  rest.backward_temporary_bytes = std::max(0.0, whole.backward_peak_bytes);
  return rest;
}

// Appends stage `s` to the problem: its fixed entry `rest`, then each of its layers with the
// layer kind's candidates.
// `stage_fixed` and `layer_fixed`: the stage's and one layer's held_bytes_of.
void add_stage_entries(PlanReport& report, int s, const LayerKind& kind,
                       const std::vector<plan::Candidate>& candidates, plan::Candidate rest,
                       double stage_fixed, double layer_fixed) {
  plan::PlanProblem& problem = report.problem;
  const int64_t first = kind.bounds[static_cast<size_t>(s)];
  const int64_t end = kind.bounds[static_cast<size_t>(s) + 1];
  problem.layers.push_back({"stage " + std::to_string(s), {std::move(rest)}});
  problem.stage_of_layer.push_back(s);
  report.is_layer.push_back(false);
  report.entry_fixed_bytes.push_back(stage_fixed - static_cast<double>(end - first) * layer_fixed);
  for (int64_t l = first; l < end; ++l) {
    problem.layers.push_back({kind.prefix + "." + std::to_string(l), candidates});
    problem.stage_of_layer.push_back(s);
    report.is_layer.push_back(true);
    report.entry_fixed_bytes.push_back(layer_fixed);
  }
}

// What `params` parameters hold for the whole step: weights, gradients and optimizer state.
double held_bytes_of(double params, const TrainingOptions& training) {
  return params * kFloatBytes * (2 + optimizer_states(training));
}

// Profiles every stage of `run` (each on the outputs of the one before) into the problem, and
// returns each rank's parameters, their gradients set by the profiles.
std::vector<std::vector<at::Tensor>> profile_stages(PlanReport& report, const ModelRun& run,
                                                    const schedule::Schedule& plan_schedule,
                                                    const LayerKind& kind,
                                                    const pp::LayerCandidates& layer,
                                                    c10::Device device,
                                                    const PlanOptions& options) {
  const TrainConfig& config = report.config;
  plan::PlanProblem& problem = report.problem;
  const int ranks = static_cast<int>(config.schedule.ranks);
  const int stages = plan_schedule.stages_count;
  const plan::Candidate& none = layer.profile.candidates.front();
  double layer_params = 0;
  for (const auto& p : kind.make().ptr()->parameters()) {
    layer_params += static_cast<double>(p.numel());
  }
  const double layer_fixed = held_bytes_of(layer_params, config.training);
  problem.fixed_bytes.assign(static_cast<size_t>(ranks), 0.0);
  problem.stage_bytes.assign(static_cast<size_t>(stages), {});
  problem.message_cost = options.message_ms;
  pp::MicroBatch data = run.train_data(0, 0);
  for (auto& t : data.inputs) t = pp::copy_to_device(t, device);  // where the ranks compute
  for (auto& t : data.targets) t = pp::copy_to_device(t, device);
  pp::Tensors inputs = data.inputs;
  std::vector<std::vector<at::Tensor>> rank_params(static_cast<size_t>(ranks));
  for (int s = 0; s < stages; ++s) {
    const pp::PipelineStage stage = run.stage(s);
    if (!device.is_cpu()) stage.module->to(device);
    const auto stage_params = stage.module->parameters();
    auto& params_of_rank = rank_params[static_cast<size_t>(plan_schedule.rank_of(s))];
    params_of_rank.insert(params_of_rank.end(), stage_params.begin(), stage_params.end());
    double params = 0;
    for (const auto& p : stage_params) params += static_cast<double>(p.numel());
    const double gradients = params * kFloatBytes;
    problem.fixed_bytes[static_cast<size_t>(plan_schedule.rank_of(s))] +=
        gradients * (1 + optimizer_states(config.training));
    const bool last = s == stages - 1;
    const pp::StageProfile whole = pp::profile_stage(
        stage, inputs, last ? run.loss : pp::LossFn{}, last ? data.targets : pp::Tensors{},
        options.repeats, options.warmup, config.training.precision);
    inputs = whole.outputs;
    problem.stage_bytes[static_cast<size_t>(s)] = stage_bytes(whole, gradients);
    const int64_t layers =
        kind.bounds[static_cast<size_t>(s) + 1] - kind.bounds[static_cast<size_t>(s)];
    add_stage_entries(report, s, kind, layer.profile.candidates, stage_rest(whole, none, layers),
                      held_bytes_of(params, config.training), layer_fixed);
  }
  return rank_params;
}

// One line on what was planned and how it was profiled.
std::string plan_summary(const PlanReport& report, const std::string& model_summary,
                         const pp::LayerCandidates& layer, int stages, int threads, int cores) {
  const TrainConfig& config = report.config;
  const plan::PlanProblem& problem = report.problem;
  const int ranks = static_cast<int>(config.schedule.ranks);
  const int replicas = static_cast<int>(config.parallel.data);
  return model_summary + "; " + to_string(config.schedule.kind) + " on " + std::to_string(ranks) +
         " ranks (" + std::to_string(stages) + " stages), " +
         std::to_string(config.schedule.micro_batches) + " micro-batches; " +
         std::to_string(layer.profile.candidates.size()) + " candidates per layer (" +
         join(layer.save_leaves, ", ") + " as SAVE leaves), profiled with " +
         std::to_string(threads) + (threads == 1 ? " thread" : " threads") +
         (problem.parallel_ranks > 0 && problem.parallel_ranks < ranks
              ? "; " + std::to_string(problem.parallel_ranks) +
                    (problem.parallel_ranks == 1 ? " rank computes" : " ranks compute") +
                    " at once (" + std::to_string(cores) + " cores)"
              : "") +
         (replicas > 1 ? "; every one of " + std::to_string(replicas) +
                             " replicas (parallel.data) runs this plan"
                       : "");
}

}  // namespace

std::vector<double> budgets_per_rank(const std::vector<int64_t>& budget_bytes, int ranks,
                                     const std::string& who) {
  PIPEMAT_CHECK(budget_bytes.size() == 1 || budget_bytes.size() == static_cast<size_t>(ranks),
                ConfigError, who, ": ", budget_bytes.size(), " memory budgets for ", ranks,
                " ranks; give one for every rank or one per rank");
  std::vector<double> out;
  for (int r = 0; r < ranks; ++r) {
    const int64_t b = budget_bytes[budget_bytes.size() == 1 ? 0 : static_cast<size_t>(r)];
    PIPEMAT_CHECK(b > 0, ConfigError, who, ": a memory budget must be > 0 bytes, got ", b);
    out.push_back(static_cast<double>(b));
  }
  return out;
}

PlanReport run_plan(const TrainConfig& config, const PlanOptions& options) {
  budgets_per_rank(options.budget_bytes, static_cast<int>(config.schedule.ranks), "plan");
  PlanReport report = profile_plan(config, options);
  solve_plan(report, options.budget_bytes);
  return report;
}

PlanReport profile_plan(const TrainConfig& given, const PlanOptions& options) {
  PIPEMAT_CHECK(given.schedule_csv.empty(), ConfigError,
                "plan: schedule.csv is not supported; plan a generated schedule (schedule.kind)");
  PIPEMAT_CHECK(given.schedule.kind != schedule::ScheduleKind::kImported, ConfigError,
                "plan: an imported schedule is not supported");
  const int ranks = given.schedule.ranks;
  PlanReport report;
  report.config = given;
  TrainConfig& config = report.config;
  config.schedule.recompute = schedule::RecomputeMode::kPretrigger;
  config.remat.policy = models::RematPolicyKind::kNone;
  config.remat.custom = {};
  config.remat.stages.clear();

  const int threads = config.training.threads > 0 ? static_cast<int>(config.training.threads)
                                                  : pp::default_compute_threads(ranks);
  pp::set_compute_threads(threads);
  at::manual_seed(static_cast<uint64_t>(config.training.seed));

  plan::PlanProblem& problem = report.problem;
  problem.schedule = config.schedule;
  const schedule::Schedule plan_schedule = plan::plan_schedule(problem);
  const int stages = plan_schedule.stages_count;
  const ModelRun run = make_model_run(config, stages);
  // Note [Plan memory] counts the bytes of the device the ranks compute on: the profiles run
  // there (rank 0's for `cuda`), so the budgets are that device's bytes.
  const c10::Device device = pp::resolve_device(config.training.device, 0, "training.device");
  LayerKind kind = layer_kind(config, stages);
  kind.input = pp::copy_to_device(kind.input, device);
  const pp::LayerCandidates layer = profile_layer_kind(kind, options, config.training.precision);
  const std::vector<std::vector<at::Tensor>> rank_params =
      profile_stages(report, run, plan_schedule, kind, layer, device, options);
  // The step's tail on each rank: its optimizer step (and gradient norms) on its parameters,
  // whose gradients the stages' profiles left.
  for (int r = 0; r < ranks; ++r) {
    problem.step_tail.push_back(optimizer_ms(config.training, rank_params[static_cast<size_t>(r)],
                                             device, options.repeats, options.warmup));
  }
  problem.tails_wait_for_all = config.training.clip_grad_norm > 0;
  const int cores =
      options.cores >= 0 ? options.cores : static_cast<int>(std::thread::hardware_concurrency());
  // The D replicas of parallel.data share the machine's cores: a replica's ranks get 1/D of them.
  const int replicas = static_cast<int>(config.parallel.data);
  problem.parallel_ranks = cores > 0 ? std::max(1, cores / threads / replicas) : 0;
  problem.shared_speed = options.shared_speed;
  report.selective = selective_candidate(layer, config, kind.prefix);
  report.policies = layer.policies;
  report.summary = plan_summary(report, run.summary, layer, stages, threads, cores);
  if (!device.is_cpu()) report.summary += "; profiled on " + device.str() + " (training.device)";
  return report;
}

void solve_plan(PlanReport& report, const std::vector<int64_t>& budget_bytes) {
  plan::PlanProblem& problem = report.problem;
  const int ranks = static_cast<int>(problem.schedule.ranks);
  problem.budget_bytes = budgets_per_rank(budget_bytes, ranks, "plan");
  report.uniform.clear();
  for (models::RematPolicyKind policy : uniform_policies(report)) {
    report.uniform.push_back(
        {to_string(policy), plan::evaluate(problem, uniform_choice(report, policy))});
  }
  report.config.remat.stages.clear();
  report.result = plan::solve(problem);
  report.config.remat.stages = stages_of_plan(report, report.result.best.choice);
}

std::vector<models::RematPolicyKind> uniform_policies(const PlanReport& report) {
  std::vector<models::RematPolicyKind> out = {models::RematPolicyKind::kNone,
                                              models::RematPolicyKind::kFull};
  if (report.selective >= 0) out.push_back(models::RematPolicyKind::kSelective);
  return out;
}

std::vector<int> uniform_choice(const PlanReport& report, models::RematPolicyKind policy) {
  PIPEMAT_CHECK(policy != models::RematPolicyKind::kSelective || report.selective >= 0, ConfigError,
                "plan: the layer has no candidate that remat.policy selective runs");
  const int candidate = policy == models::RematPolicyKind::kNone   ? 0
                        : policy == models::RematPolicyKind::kFull ? 1
                                                                   : report.selective;
  std::vector<int> choice;
  for (bool is_layer : report.is_layer) choice.push_back(is_layer ? candidate : 0);
  return choice;
}

TrainConfig uniform_config(const PlanReport& report, models::RematPolicyKind policy) {
  TrainConfig config = report.config;
  config.remat.policy = policy;
  // Every stage by name, so that the run checkpoints every stage as the prediction does (Note
  // [Replays that cannot lower a peak] would drop the replays of some under remat.policy).
  const int stages =
      report.problem.stage_of_layer.empty() ? 0 : report.problem.stage_of_layer.back() + 1;
  config.remat.stages.assign(static_cast<size_t>(stages), models::StageRemat::named(policy));
  return config;
}

std::vector<models::StageRemat> stages_of_plan(const PlanReport& report,
                                               const std::vector<int>& choice) {
  const plan::PlanProblem& problem = report.problem;
  PIPEMAT_CHECK(choice.size() == problem.layers.size(), ConfigError, "plan: ", choice.size(),
                " choices for ", problem.layers.size(), " layers");
  const int stages = problem.stage_of_layer.empty() ? 0 : problem.stage_of_layer.back() + 1;
  std::vector<models::StageRemat> out;
  for (int s = 0; s < stages; ++s) {
    std::vector<std::string> checkpoint;
    std::vector<remat::ExcludeRule> exclude;
    int local = 0;
    for (size_t l = 0; l < problem.layers.size(); ++l) {
      if (problem.stage_of_layer[l] != s || !report.is_layer[l]) continue;
      const std::string& global = problem.layers[l].layer;
      const std::string path = global.substr(0, global.find('.')) + "." + std::to_string(local++);
      const pp::LayerPolicy& policy = report.policies.at(static_cast<size_t>(choice[l]));
      if (!policy.checkpoint) continue;
      checkpoint.push_back(path);
      for (const remat::ExcludeRule& rule : policy.exclude) {
        exclude.push_back({path + "." + rule.path, rule.save_output});
      }
    }
    out.push_back(checkpoint.empty()
                      ? models::StageRemat::named(models::RematPolicyKind::kNone)
                      : models::StageRemat::of(std::move(checkpoint), std::move(exclude)));
  }
  return out;
}

}  // namespace pipemat::train
