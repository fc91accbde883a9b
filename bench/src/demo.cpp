#include "pipemat/bench/demo.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"

namespace pipemat::bench {
namespace {

double train_step(models::RmsNormGemmStack& model, const at::Tensor& x, const at::Tensor& target,
                  double lr) {
  auto loss = (model->forward(x) - target).pow(2).mean();
  auto params = model->parameters();
  auto grads = torch::autograd::grad({loss}, params);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].sub_(grads[i] * lr);
  return loss.item<double>();
}

}  // namespace

DemoReport run_demo(const DemoOptions& o, const DemoStepFn& on_step) {
  PIPEMAT_CHECK(o.layers > 0 && o.tokens > 0 && o.hidden > 0 && o.steps > 0, ConfigError,
                "demo: --layers, --tokens, --hidden and --steps must be positive");
  at::manual_seed(o.seed);
  models::RmsNormGemmStack model(o.layers, o.hidden);
  at::manual_seed(o.seed);
  models::RmsNormGemmStack reference(o.layers, o.hidden);

  remat::RematPolicy policy;
  policy.checkpoint = {"layers.*"};
  policy.exclude = {{"layers.*.gemm", true}};
  remat::apply_policy(*model, policy);

  DemoReport report;
  bool all_equal = true;
  for (int64_t step = 0; step < o.steps; ++step) {
    at::manual_seed(o.seed + 1000 + static_cast<uint64_t>(step));
    auto x = at::randn({o.tokens, o.hidden});
    auto target = at::randn({o.tokens, o.hidden});
    remat::reset_counters();
    DemoStep r;
    auto start = std::chrono::steady_clock::now();
    r.loss = train_step(model, x, target, o.lr);
    r.ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    r.counters = remat::counters();
    r.reference_loss = train_step(reference, x, target, o.lr);
    all_equal = all_equal && r.loss == r.reference_loss;
    report.steps = step + 1;
    if (on_step) on_step(step, r);
  }
  auto pm = model->parameters();
  auto pr = reference->parameters();
  for (size_t i = 0; i < pm.size(); ++i) all_equal = all_equal && at::equal(pm[i], pr[i]);
  report.all_equal = all_equal;
  return report;
}

}  // namespace pipemat::bench
