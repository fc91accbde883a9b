// Pipeline-train your own model with pipemat: a small causal language model split into two
// stages, trained on two ranks with selective recompute, AdamW, an LR warmup and global-norm
// clipping. Run it with
//   mpirun -n 2 ./pipeline_example
// (or any two ranks pipemat's transports can connect: PIPEMAT_MASTER=127.0.0.1:29500 with
// PIPEMAT_RANK / PIPEMAT_WORLD_SIZE for TCP). Rank 1 (the last stage) prints the progress.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/pp/pipeline.h"

using pipemat::pp::Tensors;

constexpr int64_t kVocab = 16, kHidden = 32, kSeq = 12, kBatch = 8;

// ids [B, T] -> (hidden [B, T, H], mask [T, T] causal). Two tensors cross every boundary.
struct EmbedImpl : torch::nn::Module {
  EmbedImpl() : tok(register_module("tok", torch::nn::Embedding(kVocab, kHidden))) {}
  Tensors forward(const at::Tensor& ids) {
    const int64_t t = ids.size(1);
    return {tok(ids), at::ones({t, t}).tril()};
  }
  torch::nn::Embedding tok;
};
TORCH_MODULE(Embed);

// Causal self-attention and an MLP. `qkv` and `up` sit in Sequentials so that a remat policy
// can address them by path without touching this forward.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    qkv = register_module(
        "qkv", torch::nn::Sequential(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})),
                                     torch::nn::Linear(kHidden, 3 * kHidden)));
    up = register_module(
        "up", torch::nn::Sequential(torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})),
                                    torch::nn::Linear(kHidden, 4 * kHidden)));
    down = register_module("down", torch::nn::Linear(4 * kHidden, kHidden));
  }
  Tensors forward(const Tensors& in) {
    const at::Tensor &h = in.at(0), &mask = in.at(1);
    auto q = qkv->forward(h).chunk(3, -1);
    at::Tensor scores = q[0].matmul(q[1].transpose(-2, -1)) / std::sqrt(double(kHidden));
    at::Tensor x = h + at::softmax(scores.masked_fill(mask == 0, -1e9), -1).matmul(q[2]);
    return {x + down(at::gelu(up->forward(x))), mask};
  }
  torch::nn::Sequential qkv{nullptr}, up{nullptr};
  torch::nn::Linear down{nullptr};
};
TORCH_MODULE(Block);

struct HeadImpl : torch::nn::Module {
  HeadImpl() : out(register_module("out", torch::nn::Linear(kHidden, kVocab))) {}
  at::Tensor forward(const Tensors& in) { return out(in.at(0)); }
  torch::nn::Linear out;
};
TORCH_MODULE(Head);

// The task: continue an arithmetic sequence modulo kVocab (x, x+d, x+2d, ...).
pipemat::pp::MicroBatch make_batch(int64_t step, int64_t micro_batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(step * 131 + micro_batch);
  at::Tensor start = at::randint(kVocab, {kBatch, 1}, gen);
  at::Tensor stride = at::randint(1, 4, {kBatch, 1}, gen);
  at::Tensor seq = (start + stride * at::arange(kSeq + 1, at::kLong)).remainder(kVocab);
  return {{seq.narrow(1, 0, kSeq)}, {seq.narrow(1, 1, kSeq).contiguous()}};
}

int main() {
  auto transport = pipemat::comm::make_transport();  // mpi under mpirun, tcp with PIPEMAT_MASTER

  // The whole model, built with the same seed on every rank; each rank keeps its stages.
  at::manual_seed(0);
  torch::nn::Sequential model;
  model->push_back("embed", Embed());
  for (int i = 0; i < 4; ++i) model->push_back("block" + std::to_string(i), Block());
  model->push_back("head", Head());

  pipemat::pp::PipelineOptions options;
  options.schedule.kind = pipemat::schedule::ScheduleKind::kOneFOneB;
  options.schedule.ranks = 2;  // ranks
  options.schedule.micro_batches = 4;
  options.schedule.recompute = pipemat::schedule::RecomputeMode::kPretrigger;
  options.remat.checkpoint = {"block*"};                        // blocks recompute in backward...
  options.remat.exclude = {{"block*.qkv.1"}, {"block*.up.1"}};  // ...but keep their projections
  options.loss = [](const Tensors& out, const Tensors& target) {
    return torch::nn::functional::cross_entropy(out.at(0).reshape({-1, kVocab}),
                                                target.at(0).reshape({-1}));
  };
  options.optimizer = [](const std::vector<at::Tensor>& params) {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3));
  };
  options.lr_schedule = [](torch::optim::Optimizer& opt, int64_t step) {
    for (auto& group : opt.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options())
          .lr(3e-3 * std::min(1.0, (step + 1) / 10.0));
    }
  };
  options.clip_grad_norm = 1.0;

  const auto bounds = pipemat::pp::balance_by_parameters(model, pipemat::pp::stage_count(options));
  pipemat::pp::Pipeline pipeline(*transport, options, pipemat::pp::split_sequential(model, bounds));

  const int64_t steps = 60;
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    pipemat::pp::StepMetrics m = pipeline.train_step(make_batch);
    if (step == 0) first = m.loss;
    last = m.loss;
    if (pipeline.is_last_stage_rank() && (step + 1) % 10 == 0) {
      std::printf("step %lld/%lld  loss %.4f  grad norm %.3f  %.1f ms  bubble %.2f\n",
                  static_cast<long long>(step + 1), static_cast<long long>(steps), m.loss,
                  m.grad_norm, m.step_ms, m.bubble);
    }
  }
  pipemat::pp::EvalOptions eval;
  eval.micro_batches = 4;
  eval.step = 1000000;                                          // unseen data
  const double val = pipeline.evaluate(make_batch, eval).loss;  // every rank gets the loss
  if (pipeline.is_last_stage_rank()) {
    std::printf("the training loss fell from %.4f to %.4f; held-out loss %.4f\n", first, last, val);
  }
  return last < first ? 0 : 1;
}
