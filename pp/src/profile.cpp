// The remat profiler (pp/profile.h): candidates from the module tree, measured one at a time.

#include "pipemat/pp/profile.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

#include "device_meter.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/stats.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/schedule/schedule.h"
#include "split_backward.h"

namespace pipemat::pp {
namespace {

// The device of the first defined input: where a stage is profiled (the CPU without one).
c10::Device device_of(const Tensors& inputs) {
  for (const at::Tensor& t : inputs) {
    if (t.defined()) return t.device();
  }
  return c10::Device(c10::kCPU);
}

// The layer as entry "0" of a Sequential, so that remat paths address it as "0" and "0.<child>".
torch::nn::Sequential wrap(const torch::nn::AnyModule& layer) {
  torch::nn::Sequential seq;
  seq->push_back(layer);
  return seq;
}

remat::RematPolicy full_policy(const LayerPolicy& p) {
  remat::RematPolicy policy;
  if (!p.checkpoint) return policy;
  policy.checkpoint = {"0"};
  for (const auto& rule : p.exclude) policy.exclude.push_back({"0." + rule.path, rule.save_output});
  return policy;
}

// The descendants that remat can declare SAVE regions, as paths below the layer.
std::vector<std::string> excludable(const std::function<torch::nn::AnyModule()>& make_layer) {
  std::vector<std::string> paths;
  const torch::nn::Sequential probe = wrap(make_layer());
  for (const auto& item : probe->named_modules("", /*include_self=*/false)) {
    if (item.key().rfind("0.", 0) != 0) continue;
    const std::string below = item.key().substr(2);
    torch::nn::Sequential fresh = wrap(make_layer());
    try {
      remat::apply_policy(*fresh, full_policy({true, {{below, true}}}));
      paths.push_back(below);
    } catch (const RematError&) {
      // Called directly by its parent: not declarable.
    }
  }
  return paths;
}

// The paths of `all` with no other path of `all` below them.
std::vector<std::string> leaves_of(const std::vector<std::string>& all) {
  std::vector<std::string> leaves;
  for (const std::string& p : all) {
    const bool inner = std::any_of(all.begin(), all.end(), [&](const std::string& q) {
      return q.size() > p.size() && q.compare(0, p.size() + 1, p + ".") == 0;
    });
    if (!inner) leaves.push_back(p);
  }
  return leaves;
}

// The `keep` leaves with the most parameters (the GEMMs whose replay a SAVE region skips), in
// module order; ties go to the earlier leaf.
std::vector<std::string> keep_largest(std::vector<std::string> leaves,
                                      const std::function<torch::nn::AnyModule()>& make_layer,
                                      size_t keep) {
  if (leaves.size() <= keep) return leaves;
  const torch::nn::Sequential probe = wrap(make_layer());
  std::map<std::string, int64_t> params_of;  // path below the layer -> parameters
  for (const auto& item : probe->named_modules("", /*include_self=*/false)) {
    if (item.key().rfind("0.", 0) != 0) continue;
    int64_t params = 0;
    for (const auto& p : item.value()->parameters()) params += p.numel();
    params_of[item.key().substr(2)] = params;
  }
  std::vector<std::pair<int64_t, size_t>> order;  // (-parameters, module order)
  for (size_t i = 0; i < leaves.size(); ++i) order.emplace_back(-params_of[leaves[i]], i);
  std::sort(order.begin(), order.end());
  order.resize(keep);
  std::vector<size_t> kept;
  for (const auto& o : order) kept.push_back(o.second);
  std::sort(kept.begin(), kept.end());
  std::vector<std::string> out;
  for (size_t i : kept) out.push_back(leaves[i]);
  return out;
}

struct Measured {
  double resident = 0, replayed = 0;
  // Peaks above what stays (Candidate::*_temporary_bytes), of the last round.
  double forward_temporary = 0, recompute_temporary = 0, backward_temporary = 0;
  std::vector<double> forward, input, weight, recompute, backward;
};

// One round of a candidate: forward, pre-triggered replay and the split backward (I, W), then a
// second forward and replay for the fused backward (B). Adds its times to `m` when `record`.
void measure_once(torch::nn::Sequential& layer, const at::Tensor& input, const at::Tensor& dy,
                  Precision precision, bool record, Measured* m) {
  const DeviceMeter meter(input.device());
  const auto params = layer->parameters();
  // The forward under an invocation scope, then R; returns the output and its group.
  const auto forward = [&](const at::Tensor& x, bool measure) {
    const int64_t base = meter.begin_window();
    auto t0 = meter.now();
    at::Tensor y;
    std::shared_ptr<remat::InvocationGroup> group;
    {
      remat::InvocationScope scope({0, 0, 0});
      const PrecisionRegion region(precision, input.device());
      y = layer->forward(x);
      group = scope.group();
    }
    const double forward_ms = meter.ms_since(t0);
    const int64_t forward_peak = meter.window_peak();
    const int64_t after_forward = meter.begin_window();
    group->retain();
    t0 = meter.now();
    group->pretrigger();
    const double recompute_ms = group->size() > 0 ? meter.ms_since(t0) : 0.0;
    if (measure) {
      const int64_t after_replay = meter.current_bytes();
      m->resident = static_cast<double>(after_forward - base);
      m->replayed = static_cast<double>(after_replay - after_forward);
      m->forward_temporary = static_cast<double>(forward_peak - after_forward);
      m->recompute_temporary = static_cast<double>(meter.window_peak() - after_replay);
      if (record) {
        m->forward.push_back(forward_ms);
        m->recompute.push_back(recompute_ms);
      }
    }
    PIPEMAT_CHECK(y.requires_grad(), PipelineError,
                  "profile: the layer's output does not require grad; profile a layer with "
                  "parameters or a differentiable path from its input.");
    return std::make_pair(y, group);
  };
  for (auto p : params) p.mutable_grad() = at::Tensor();
  {
    const at::Tensor x = input.detach().clone().requires_grad_(true);
    auto [y, group] = forward(x, /*measure=*/true);
    SplitBackward split({gradient_edge(y)}, {x}, params);
    auto t0 = meter.now();
    split.run_input({dy});
    const double input_ms = meter.ms_since(t0);
    t0 = meter.now();
    split.run_weight();
    if (record) {
      m->weight.push_back(meter.ms_since(t0));
      m->input.push_back(input_ms);
    }
    group->release();
  }
  // B accumulates into the gradients W left, as every B of a step but its stage's first does:
  // its peak above its start is all temporaries (new gradients before they are added in).
  const at::Tensor x = input.detach().clone().requires_grad_(true);
  auto [y, group] = forward(x, /*measure=*/false);
  const int64_t start = meter.begin_window();
  const auto t0 = meter.now();
  run_backward({gradient_edge(y)}, {dy});
  if (record) m->backward.push_back(meter.ms_since(t0));
  m->backward_temporary = static_cast<double>(meter.window_peak() - start);
  group->release();
}

std::string candidate_name(const LayerPolicy& p) {
  if (!p.checkpoint) return "none";
  if (p.exclude.empty()) return "full";
  std::vector<std::string> names;
  for (const auto& rule : p.exclude) names.push_back(rule.path);
  return "save:" + join(names, "+");
}

}  // namespace

LayerCandidates profile_layer(const std::string& name,
                              const std::function<torch::nn::AnyModule()>& make_layer,
                              const at::Tensor& input, const ProfileOptions& options) {
  PIPEMAT_CHECK(options.repeats >= 1 && options.warmup >= 0 && options.max_save_leaves >= 0 &&
                    options.max_save_leaves <= 10,
                ConfigError, "profile: repeats must be >= 1 (got ", options.repeats,
                "), warmup >= 0 (got ", options.warmup, ") and max_save_leaves in [0, 10] (got ",
                options.max_save_leaves, ").");
  remat::install_tracking_allocator();
  LayerCandidates out;
  out.profile.layer = name;
  out.policies.push_back({false, {}});
  out.policies.push_back({true, {}});
  if (!options.save_sets.empty()) {
    const std::vector<std::string> leaves = leaves_of(excludable(make_layer));
    std::set<std::string> used;
    for (const auto& set : options.save_sets) {
      PIPEMAT_CHECK(!set.empty(), ConfigError, "profile: an empty set of SAVE leaves for ", name);
      LayerPolicy p{true, {}};
      for (const std::string& leaf : set) {
        PIPEMAT_CHECK(std::find(leaves.begin(), leaves.end(), leaf) != leaves.end(), ConfigError,
                      "profile: '", leaf, "' is not a SAVE leaf of ", name,
                      "; its leaves: ", join(leaves, ", "));
        p.exclude.push_back({leaf, true});
        used.insert(leaf);
      }
      out.policies.push_back(std::move(p));
    }
    out.save_leaves.assign(used.begin(), used.end());
  } else {
    out.save_leaves = keep_largest(leaves_of(excludable(make_layer)), make_layer,
                                   static_cast<size_t>(options.max_save_leaves));
    const size_t n = out.save_leaves.size();
    for (size_t mask = 1; mask < (size_t{1} << n); ++mask) {
      LayerPolicy p{true, {}};
      for (size_t i = 0; i < n; ++i)
        if (mask & (size_t{1} << i)) p.exclude.push_back({out.save_leaves[i], true});
      out.policies.push_back(std::move(p));
    }
  }
  const at::Tensor dy = at::randn_like(input);  // allocated before any measurement
  for (const LayerPolicy& p : out.policies) {
    torch::nn::Sequential layer = wrap(make_layer());
    if (!input.device().is_cpu()) layer->to(input.device());
    remat::apply_policy(*layer, full_policy(p));
    Measured m;
    for (int r = 0; r < options.warmup + options.repeats; ++r) {
      measure_once(layer, input, dy, options.precision, /*record=*/r >= options.warmup, &m);
    }
    plan::Candidate c;
    c.name = candidate_name(p);
    c.resident_bytes = m.resident;
    c.replayed_bytes = m.replayed;
    c.forward = median(m.forward);
    c.backward_input = median(m.input);
    c.backward_weight = median(m.weight);
    c.recompute = median(m.recompute);
    c.backward = median(m.backward);
    c.forward_temporary_bytes = m.forward_temporary;
    c.recompute_temporary_bytes = m.recompute_temporary;
    c.backward_temporary_bytes = m.backward_temporary;
    out.profile.candidates.push_back(std::move(c));
  }
  return out;
}

remat::RematPolicy stage_policy_of(const std::vector<const LayerCandidates*>& layers,
                                   const std::vector<int>& choice,
                                   const std::string& layer_prefix) {
  PIPEMAT_CHECK(layers.size() == choice.size(), ConfigError, "stage_policy_of: ", choice.size(),
                " choices for ", layers.size(), " layers.");
  remat::RematPolicy policy;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& policies = layers[i]->policies;
    PIPEMAT_CHECK(choice[i] >= 0 && choice[i] < static_cast<int>(policies.size()), ConfigError,
                  "stage_policy_of: layer ", i, " has no candidate ", choice[i], ".");
    const LayerPolicy& p = policies[choice[i]];
    if (!p.checkpoint) continue;
    const std::string path = layer_prefix + std::to_string(i);
    policy.checkpoint.push_back(path);
    for (const auto& rule : p.exclude)
      policy.exclude.push_back({path + "." + rule.path, rule.save_output});
  }
  return policy;
}

namespace {

// One micro-batch of a stage up to its backward, as the pipeline runs it (profile_stage).
struct ProfiledForward {
  std::vector<at::Tensor> leaves;  // the inputs that require grad
  std::vector<torch::autograd::Edge> roots;
  std::vector<at::Tensor> dy;  // one per root
  double ms = 0;               // the forward, the loss included
  double peak_bytes = 0;       // its peak above its start
};

// Runs the forward of `stage` on copies of `inputs`; `outputs` gets detached copies of what it
// returns and the outputs themselves are dropped (as the pipeline drops them once sent), so what
// stays alive is the inputs and what the graph saved. `bytes` gets the inputs' and the rest.
ProfiledForward stage_forward(const DeviceMeter& meter, const PipelineStage& stage,
                              const Tensors& inputs, const LossFn& loss, const Tensors& targets,
                              Precision precision, Tensors* outputs, double* input_bytes,
                              double* resident_bytes) {
  outputs->clear();  // the previous round's, freed before anything is measured
  ProfiledForward out;
  const int64_t before_inputs = meter.current_bytes();
  Tensors x;
  for (const at::Tensor& t : inputs) {
    at::Tensor copy = t.detach().clone();
    if (copy.is_floating_point()) {
      copy.requires_grad_(true);
      out.leaves.push_back(copy);
    }
    x.push_back(copy);
  }
  const int64_t base = meter.begin_window();
  const auto t0 = meter.now();
  Tensors y;
  at::Tensor root;
  {
    remat::InvocationScope scope({0, stage.index, 0});
    const PrecisionRegion region(precision, device_of(x));
    y = stage.forward(x);
  }
  if (loss) root = loss(loss_inputs(y, precision), targets);
  out.ms = meter.ms_since(t0);
  out.peak_bytes = static_cast<double>(meter.window_peak() - base);
  // Sizes and options of each output's gradient (holding the outputs would keep them alive).
  std::vector<std::pair<std::vector<int64_t>, at::TensorOptions>> grad_like;
  if (root.defined()) {
    out.roots.push_back(gradient_edge(root));
  } else {
    for (const at::Tensor& t : y) {
      if (!t.defined() || !t.requires_grad()) continue;
      out.roots.push_back(gradient_edge(t));
      grad_like.emplace_back(t.sizes().vec(), t.options());
    }
  }
  int64_t copies = 0;
  for (const at::Tensor& t : y) {
    outputs->push_back(t.defined() ? t.detach().clone() : t);
    copies += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  }
  y.clear();
  *input_bytes = static_cast<double>(base - before_inputs);
  *resident_bytes = static_cast<double>(meter.current_bytes() - base - copies);
  if (root.defined()) {
    out.dy.push_back(at::ones_like(root));
  } else {
    for (const auto& [sizes, options] : grad_like) out.dy.push_back(at::randn(sizes, options));
  }
  PIPEMAT_CHECK(!out.roots.empty(), PipelineError, "profile: stage ", stage.index,
                " has no output that requires grad.");
  return out;
}

}  // namespace

StageProfile profile_stage(const PipelineStage& stage, const Tensors& inputs, const LossFn& loss,
                           const Tensors& targets, int repeats, int warmup, Precision precision) {
  PIPEMAT_CHECK(repeats >= 1 && warmup >= 0, ConfigError, "profile: repeats must be >= 1 (got ",
                repeats, ") and warmup >= 0 (got ", warmup, ").");
  PIPEMAT_CHECK(static_cast<bool>(stage.forward), ConfigError, "profile: stage ", stage.index,
                " has no forward.");
  remat::install_tracking_allocator();
  const DeviceMeter meter(device_of(inputs));
  StageProfile out;
  std::vector<double> forward, backward, input, weight;
  std::vector<at::Tensor> params;
  if (stage.module) params = stage.module->parameters();
  // Each round: a split backward into no gradients (the step's first), then a fused and a split
  // one that accumulate into the gradients it left, as every later backward of a step does.
  for (int r = 0; r < warmup + repeats; ++r) {
    const bool record = r >= warmup;
    const auto split_round = [&](bool measure) {
      ProfiledForward f = stage_forward(meter, stage, inputs, loss, targets, precision,
                                        &out.outputs, &out.input_bytes, &out.resident_bytes);
      SplitBackward split(f.roots, f.leaves, params);
      int64_t start = meter.begin_window();
      auto t0 = meter.now();
      split.run_input(f.dy);  // the input gradients are sent and freed
      const double input_ms = meter.ms_since(t0);
      const int64_t input_peak = meter.window_peak() - start;
      const int64_t held = meter.current_bytes() - start;
      start = meter.begin_window();
      t0 = meter.now();
      split.run_weight();
      if (!measure) return;
      if (record) {
        weight.push_back(meter.ms_since(t0));
        input.push_back(input_ms);
        forward.push_back(f.ms);
      }
      out.weight_peak_bytes = static_cast<double>(meter.window_peak() - start);
      out.input_peak_bytes = static_cast<double>(input_peak);
      out.input_held_bytes = static_cast<double>(held);
      out.forward_peak_bytes = f.peak_bytes;
    };
    if (stage.module) {
      for (auto p : stage.module->parameters()) p.mutable_grad() = at::Tensor();
    }
    split_round(/*measure=*/false);
    {  // B
      ProfiledForward f = stage_forward(meter, stage, inputs, loss, targets, precision,
                                        &out.outputs, &out.input_bytes, &out.resident_bytes);
      const int64_t start = meter.begin_window();
      const auto t0 = meter.now();
      run_backward(f.roots, f.dy);
      if (record) backward.push_back(meter.ms_since(t0));
      out.backward_peak_bytes = static_cast<double>(meter.window_peak() - start);
      if (record) forward.push_back(f.ms);
      out.output_gradient_bytes = 0;
      if (!loss) {
        for (const at::Tensor& g : f.dy)
          out.output_gradient_bytes += static_cast<double>(g.nbytes());
      }
    }
    split_round(/*measure=*/true);
  }
  {  // the step's first B: into no gradients
    if (stage.module) {
      for (auto p : stage.module->parameters()) p.mutable_grad() = at::Tensor();
    }
    ProfiledForward f = stage_forward(meter, stage, inputs, loss, targets, precision, &out.outputs,
                                      &out.input_bytes, &out.resident_bytes);
    const int64_t start = meter.begin_window();
    run_backward(f.roots, f.dy);
    out.first_backward_peak_bytes = static_cast<double>(meter.window_peak() - start);
  }
  out.forward = median(forward);
  out.backward = median(backward);
  out.backward_input = median(input);
  out.backward_weight = median(weight);
  return out;
}

// Note [Split by cost] for a user's Sequential.
CostBalance balance_by_cost(const torch::nn::Sequential& model,
                            const schedule::ScheduleOptions& schedule, const MicroBatch& sample,
                            const LossFn& loss, int repeats, int warmup, Precision precision) {
  const auto n = static_cast<int64_t>(model->size());
  const int stages = schedule::generate_schedule(schedule).stages_count;
  PIPEMAT_CHECK(n >= stages, ConfigError, "balance_by_cost: the Sequential has ", n,
                " entries but the schedule has ", stages,
                " stages; every stage needs at least one entry");
  PIPEMAT_CHECK(static_cast<bool>(loss), ConfigError, "balance_by_cost: the loss is empty");
  std::vector<int64_t> each(static_cast<size_t>(n) + 1);
  for (int64_t i = 0; i <= n; ++i) each[static_cast<size_t>(i)] = i;
  const StageFactory entry_stage = split_sequential(model, each);
  CostBalance out;
  Tensors inputs = sample.inputs;
  const bool replays = schedule.recompute != schedule::RecomputeMode::kNone;
  for (int64_t i = 0; i < n; ++i) {
    const bool last = i == n - 1;
    const PipelineStage stage = entry_stage(static_cast<int>(i));
    StageProfile p;
    try {
      p = profile_stage(stage, inputs, last ? loss : LossFn{}, last ? sample.targets : Tensors{},
                        repeats, warmup, precision);
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      PIPEMAT_THROW(ConfigError, "balance_by_cost: profiling entry ", i, " ('",
                    model->named_children()[static_cast<size_t>(i)].key(), "') failed: ", e.what());
    }
    plan::LayerCost cost;
    cost.layer = model->named_children()[static_cast<size_t>(i)].key();
    cost.cost.forward = p.forward;
    cost.cost.backward_input = p.backward_input;
    cost.cost.backward_weight = p.backward_weight;
    cost.cost.backward = p.backward;
    cost.cost.recompute = replays ? p.forward : 0.0;
    cost.cost.resident_bytes = p.resident_bytes;
    cost.cost.forward_temporary_bytes = std::max(0.0, p.forward_peak_bytes - p.resident_bytes);
    cost.cost.backward_temporary_bytes = std::max(0.0, p.backward_peak_bytes);
    double params = 0;
    for (const auto& t : stage.module->parameters()) params += static_cast<double>(t.numel());
    cost.fixed_bytes = 16.0 * params;
    out.entries.push_back(std::move(cost));
    inputs = p.outputs;
  }
  out.parameter_bounds = balance_by_parameters(model, stages);
  plan::SplitProblem problem;
  problem.schedule = schedule;
  problem.layers = out.entries;
  for (int s = 0; s < stages; ++s) {
    problem.reference.push_back(static_cast<int>(out.parameter_bounds[static_cast<size_t>(s) + 1] -
                                                 out.parameter_bounds[static_cast<size_t>(s)]));
  }
  const plan::SplitResult chosen = plan::choose_split(problem);
  out.bounds = {0};
  for (int count : chosen.layers_per_stage) out.bounds.push_back(out.bounds.back() + count);
  out.step_ms = chosen.step;
  out.parameter_step_ms = chosen.reference_step;
  return out;
}

}  // namespace pipemat::pp
