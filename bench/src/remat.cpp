#include "pipemat/bench/remat.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/stats.h"
#include "pipemat/models/zoo.h"
#include "pipemat/remat/memory.h"
#include "pipemat/train/launched_run.h"
#include "scenario.h"

namespace pipemat::bench {
namespace {

const std::vector<std::string> kModes = {"none", "full", "legacy", "rederive"};

struct StepResult {
  double step_ms = 0, host_overhead_us = 0, loss = 0, grad_norm = 0;
  int64_t resident_bytes = 0, replay_peak_bytes = 0, peak_bytes = 0;
  int64_t save_body_calls = 0, recompute_body_calls = 0;
};

std::vector<StepResult> run_mode(const BenchRematOptions& o, const std::string& mode) {
  at::manual_seed(o.seed);
  Scenario s = make_scenario(o);
  auto policy = s.policy(mode);
  if (!policy.checkpoint.empty()) remat::apply_policy(*s.module, policy);
  remat::set_rederivation_enabled(!(mode == "legacy" && s.legacy_disables_rederivation));
  auto params = s.module->parameters();
  std::vector<StepResult> results;
  for (int64_t step = 0; step < o.steps; ++step) {
    at::manual_seed(o.seed + 7919 * static_cast<uint64_t>(step + 1));
    auto x = at::randn({o.tokens, o.hidden}).requires_grad_(true);
    StepResult r;
    const int64_t save0 = s.save_body_calls(), rec0 = s.recompute_body_calls();
    remat::reset_host_overhead();
    remat::reset_peak_bytes();
    const int64_t baseline = remat::memory_stats().current_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    std::shared_ptr<remat::InvocationGroup> group;
    at::Tensor loss;
    {
      remat::InvocationScope scope({step, 0, 0});
      loss = s.forward(x).pow(2).mean();
      group = scope.group();
    }
    r.resident_bytes = remat::memory_stats().current_bytes - baseline;
    std::vector<at::Tensor> inputs{x};
    inputs.insert(inputs.end(), params.begin(), params.end());
    auto grads = torch::autograd::grad({loss}, inputs);
    const auto t1 = std::chrono::steady_clock::now();
    r.replay_peak_bytes = group->report().replay_peak_bytes;
    group->release();
    r.peak_bytes = remat::memory_stats().peak_bytes - baseline;
    r.step_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    r.host_overhead_us = static_cast<double>(remat::host_overhead_ns()) / 1000.0;
    r.loss = loss.item<double>();
    double sq = 0;
    for (const auto& g : grads) sq += g.pow(2).sum().item<double>();
    r.grad_norm = std::sqrt(sq);
    r.save_body_calls = s.save_body_calls() - save0;
    r.recompute_body_calls = s.recompute_body_calls() - rec0;
    results.push_back(r);
  }
  remat::set_rederivation_enabled(true);
  return results;
}

// Host cost of one call of an empty SAVE region (returns its input) inside a checkpoint unit,
// minus the same call without the wrapper.
double empty_save_call_us() {
  struct Identity : torch::nn::Module {
    at::Tensor forward(const at::Tensor& x) { return x; }
  };
  auto region = remat::checkpoint_exclude_wrapper(
      remat::Remat<torch::nn::ModuleHolder<Identity>>(std::make_shared<Identity>()));
  const int kCalls = 20000;
  auto x = at::ones({1}).requires_grad_(true);
  auto timed = [&](bool wrapped) {
    auto unit = remat::checkpoint_wrapper(
        [&](const at::Tensor& in) {
          at::Tensor y = in;
          for (int i = 0; i < kCalls; ++i) y = wrapped ? region(y) : region->forward(y);
          return y;
        },
        remat::CheckpointOptions{});
    const auto t0 = std::chrono::steady_clock::now();
    auto out = unit(x);
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls;
  };
  std::vector<double> diffs;
  for (int r = 0; r < 5; ++r) diffs.push_back(timed(true) - timed(false));
  return median(diffs);
}

}  // namespace

BenchRematReport run_bench_remat(
    const BenchRematOptions& o,
    const std::function<void(int64_t repetition, const std::string& mode)>& on_mode_done) {
  PIPEMAT_CHECK(o.layers > 0 && o.tokens > 0 && o.hidden > 0 && o.steps > 0 && o.repeat > 0,
                ConfigError,
                "bench remat: --layers, --tokens, --hidden, --steps and --repeat must be positive");
  PIPEMAT_CHECK(o.experts > 0 && o.top_k > 0 && o.top_k <= o.experts, ConfigError,
                "bench remat: need 0 < --top-k <= --experts, got --experts ", o.experts,
                " --top-k ", o.top_k);
  (void)make_scenario(o);  // validates the scenario name before any work
  remat::install_tracking_allocator();
  std::map<std::string, std::vector<StepResult>> all;
  for (int64_t rep = 0; rep < o.repeat; ++rep) {
    for (const auto& mode : kModes) {
      auto steps = run_mode(o, mode);
      all[mode].insert(all[mode].end(), steps.begin(), steps.end());
      if (on_mode_done) on_mode_done(rep + 1, mode);
    }
  }
  BenchRematReport report;
  for (const auto& mode : kModes) {
    const auto& rs = all[mode];
    auto pick = [&](auto field) {
      std::vector<double> v;
      for (const auto& r : rs) v.push_back(static_cast<double>(field(r)));
      return v;
    };
    auto max_of = [&](auto field) {
      int64_t m = 0;
      for (const auto& r : rs) m = std::max<int64_t>(m, field(r));
      return m;
    };
    BenchRematMode m;
    m.mode = mode;
    m.resident_bytes = max_of([](const StepResult& r) { return r.resident_bytes; });
    m.replay_peak_bytes = max_of([](const StepResult& r) { return r.replay_peak_bytes; });
    m.peak_bytes = max_of([](const StepResult& r) { return r.peak_bytes; });
    m.step_ms = median(pick([](const StepResult& r) { return r.step_ms; }));
    m.host_overhead_us = median(pick([](const StepResult& r) { return r.host_overhead_us; }));
    m.loss = rs.back().loss;
    m.grad_norm = rs.back().grad_norm;
    m.save_body_calls = rs.back().save_body_calls;
    m.recompute_body_calls = rs.back().recompute_body_calls;
    report.modes.push_back(m);
  }
  report.empty_save_region_call_us = empty_save_call_us();
  return report;
}

}  // namespace pipemat::bench
