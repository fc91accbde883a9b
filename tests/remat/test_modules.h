#pragma once
// Small modules for remat tests: each counts its forward calls.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <string>
#include <vector>

#include "pipemat/remat/remat.h"

namespace pipemat::remat::testing {

// The hidden size of the small modules the remat tests build.
constexpr int64_t kHidden = 8;

// y = fn(x), counting calls.
struct CountedImpl : torch::nn::Module {
  explicit CountedImpl(std::function<at::Tensor(const at::Tensor&)> fn) : fn_(std::move(fn)) {}
  at::Tensor forward(const at::Tensor& x) {
    ++calls;
    return fn_(x);
  }
  int calls = 0;
  std::function<at::Tensor(const at::Tensor&)> fn_;
};
TORCH_MODULE(Counted);

// y = x @ W^T + b with a call counter (a GEMM that saves its input and weight).
struct GemmImpl : torch::nn::Module {
  GemmImpl(int64_t in, int64_t out) {
    weight = register_parameter("weight", at::randn({out, in}) * 0.1);
    bias = register_parameter("bias", at::randn({out}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) {
    ++calls;
    return at::linear(x, weight, bias);
  }
  at::Tensor weight, bias;
  int calls = 0;
};
TORCH_MODULE(Gemm);

inline at::Tensor rms_norm(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean({-1}, true) + 1e-6);
}

// pre (RECOMPUTE by default) -> gemm -> post; any member can be declared a SAVE region.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t hidden) {
    pre = register_module("pre", Counted(rms_norm));
    gemm = register_module("gemm", Gemm(hidden, hidden));
    post = register_module("post", Counted([](const at::Tensor& x) { return at::silu(x); }));
  }
  at::Tensor forward(const at::Tensor& x) { return post(gemm(pre(x))); }
  Remat<Counted> pre{nullptr};
  Remat<Gemm> gemm{nullptr};
  Remat<Counted> post{nullptr};
};
TORCH_MODULE(Block);

// pre: dropout (RECOMPUTE) -> save: dropout + sin (SAVE when declared so; consumes RNG) ->
// post: dropout. Replay must restore the generator at entry and after a skipped SAVE body.
struct DropImpl : torch::nn::Module {
  DropImpl() {
    pre = register_module("pre",
                          Counted([](const at::Tensor& x) { return at::dropout(x, 0.5, true); }));
    save = register_module(
        "save", Counted([](const at::Tensor& x) { return at::dropout(x, 0.3, true).sin(); }));
    post = register_module(
        "post", Counted([](const at::Tensor& x) { return at::dropout(x, 0.5, true) * x; }));
  }
  at::Tensor forward(const at::Tensor& x) { return post(save(pre(x))); }
  Remat<Counted> pre{nullptr}, save{nullptr}, post{nullptr};
};

struct Grads {
  at::Tensor out, dx;
  std::vector<at::Tensor> dparams;
};

// Forward + backward of `fn` on a fresh leaf copy of x; loss = sum(out * w) with a fixed weight.
template <typename Fn>
Grads run_and_grad(Fn&& fn, const at::Tensor& x, const std::vector<at::Tensor>& params) {
  auto xin = x.detach().clone().requires_grad_(true);
  auto out = fn(xin);
  auto w = at::linspace(-1, 1, out.numel()).reshape(out.sizes());
  auto loss = (out * w).sum();
  std::vector<at::Tensor> inputs{xin};
  inputs.insert(inputs.end(), params.begin(), params.end());
  auto grads = torch::autograd::grad({loss}, inputs);
  Grads g;
  g.out = out.detach();
  g.dx = grads[0];
  g.dparams.assign(grads.begin() + 1, grads.end());
  return g;
}

inline void expect_bitwise_equal(const Grads& a, const Grads& b) {
  EXPECT_TRUE(at::equal(a.out, b.out)) << "outputs differ";
  EXPECT_TRUE(at::equal(a.dx, b.dx)) << "input gradients differ";
  ASSERT_EQ(a.dparams.size(), b.dparams.size());
  for (size_t i = 0; i < a.dparams.size(); ++i) {
    EXPECT_TRUE(at::equal(a.dparams[i], b.dparams[i])) << "parameter gradient " << i << " differs";
  }
}

inline std::vector<at::Tensor> params_of(torch::nn::Module& m) { return m.parameters(); }

}  // namespace pipemat::remat::testing
