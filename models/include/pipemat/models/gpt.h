#pragma once
// A byte-level GPT for the main job: token + position embedding, pre-norm decoder blocks
// (causal multi-head self-attention and an MLP, both residual, with dropout: Note
// [Counter-based dropout] in dropout.h), a final norm and a head over model.vocab token ids (256
// by default: the bytes of text); cross-entropy over the next token. Split into pipeline stages:
// the first stage embeds int64 ids, the boundaries carry the hidden states [batch, seq_len,
// hidden], the last stage returns the logits [batch, seq_len, vocab].
//
// Remat paths (relative to a stage): "blocks.<i>" (a block), "blocks.<i>.attn" (the attention:
// qkv, the causal softmax core, proj), "blocks.<i>.attn.qkv", "blocks.<i>.mlp",
// "blocks.<i>.mlp.up". Policies (stage_policy of zoo_stages.h): none; full (every block a
// checkpoint unit); selective (every block a checkpoint unit whose QKV and MLP-up projections are
// SAVE regions: their outputs are kept, their inputs rederived, so a replay recomputes the norms,
// the attention core, the activation and the down projections but not the two widest GEMMs).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/models/dropout.h"
#include "pipemat/models/model.h"
#include "pipemat/remat/remat.h"

namespace pipemat::models {

// The GPT's sizes from a config's model section (kind gpt): layers, hidden, heads, ffn (0: 4 x
// hidden), seq_len, vocab, dropout.
struct GptShape {
  int64_t layers = 4, hidden = 128, heads = 4, ffn = 512, seq_len = 128, vocab = kByteVocab;
  double dropout = 0.0;
};
GptShape gpt_shape(const ModelOptions& model);

struct GptEmbedImpl : torch::nn::Module {
  explicit GptEmbedImpl(const GptShape& shape);
  at::Tensor forward(const at::Tensor& ids);  // [B, T] int64 -> [B, T, H]
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  CounterDropout drop{nullptr};
  // Set: its dropout draws inside remat::LayerStream(*stream) (Note [Layer streams]); unset:
  // from the current stream.
  std::optional<int64_t> stream;
};
TORCH_MODULE(GptEmbed);

// torch::nn::Linear counting its forward calls: the QKV and MLP-up projections, the SAVE
// bodies of the selective policy (a replay that skips them leaves the count alone).
struct CountedLinearImpl : torch::nn::LinearImpl {
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& x) {
    ++calls;
    return torch::nn::LinearImpl::forward(x);
  }
  int64_t calls = 0;
};
TORCH_MODULE(CountedLinear);

// Causal self-attention: qkv projection, softmax(q k^T / sqrt(d) + causal mask) v (one fused
// kernel, at::scaled_dot_product_attention), proj.
struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GptShape& shape);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<CountedLinear> qkv{nullptr};
  torch::nn::Linear proj{nullptr};
  int64_t heads;
};
TORCH_MODULE(CausalSelfAttention);

// up -> GELU -> down.
struct GptMlpImpl : torch::nn::Module {
  explicit GptMlpImpl(const GptShape& shape);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<CountedLinear> up{nullptr};
  torch::nn::Linear down{nullptr};
};
TORCH_MODULE(GptMlp);

// x + drop(attn(ln1(x))), then + drop(mlp(ln2(.))).
struct GptBlockImpl : torch::nn::Module {
  explicit GptBlockImpl(const GptShape& shape);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  remat::Remat<CausalSelfAttention> attn{nullptr};
  remat::Remat<GptMlp> mlp{nullptr};
  CounterDropout drop{nullptr};
  int64_t calls = 0;              // forward calls, replays included
  std::optional<int64_t> stream;  // as GptEmbed's
};
TORCH_MODULE(GptBlock);

// Final LayerNorm and the head: [B, T, H] -> logits [B, T, vocab].
struct GptHeadImpl : torch::nn::Module {
  explicit GptHeadImpl(const GptShape& shape);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(GptHead);

// The whole model's parts, built from a seed (GPT-2 initialization: normal(0, 0.02), residual
// projections scaled by 1 / sqrt(2 x layers), zero biases). Deterministic for a seed and
// serialized process-wide, so ranks that run as threads build equal weights. Their dropouts
// draw from layer streams (Note [Layer streams] in pipemat/remat/rng.h): the embedding's keyed
// -1, block i's keyed i, whatever stage holds them, so the caller reseeds the generator before
// every forward (pp::Pipeline with a seed and PipelineStage::layer_streams, the references),
// or each forward draws the masks of the one before (Note [Random streams of a step]).
struct GptParts {
  GptEmbed embed{nullptr};
  std::vector<GptBlock> blocks;
  GptHead head{nullptr};
};
GptParts build_gpt(const GptShape& shape, uint64_t seed);

// A pipeline stage of the GPT: the embedding (first stage), blocks [first, end) as "blocks.*"
// (local numbering), the head (last stage).
struct GptStageImpl : torch::nn::Module {
  GptStageImpl(const GptParts& parts, int64_t first_block, int64_t end_block, bool first,
               bool last);
  at::Tensor forward(const at::Tensor& x);
  GptEmbed embed{nullptr};
  remat::ModuleList blocks{nullptr};
  GptHead head{nullptr};
};
TORCH_MODULE(GptStage);

// Block boundaries of `stages` stages ("first block of every stage, then the end"): from
// partition.layers_per_stage when given (blocks per stage), else balanced by parameter count
// with the embedding counted on the first stage and the head on the last (partition_sizes of
// zoo_stages.h, whose ConfigErrors it shares).
std::vector<int64_t> partition_gpt(const GptParts& parts, const PartitionOptions& partition,
                                   int stages);

// Mean cross-entropy of logits [B, T, 256] against the next bytes [B, T].
at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace pipemat::models
