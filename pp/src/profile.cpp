// The remat profiler (pp/profile.h): candidates from the module tree, measured one at a time.

#include "pipemat/pp/profile.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <chrono>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "split_backward.h"

namespace pipemat::pp {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
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

struct Measured {
  double resident = 0, replayed = 0;
  std::vector<double> forward, input, weight, recompute;
};

void measure_once(torch::nn::Sequential& layer, const at::Tensor& input, const at::Tensor& dy,
                  Measured* m) {
  const auto params = layer->parameters();
  for (auto p : params) p.mutable_grad() = at::Tensor();
  const at::Tensor x = input.detach().clone().requires_grad_(true);
  const int64_t base = remat::memory_stats().current_bytes;
  auto t0 = Clock::now();
  at::Tensor y;
  std::shared_ptr<remat::InvocationGroup> group;
  {
    remat::InvocationScope scope({0, 0, 0});
    y = layer->forward(x);
    group = scope.group();
  }
  m->forward.push_back(ms_since(t0));
  const int64_t after_forward = remat::memory_stats().current_bytes;
  m->resident = static_cast<double>(after_forward - base);
  group->retain();
  t0 = Clock::now();
  group->pretrigger();
  m->recompute.push_back(group->size() > 0 ? ms_since(t0) : 0.0);
  m->replayed = static_cast<double>(remat::memory_stats().current_bytes - after_forward);
  PIPEMAT_CHECK(y.requires_grad(), PipelineError,
                "profile: the layer's output does not require grad; profile a layer with "
                "parameters or a differentiable path from its input.");
  SplitBackward split({gradient_edge(y)}, {x}, params);
  t0 = Clock::now();
  split.run_input({dy});
  m->input.push_back(ms_since(t0));
  t0 = Clock::now();
  split.run_weight();
  m->weight.push_back(ms_since(t0));
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
  PIPEMAT_CHECK(
      options.repeats >= 1 && options.max_save_leaves >= 0 && options.max_save_leaves <= 10,
      ConfigError, "profile: repeats must be >= 1 (got ", options.repeats,
      ") and max_save_leaves in [0, 10] (got ", options.max_save_leaves, ").");
  remat::install_tracking_allocator();
  LayerCandidates out;
  out.profile.layer = name;
  out.save_leaves = leaves_of(excludable(make_layer));
  if (static_cast<int>(out.save_leaves.size()) > options.max_save_leaves)
    out.save_leaves.resize(options.max_save_leaves);
  out.policies.push_back({false, {}});
  out.policies.push_back({true, {}});
  const size_t n = out.save_leaves.size();
  for (size_t mask = 1; mask < (size_t{1} << n); ++mask) {
    LayerPolicy p{true, {}};
    for (size_t i = 0; i < n; ++i)
      if (mask & (size_t{1} << i)) p.exclude.push_back({out.save_leaves[i], true});
    out.policies.push_back(std::move(p));
  }
  const at::Tensor dy = at::randn_like(input);  // allocated before any measurement
  for (const LayerPolicy& p : out.policies) {
    torch::nn::Sequential layer = wrap(make_layer());
    remat::apply_policy(*layer, full_policy(p));
    Measured m;
    for (int r = 0; r < options.repeats; ++r) measure_once(layer, input, dy, &m);
    plan::Candidate c;
    c.name = candidate_name(p);
    c.resident_bytes = m.resident;
    c.replayed_bytes = m.replayed;
    c.forward = median(m.forward);
    c.backward_input = median(m.input);
    c.backward_weight = median(m.weight);
    c.recompute = median(m.recompute);
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

}  // namespace pipemat::pp
