#include "pipemat/models/gpt.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>

#include <cmath>
#include <mutex>
#include <optional>

#include "causal_attention.h"
#include "pipemat/core/error.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/remat/rng.h"

namespace pipemat::models {

GptShape gpt_shape(const ModelOptions& m) {
  GptShape s;
  s.layers = m.layers;
  s.hidden = m.hidden;
  s.heads = m.heads;
  s.ffn = m.ffn > 0 ? m.ffn : 4 * m.hidden;
  s.seq_len = m.seq_len;
  s.vocab = m.vocab;
  s.dropout = m.dropout;
  PIPEMAT_CHECK(s.heads > 0 && s.hidden % s.heads == 0, ConfigError, "model.heads: ", s.heads,
                " does not divide model.hidden ", s.hidden);
  return s;
}

GptEmbedImpl::GptEmbedImpl(const GptShape& shape) {
  tok = register_module("tok", torch::nn::Embedding(shape.vocab, shape.hidden));
  pos = register_module("pos", torch::nn::Embedding(shape.seq_len, shape.hidden));
  drop = register_module("drop", CounterDropout(shape.dropout));
}

at::Tensor GptEmbedImpl::forward(const at::Tensor& ids) {
  PIPEMAT_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, PipelineError,
                "gpt: the first stage takes int64 ids [batch, seq_len], got ",
                c10::toString(ids.scalar_type()), " ", ids.sizes());
  const int64_t t = ids.size(1);
  PIPEMAT_CHECK(t <= pos->weight.size(0), PipelineError, "gpt: a sequence of ", t,
                " tokens is longer than model.seq_len ", pos->weight.size(0));
  const at::Tensor x = tok(ids) + pos(at::arange(t, at::kLong)).unsqueeze(0);
  std::optional<remat::LayerStream> layer;  // Note [Layer streams]
  if (stream && drop->p > 0 && is_training()) layer.emplace(*stream);
  return drop(x);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptShape& shape) : heads(shape.heads) {
  qkv = register_module("qkv", CountedLinear(shape.hidden, 3 * shape.hidden));
  proj = register_module("proj", torch::nn::Linear(shape.hidden, shape.hidden));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2), d = h / heads;
  auto parts = qkv(x).view({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4});  // [3, B, nh, T, d]
  // softmax(q k^T / sqrt(d) + causal mask) v in one fused kernel (LibTorch's flash attention on
  // the CPU): no [T, T] score, mask or probability tensor is made, kept for backward or
  // recomputed. Same result as the explicit formula to float rounding (Gpt.AttentionIsCausal).
  const at::Tensor context = causal_attention(parts[0], parts[1], parts[2]);
  return proj(context.transpose(1, 2).reshape({b, t, h}));  // [B, nh, T, d] -> [B, T, h]
}

GptMlpImpl::GptMlpImpl(const GptShape& shape) {
  up = register_module("up", CountedLinear(shape.hidden, shape.ffn));
  down = register_module("down", torch::nn::Linear(shape.ffn, shape.hidden));
}

at::Tensor GptMlpImpl::forward(const at::Tensor& x) { return down(at::gelu(up(x))); }

GptBlockImpl::GptBlockImpl(const GptShape& shape) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.hidden})));
  attn = register_module("attn", CausalSelfAttention(shape));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.hidden})));
  mlp = register_module("mlp", GptMlp(shape));
  drop = register_module("drop", CounterDropout(shape.dropout));
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  ++calls;
  std::optional<remat::LayerStream> layer;  // Note [Layer streams]
  if (stream && drop->p > 0 && is_training()) layer.emplace(*stream);
  const at::Tensor h = x + drop(attn(ln1(x)));
  return h + drop(mlp(ln2(h)));
}

GptHeadImpl::GptHeadImpl(const GptShape& shape) {
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.hidden})));
  out = register_module("out", torch::nn::Linear(shape.hidden, shape.vocab));
}

at::Tensor GptHeadImpl::forward(const at::Tensor& x) { return out(norm(x)); }

namespace {

void init_linear(torch::nn::LinearImpl& linear, double std) {
  torch::nn::init::normal_(linear.weight, 0.0, std);
  torch::nn::init::zeros_(linear.bias);
}

}  // namespace

GptParts build_gpt(const GptShape& shape, uint64_t seed) {
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  at::manual_seed(seed);
  at::NoGradGuard no_grad;
  GptParts parts;
  parts.embed = GptEmbed(shape);
  parts.embed->stream = -1;  // Note [Layer streams]: keyed by the layer, not the stage
  torch::nn::init::normal_(parts.embed->tok->weight, 0.0, 0.02);
  torch::nn::init::normal_(parts.embed->pos->weight, 0.0, 0.02);
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(shape.layers));
  for (int64_t i = 0; i < shape.layers; ++i) {
    GptBlock block(shape);
    block->stream = i;
    init_linear(*block->attn->qkv, 0.02);
    init_linear(*block->attn->proj, residual_std);
    init_linear(*block->mlp->up, 0.02);
    init_linear(*block->mlp->down, residual_std);
    parts.blocks.push_back(block);
  }
  parts.head = GptHead(shape);
  init_linear(*parts.head->out, 0.02);
  return parts;
}

GptStageImpl::GptStageImpl(const GptParts& parts, int64_t first_block, int64_t end_block,
                           bool first, bool last) {
  if (first) embed = register_module("embed", parts.embed);
  torch::nn::ModuleList list;
  for (int64_t i = first_block; i < end_block; ++i) list->push_back(parts.blocks[i]);
  blocks = register_module("blocks", list);
  if (last) head = register_module("head", parts.head);
}

at::Tensor GptStageImpl::forward(const at::Tensor& input) {
  at::Tensor x = embed ? embed(input) : input;
  for (auto& block : *blocks) x = block->as<GptBlock>()->forward(x);
  return head ? head(x) : x;
}

std::vector<int64_t> partition_gpt(const GptParts& parts, const PartitionOptions& partition,
                                   int stages) {
  const auto count = [](const torch::nn::Module& m) {
    double n = 0;
    for (const auto& p : m.parameters()) n += static_cast<double>(p.numel());
    return n;
  };
  std::vector<double> sizes;
  for (const auto& block : parts.blocks) sizes.push_back(count(*block));
  sizes.front() += count(*parts.embed);
  sizes.back() += count(*parts.head);
  return partition_sizes(sizes, partition, stages);
}

at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

}  // namespace pipemat::models
