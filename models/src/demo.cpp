#include "pipemat/models/demo.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <cstdio>

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"

namespace pipemat::models {
namespace {

double train_step(RmsNormGemmStack& model, const at::Tensor& x, const at::Tensor& target,
                  double lr) {
  auto loss = (model->forward(x) - target).pow(2).mean();
  auto params = model->parameters();
  auto grads = torch::autograd::grad({loss}, params);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].sub_(grads[i] * lr);
  return loss.item<double>();
}

}  // namespace

int run_demo(const DemoOptions& o, std::ostream& out) {
  PIPEMAT_CHECK(o.layers > 0 && o.tokens > 0 && o.hidden > 0 && o.steps > 0, ConfigError,
                "demo: --layers, --tokens, --hidden and --steps must be positive");
  at::manual_seed(o.seed);
  RmsNormGemmStack model(o.layers, o.hidden);
  at::manual_seed(o.seed);
  RmsNormGemmStack reference(o.layers, o.hidden);

  remat::RematPolicy policy;
  policy.checkpoint = {"layers.*"};
  policy.exclude = {{"layers.*.gemm", true}};
  remat::apply_policy(*model, policy);

  char line[256];
  std::snprintf(line, sizeof(line),
                "pipemat demo: %lld layers of RMSNorm -> GEMM %lldx%lld -> SiLU, %lld tokens\n"
                "remat policy: checkpoint layers.*, exclude layers.*.gemm (SAVE region)\n",
                static_cast<long long>(o.layers), static_cast<long long>(o.hidden),
                static_cast<long long>(o.hidden), static_cast<long long>(o.tokens));
  out << line;
  bool all_equal = true;
  for (int64_t step = 0; step < o.steps; ++step) {
    at::manual_seed(o.seed + 1000 + static_cast<uint64_t>(step));
    auto x = at::randn({o.tokens, o.hidden});
    auto target = at::randn({o.tokens, o.hidden});
    remat::reset_counters();
    auto start = std::chrono::steady_clock::now();
    const double loss = train_step(model, x, target, o.lr);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const auto c = remat::counters();
    const double ref = train_step(reference, x, target, o.lr);
    const bool equal = loss == ref;
    all_equal = all_equal && equal;
    std::snprintf(line, sizeof(line),
                  "step %lld  loss %.6f  (no-checkpoint %.6f, %s)  %.1f ms  units %lld  "
                  "replays %lld  save bodies %lld  skipped in replay %lld\n",
                  static_cast<long long>(step + 1), loss, ref, equal ? "equal" : "DIFFERENT", ms,
                  static_cast<long long>(c.unit_calls), static_cast<long long>(c.replays),
                  static_cast<long long>(c.save_calls), static_cast<long long>(c.save_skips));
    out << line;
  }
  auto pm = model->parameters();
  auto pr = reference->parameters();
  for (size_t i = 0; i < pm.size(); ++i) all_equal = all_equal && at::equal(pm[i], pr[i]);
  out << (all_equal ? "pipemat demo: losses and every parameter equal the no-checkpoint run "
                      "bitwise\n"
                    : "pipemat demo: MISMATCH against the no-checkpoint run\n");
  return all_equal ? 0 : 1;
}

}  // namespace pipemat::models
