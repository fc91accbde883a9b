#include "pipemat/models/zoo.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

namespace pipemat::models {

RMSNormImpl::RMSNormImpl(int64_t hidden, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({hidden}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * weight;
}

SiluBlockImpl::SiluBlockImpl(int64_t hidden) {
  norm = register_module("norm", RMSNorm(hidden));
  gemm = register_module("gemm", torch::nn::Linear(hidden, hidden));
}

at::Tensor SiluBlockImpl::forward(const at::Tensor& x) { return at::silu(gemm(norm(x))); }

RmsNormGemmStackImpl::RmsNormGemmStackImpl(int64_t num_layers, int64_t hidden) {
  torch::nn::ModuleList list;
  for (int64_t i = 0; i < num_layers; ++i) list->push_back(SiluBlock(hidden));
  layers = register_module("layers", list);
}

at::Tensor RmsNormGemmStackImpl::forward(at::Tensor x) {
  for (auto& layer : *layers) x = layer->as<SiluBlock>()->forward(x);
  return x;
}

}  // namespace pipemat::models
