#pragma once
// Model zoo for tests, benchmarks and the demo: small, deterministic (fixed seeds), no downloads.
// Members that a remat policy may declare are held through pipemat::remat holders, so a policy
// applies by path (`layers.*`, `layers.*.gemm`) with no edit to any forward.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "pipemat/remat/remat.h"

namespace pipemat::models {

// y = x / sqrt(mean(x^2) + eps) * weight
struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t hidden, double eps = 1e-6);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
  int64_t calls = 0;  // forward calls (replays included), for benchmarks and tests
};
TORCH_MODULE(RMSNorm);

// y = x W^T + b, counting its forward calls: the GEMM that SAVE regions exclude from replay.
struct GemmImpl : torch::nn::Module {
  GemmImpl(int64_t in, int64_t out);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;
  int64_t calls = 0;
};
TORCH_MODULE(Gemm);

// RMSNorm -> Linear(H -> H) (the GEMM) -> SiLU. Paths: norm, gemm, act.
struct SiluBlockImpl : torch::nn::Module {
  explicit SiluBlockImpl(int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<RMSNorm> norm{nullptr};
  remat::Remat<Gemm> gemm{nullptr};
};
TORCH_MODULE(SiluBlock);

// L SiluBlocks in a ModuleList. Paths: layers.<i>, layers.<i>.norm, layers.<i>.gemm.
struct RmsNormGemmStackImpl : torch::nn::Module {
  RmsNormGemmStackImpl(int64_t layers, int64_t hidden);
  at::Tensor forward(at::Tensor x);
  remat::ModuleList layers{nullptr};
};
TORCH_MODULE(RmsNormGemmStack);

// Top-k routing of tokens to experts, packed by expert: the RECOMPUTE part of an MoE layer.
struct Dispatch {
  at::Tensor packed;            // [tokens * top_k, hidden], rows grouped by expert
  at::Tensor token_index;       // [tokens * top_k] source token of each packed row
  at::Tensor gate;              // [tokens * top_k, 1] routing weight of each packed row
  std::vector<int64_t> counts;  // rows per expert
};

// Expert weights applied group by group to the packed rows: slices of `packed` per expert, one
// GEMM each (the SAVE region of an MoE layer: it saves the slices, views of its input).
struct GroupedGemmImpl : torch::nn::Module {
  GroupedGemmImpl(int64_t experts, int64_t hidden);
  at::Tensor forward(const at::Tensor& packed, std::vector<int64_t> counts);
  at::Tensor weight;  // [experts, hidden, hidden]
  int64_t calls = 0;
};
TORCH_MODULE(GroupedGemm);

// RMSNorm -> router + top-k dispatch (RECOMPUTE) -> grouped expert GEMM (SAVE) -> combine.
// Paths: norm, router, experts.
struct MoELayerImpl : torch::nn::Module {
  MoELayerImpl(int64_t hidden, int64_t experts, int64_t top_k);
  at::Tensor forward(const at::Tensor& x);
  Dispatch dispatch(const at::Tensor& h);
  remat::Remat<RMSNorm> norm{nullptr};
  torch::nn::Linear router{nullptr};
  remat::Remat<GroupedGemm> experts{nullptr};
  int64_t num_experts, top_k;
};
TORCH_MODULE(MoELayer);

// L MoE layers with residuals. Paths: layers.<i>, layers.<i>.experts, ...
struct MoEStackImpl : torch::nn::Module {
  MoEStackImpl(int64_t layers, int64_t hidden, int64_t experts, int64_t top_k);
  at::Tensor forward(at::Tensor x);
  remat::ModuleList layers{nullptr};
};
TORCH_MODULE(MoEStack);

// x + down(silu(up(norm(x)))). Paths: norm, up, down.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t hidden, int64_t ffn);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<RMSNorm> norm{nullptr};
  remat::Remat<Gemm> up{nullptr}, down{nullptr};
};
TORCH_MODULE(MlpBlock);

// Multi-head self-attention over the rows of x ([tokens, hidden]). Paths: qkv, proj.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t hidden, int64_t heads);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<Gemm> qkv{nullptr}, proj{nullptr};
  int64_t heads;
};
TORCH_MODULE(Attention);

// up -> SiLU -> down. Paths: up, down.
struct FeedForwardImpl : torch::nn::Module {
  FeedForwardImpl(int64_t hidden, int64_t ffn);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<Gemm> up{nullptr}, down{nullptr};
};
TORCH_MODULE(FeedForward);

// Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(.)).
// Paths: norm1, attn, attn.qkv, attn.proj, norm2, mlp, mlp.up, mlp.down.
struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(int64_t hidden, int64_t heads, int64_t ffn);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<RMSNorm> norm1{nullptr}, norm2{nullptr};
  remat::Remat<Attention> attn{nullptr};
  remat::Remat<FeedForward> mlp{nullptr};
};
TORCH_MODULE(TransformerBlock);

// y = fn(x) as a module, counting its calls: the four regions of the save-chain scenario.
struct LambdaImpl : torch::nn::Module {
  explicit LambdaImpl(std::function<at::Tensor(const at::Tensor&)> fn) : fn_(std::move(fn)) {}
  at::Tensor forward(const at::Tensor& x) {
    ++calls;
    return fn_(x);
  }
  std::function<at::Tensor(const at::Tensor&)> fn_;
  int64_t calls = 0;
};
TORCH_MODULE(Lambda);

// x * scale (RECOMPUTE; scale a parameter, 2 in the benchmark) -> s1 relu(x * x) -> s2 + 0.125 ->
// s3 * 1.5 -> s4 + 0.25: the SAVE -> SAVE chain of docs/remat.md (s1..s3 save_output = false, s4
// true when optimized). Paths: layers.<i>.s1..
struct SaveChainImpl : torch::nn::Module {
  explicit SaveChainImpl(double scale_init = 2.0);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<Lambda> s1{nullptr}, s2{nullptr}, s3{nullptr}, s4{nullptr};
  at::Tensor scale;
  int64_t calls = 0;  // RECOMPUTE part (x * scale)
};
TORCH_MODULE(SaveChain);

struct SaveChainStackImpl : torch::nn::Module {
  explicit SaveChainStackImpl(int64_t layers, double scale_init = 2.0);
  at::Tensor forward(at::Tensor x);
  remat::ModuleList layers{nullptr};
};
TORCH_MODULE(SaveChainStack);

}  // namespace pipemat::models
