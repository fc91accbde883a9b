#include "pipemat/models/zoo.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>

namespace pipemat::models {

namespace {

// A ModuleList of `n` layers built as Layer(args...), and a forward through all of them.
template <typename Layer, typename... Args>
torch::nn::ModuleList make_layers(int64_t n, const Args&... args) {
  torch::nn::ModuleList list;
  for (int64_t i = 0; i < n; ++i) list->push_back(Layer(args...));
  return list;
}

template <typename Layer>
at::Tensor run_layers(remat::ModuleList& layers, at::Tensor x) {
  for (auto& layer : *layers) x = layer->as<Layer>()->forward(x);
  return x;
}

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t hidden, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({hidden}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  ++calls;
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps) * weight;
}

GemmImpl::GemmImpl(int64_t in, int64_t out) {
  weight = register_parameter("weight", at::randn({out, in}) / std::sqrt(static_cast<double>(in)));
  bias = register_parameter("bias", at::zeros({out}));
}

at::Tensor GemmImpl::forward(const at::Tensor& x) {
  ++calls;
  return at::linear(x, weight, bias);
}

SiluBlockImpl::SiluBlockImpl(int64_t hidden) {
  norm = register_module("norm", RMSNorm(hidden));
  gemm = register_module("gemm", Gemm(hidden, hidden));
}

at::Tensor SiluBlockImpl::forward(const at::Tensor& x) { return at::silu(gemm(norm(x))); }

RmsNormGemmStackImpl::RmsNormGemmStackImpl(int64_t num_layers, int64_t hidden) {
  layers = register_module("layers", make_layers<SiluBlock>(num_layers, hidden));
}

at::Tensor RmsNormGemmStackImpl::forward(at::Tensor x) {
  return run_layers<SiluBlock>(layers, std::move(x));
}

GroupedGemmImpl::GroupedGemmImpl(int64_t experts, int64_t hidden) {
  weight = register_parameter(
      "weight", at::randn({experts, hidden, hidden}) / std::sqrt(static_cast<double>(hidden)));
}

at::Tensor GroupedGemmImpl::forward(const at::Tensor& packed, std::vector<int64_t> counts) {
  ++calls;
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    outs.push_back(at::matmul(packed.narrow(0, offset, counts[e]), weight[e].t()));
    offset += counts[e];
  }
  return at::cat(outs, 0);
}

MoELayerImpl::MoELayerImpl(int64_t hidden, int64_t experts_, int64_t top_k_)
    : num_experts(experts_), top_k(top_k_) {
  norm = register_module("norm", RMSNorm(hidden));
  router = register_module("router", torch::nn::Linear(hidden, experts_));
  experts = register_module("experts", GroupedGemm(experts_, hidden));
}

Dispatch MoELayerImpl::dispatch(const at::Tensor& h) {
  const int64_t tokens = h.size(0);
  auto scores = at::softmax(router(h), -1);
  auto [gate, expert] = at::topk(scores, top_k, -1);  // [tokens, k]
  auto flat_expert = expert.reshape({-1});
  auto order = at::argsort(flat_expert * (tokens * top_k) + at::arange(tokens * top_k));
  Dispatch d;
  d.token_index = at::div(order, top_k, "floor");
  d.packed = h.index_select(0, d.token_index);
  d.gate = gate.reshape({-1}).index_select(0, order).unsqueeze(1);
  auto counts = at::bincount(flat_expert, {}, num_experts);
  d.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel());
  return d;
}

at::Tensor MoELayerImpl::forward(const at::Tensor& x) {
  auto h = norm(x);
  Dispatch d = dispatch(h);
  auto y = experts(d.packed, d.counts);
  // In the experts' dtype (bf16 under autocast: softmax's gate is float32, so y * gate is too).
  const at::Tensor weighted = y * d.gate;
  auto combined = at::zeros_like(x, weighted.scalar_type()).index_add(0, d.token_index, weighted);
  return x + combined;
}

MoEStackImpl::MoEStackImpl(int64_t num_layers, int64_t hidden, int64_t experts, int64_t top_k) {
  layers = register_module("layers", make_layers<MoELayer>(num_layers, hidden, experts, top_k));
}

at::Tensor MoEStackImpl::forward(at::Tensor x) {
  return run_layers<MoELayer>(layers, std::move(x));
}

MlpBlockImpl::MlpBlockImpl(int64_t hidden, int64_t ffn) {
  norm = register_module("norm", RMSNorm(hidden));
  up = register_module("up", Gemm(hidden, ffn));
  down = register_module("down", Gemm(ffn, hidden));
}

at::Tensor MlpBlockImpl::forward(const at::Tensor& x) { return x + down(at::silu(up(norm(x)))); }

AttentionImpl::AttentionImpl(int64_t hidden, int64_t heads_) : heads(heads_) {
  qkv = register_module("qkv", Gemm(hidden, 3 * hidden));
  proj = register_module("proj", Gemm(hidden, hidden));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  const int64_t tokens = x.size(0), hidden = x.size(1), dim = hidden / heads;
  auto parts = qkv(x).view({tokens, 3, heads, dim}).permute({1, 2, 0, 3});  // [3, h, T, d]
  auto q = parts[0], k = parts[1], v = parts[2];
  auto scores =
      at::softmax(at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dim)), -1);
  auto context = at::matmul(scores, v).permute({1, 0, 2}).reshape({tokens, hidden});
  return proj(context);
}

FeedForwardImpl::FeedForwardImpl(int64_t hidden, int64_t ffn) {
  up = register_module("up", Gemm(hidden, ffn));
  down = register_module("down", Gemm(ffn, hidden));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) { return down(at::silu(up(x))); }

TransformerBlockImpl::TransformerBlockImpl(int64_t hidden, int64_t heads, int64_t ffn) {
  norm1 = register_module("norm1", RMSNorm(hidden));
  attn = register_module("attn", Attention(hidden, heads));
  norm2 = register_module("norm2", RMSNorm(hidden));
  mlp = register_module("mlp", FeedForward(hidden, ffn));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x) {
  auto h = x + attn(norm1(x));
  return h + mlp(norm2(h));
}

SaveChainImpl::SaveChainImpl(double scale_init) {
  scale = register_parameter("scale", at::full({}, scale_init));
  s1 = register_module("s1", Lambda([](const at::Tensor& x) { return at::relu(x * x); }));
  s2 = register_module("s2", Lambda([](const at::Tensor& x) { return x + 0.125; }));
  s3 = register_module("s3", Lambda([](const at::Tensor& x) { return x * 1.5; }));
  s4 = register_module("s4", Lambda([](const at::Tensor& x) { return x + 0.25; }));
}

at::Tensor SaveChainImpl::forward(const at::Tensor& x) {
  ++calls;
  return s4(s3(s2(s1(x * scale))));
}

SaveChainStackImpl::SaveChainStackImpl(int64_t num_layers, double scale_init) {
  layers = register_module("layers", make_layers<SaveChain>(num_layers, scale_init));
}

at::Tensor SaveChainStackImpl::forward(at::Tensor x) {
  return run_layers<SaveChain>(layers, std::move(x));
}

}  // namespace pipemat::models
