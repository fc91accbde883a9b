#include "pipemat/bench/soak.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdlib>

#include "pipemat/core/error.h"
#include "pipemat/core/process.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/options.h"
#include "pipemat/train/train.h"
#include "scenario.h"

namespace pipemat::bench {
namespace {

constexpr int64_t kMaxSteps = int64_t{1} << 40;

void check_options(const BenchSoakOptions& o) {
  PIPEMAT_CHECK(o.loops == "pipeline" || o.loops == "remat" || o.loops == "both", ConfigError,
                "bench soak: --loops '", o.loops, "'; expected pipeline, remat or both");
  PIPEMAT_CHECK(o.warmup >= 1 && o.warmup < o.steps && o.steps <= kMaxSteps, ConfigError,
                "bench soak: --warmup ", o.warmup, " and --steps ", o.steps,
                ": need 1 <= warmup < steps <= 2^40 (samples are taken after warm-up)");
  PIPEMAT_CHECK(o.every >= 1, ConfigError, "bench soak: --every ", o.every,
                " must be at least 1 (steps between samples)");
}

// After `done` steps: the first sample closes the warm-up, then one every `every` steps and
// one at the end.
bool sample_after(const BenchSoakOptions& o, int64_t done) {
  if (done < o.warmup) return false;
  return done == o.steps || (done - o.warmup) % o.every == 0;
}

SoakSample take_sample(const char* loop, int64_t done) {
  return SoakSample{loop, done, remat::memory_stats().current_bytes, resident_set_bytes()};
}

void pipeline_loop(const train::TrainConfig& given, const BenchSoakOptions& o,
                   const std::function<void(const SoakSample&)>& record) {
  train::TrainConfig config = given;
  config.transport.kind = comm::TransportKind::kLocal;
  config.training.steps = o.steps;
  config.output = train::OutputOptions{};
  config.output.progress = false;
  train::train_in_process(config, nullptr, [&](int64_t step, comm::Transport& transport) {
    if (!sample_after(o, step + 1)) return;
    // Every rank waits here while rank 0 samples, so no step holds activations.
    transport.barrier();
    if (transport.rank() == 0) record(take_sample("pipeline", step + 1));
    transport.barrier();
  });
}

void remat_loop(const BenchSoakOptions& o, const std::function<void(const SoakSample&)>& record) {
  BenchRematOptions model;
  model.scenario = "rmsnorm-gemm";
  model.layers = o.layers;
  model.tokens = o.tokens;
  model.hidden = o.hidden;
  at::manual_seed(o.seed);
  Scenario s = make_scenario(model);
  remat::apply_policy(*s.module, s.policy("rederive"));
  auto params = s.module->parameters();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(o.seed + 1);
  for (int64_t step = 0; step < o.steps; ++step) {
    auto x = at::randn({o.tokens, o.hidden}, generator).requires_grad_(true);
    std::shared_ptr<remat::InvocationGroup> group;
    at::Tensor loss;
    {
      remat::InvocationScope scope({step, 0, 0});
      loss = s.forward(x).pow(2).mean();
      group = scope.group();
    }
    auto grads = torch::autograd::grad({loss}, params);
    group->release();
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].sub_(grads[i], 1e-3);
    }
    grads.clear();
    loss.reset();
    x.reset();
    if (sample_after(o, step + 1)) record(take_sample("remat", step + 1));
  }
}

}  // namespace

std::vector<SoakSample> run_bench_soak(const train::TrainConfig& pipeline,
                                       const BenchSoakOptions& options,
                                       const std::function<void(const SoakSample&)>& on_sample) {
  check_options(options);
  remat::install_tracking_allocator();
  std::vector<SoakSample> samples;
  const auto record = [&](SoakSample sample) {
    if (on_sample) on_sample(sample);
    samples.push_back(std::move(sample));
  };
  if (options.loops != "remat") pipeline_loop(pipeline, options, record);
  if (options.loops != "pipeline") remat_loop(options, record);
  return samples;
}

std::vector<SoakSummary> summarize_soak(const std::vector<SoakSample>& samples) {
  std::vector<SoakSummary> out;
  for (const SoakSample& s : samples) {
    if (out.empty() || out.back().loop != s.loop) {
      SoakSummary first;
      first.loop = s.loop;
      first.allocator_bytes = s.allocator_bytes;
      first.rss_first_bytes = first.rss_max_bytes = s.rss_bytes;
      out.push_back(first);
    }
    SoakSummary& sum = out.back();
    ++sum.samples;
    sum.allocator_drift_bytes =
        std::max(sum.allocator_drift_bytes, std::abs(s.allocator_bytes - sum.allocator_bytes));
    sum.rss_last_bytes = s.rss_bytes;
    sum.rss_max_bytes = std::max(sum.rss_max_bytes, s.rss_bytes);
  }
  return out;
}

}  // namespace pipemat::bench
