#pragma once
// Model zoo for tests, benchmarks and the demo: small, deterministic (fixed seeds), no downloads.
// Members that a remat policy may declare are held through pipemat::remat holders, so a policy
// applies by path (`layers.*`, `layers.*.gemm`) with no edit to any forward.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "pipemat/remat/remat.h"

namespace pipemat::models {

// y = x / sqrt(mean(x^2) + eps) * weight
struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t hidden, double eps = 1e-6);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// RMSNorm -> Linear(H -> H) (the GEMM) -> SiLU. Paths: norm, gemm, act.
struct SiluBlockImpl : torch::nn::Module {
  explicit SiluBlockImpl(int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<RMSNorm> norm{nullptr};
  remat::Remat<torch::nn::Linear> gemm{nullptr};
};
TORCH_MODULE(SiluBlock);

// L SiluBlocks in a ModuleList. Paths: layers.<i>, layers.<i>.norm, layers.<i>.gemm.
struct RmsNormGemmStackImpl : torch::nn::Module {
  RmsNormGemmStackImpl(int64_t layers, int64_t hidden);
  at::Tensor forward(at::Tensor x);
  remat::ModuleList layers{nullptr};
};
TORCH_MODULE(RmsNormGemmStack);

}  // namespace pipemat::models
