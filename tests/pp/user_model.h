#pragma once
// A user model that is not in the zoo, written in plain LibTorch (no pipemat code): token +
// position embedding of int64 ids -> blocks whose boundary carries (hidden, attention mask) ->
// vocab head; cross-entropy on int64 targets. Also the plain single-process training loop the
// pipeline must equal (AdamW, global-norm clipping, an LR schedule), and the data.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace user_model {

using Tensors = std::vector<at::Tensor>;

constexpr int64_t kVocab = 32;
constexpr int64_t kHidden = 16;
constexpr int64_t kBatch = 2;  // sequences per micro-batch

// ids [B, T] -> (hidden [B, T, H], mask [B, T] float: 1 for tokens, 0 for padding id 0)
struct EmbedImpl : torch::nn::Module {
  EmbedImpl() {
    tok = register_module("tok", torch::nn::Embedding(kVocab, kHidden));
    pos = register_module("pos", torch::nn::Embedding(64, kHidden));
  }
  Tensors forward(const at::Tensor& ids) {
    const int64_t t = ids.size(1);
    at::Tensor h = tok(ids) + pos(at::arange(t, at::kLong)).unsqueeze(0);
    return {h, (ids != 0).to(at::kFloat)};
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
};
TORCH_MODULE(Embed);

// Pre-norm causal self-attention (padding keys masked) and an MLP, both residual.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(double dropout = 0) : dropout_(dropout) {
    attn_in = register_module(
        "attn_in",
        torch::nn::Sequential(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})),
                              torch::nn::Linear(kHidden, 3 * kHidden)));
    proj = register_module("proj", torch::nn::Linear(kHidden, kHidden));
    mlp = register_module(
        "mlp", torch::nn::Sequential(
                   torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})),
                   torch::nn::Linear(kHidden, 2 * kHidden),
                   torch::nn::Functional([](const at::Tensor& x) { return at::gelu(x); }),
                   torch::nn::Linear(2 * kHidden, kHidden)));
  }
  Tensors forward(const Tensors& in) {
    const at::Tensor& h = in.at(0);
    const at::Tensor& mask = in.at(1);
    const int64_t t = h.size(1);
    auto qkv = attn_in->forward(h).chunk(3, -1);
    at::Tensor scores = qkv[0].matmul(qkv[1].transpose(-2, -1)) / std::sqrt(double(kHidden));
    at::Tensor allowed = at::ones({t, t}).tril().unsqueeze(0) * mask.unsqueeze(1);
    scores = scores + (1 - allowed) * -1e4;
    at::Tensor x = h + proj(at::softmax(scores, -1).matmul(qkv[2]));
    at::Tensor y = mlp->forward(x);
    if (dropout_ > 0) y = at::dropout(y, dropout_, is_training());
    return {x + y, mask};
  }
  double dropout_;
  torch::nn::Sequential attn_in{nullptr}, mlp{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Block);

// (hidden, mask) -> logits [B, T, V]
struct HeadImpl : torch::nn::Module {
  HeadImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    out = register_module("out", torch::nn::Linear(kHidden, kVocab));
  }
  at::Tensor forward(const Tensors& in) { return out(norm(in.at(0))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Head);

// embed, block0 .. block{n-1}, head. Same seed -> same weights (initialization is serialized so
// that ranks running as threads draw the same numbers).
inline torch::nn::Sequential make_model(int blocks, uint64_t seed, double dropout = 0) {
  static std::mutex init;
  std::lock_guard<std::mutex> lock(init);
  at::manual_seed(seed);
  torch::nn::Sequential model;
  model->push_back("embed", Embed());
  for (int b = 0; b < blocks; ++b) model->push_back("block" + std::to_string(b), Block(dropout));
  model->push_back("head", Head());
  return model;
}

inline at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

// Sequence length of a step: changes between steps.
inline int64_t seq_len(int64_t step) { return step % 2 == 0 ? 6 : 9; }

// ids and next-token targets of micro-batch `mb` of step `step`; some ids are padding (0).
inline std::pair<at::Tensor, at::Tensor> data(int64_t step, int64_t mb) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + 97 * step + mb);
  at::Tensor seq = at::randint(kVocab, {kBatch, seq_len(step) + 1}, gen);
  return {seq.narrow(1, 0, seq_len(step)), seq.narrow(1, 1, seq_len(step)).contiguous()};
}

constexpr double kLr = 0.01;
constexpr double kClip = 0.5;  // small enough that clipping is active
inline double lr_at(int64_t step) {
  return kLr * (step < 2 ? (step + 1) / 2.0 : 1.0 / (step - 0.5));
}
inline void set_lr(torch::optim::Optimizer& o, int64_t step) {
  for (auto& g : o.param_groups())
    static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr_at(step));
}
inline std::unique_ptr<torch::optim::Optimizer> make_adamw(const std::vector<at::Tensor>& p) {
  return std::make_unique<torch::optim::AdamW>(p,
                                               torch::optim::AdamWOptions(kLr).weight_decay(0.01));
}

struct PlainRun {
  std::vector<double> losses;      // per step: sum over micro-batches of loss / M
  std::vector<double> grad_norms;  // per step, before clipping
  std::vector<std::map<std::string, at::Tensor>> params;  // per step, after the optimizer step
};

// The plain LibTorch loop: M micro-batches per step, (loss / M).backward(), clip, lr, step.
inline PlainRun plain_training(int blocks, int64_t micro_batches, int64_t steps) {
  torch::nn::Sequential model = make_model(blocks, 7);
  auto opt = make_adamw(model->parameters());
  PlainRun run;
  for (int64_t step = 0; step < steps; ++step) {
    opt->zero_grad();
    double loss_sum = 0;
    for (int64_t i = 0; i < micro_batches; ++i) {
      auto [ids, targets] = data(step, i);
      at::Tensor loss = loss_of(model->forward<at::Tensor>(ids), targets) / double(micro_batches);
      loss_sum += loss.item<double>();
      loss.backward();
    }
    run.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kClip));
    set_lr(*opt, step);
    opt->step();
    run.losses.push_back(loss_sum);
    std::map<std::string, at::Tensor> ps;
    for (const auto& p : model->named_parameters()) ps[p.key()] = p.value().detach().clone();
    run.params.push_back(std::move(ps));
  }
  return run;
}

}  // namespace user_model
