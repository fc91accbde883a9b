#pragma once
// The remat scenarios of `pipemat bench remat` and `pipemat bench soak`: a zoo model, its
// forward, counters of its region bodies and the remat policy of each mode.

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/bench/remat.h"
#include "pipemat/remat/policy.h"

namespace pipemat::bench {

// One model of one scenario with its forward, its counters and the remat policy of a mode.
struct Scenario {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::function<int64_t()> save_body_calls;       // bodies of the regions a policy excludes
  std::function<int64_t()> recompute_body_calls;  // bodies of the RECOMPUTE regions
  remat::RematPolicy policy(const std::string& mode) const {
    remat::RematPolicy p;
    if (mode == "none") return p;
    p.checkpoint = {"layers.*"};
    if (mode == "full") return p;
    p.exclude = mode == "legacy" && !exclude_legacy.empty() ? exclude_legacy : exclude;
    return p;
  }
  std::vector<remat::ExcludeRule> exclude;
  std::vector<remat::ExcludeRule> exclude_legacy;  // when legacy differs by policy, not switch
  bool legacy_disables_rederivation = true;
};

// The model of o.scenario (o.layers, o.hidden, o.experts, o.top_k), with fresh weights drawn from
// the current generator. ConfigError for an unknown scenario.
Scenario make_scenario(const BenchRematOptions& o);

}  // namespace pipemat::bench
