#pragma once
// A Llama-family decoder: token embedding, pre-norm decoder blocks (RMSNorm ->
// grouped-query causal attention with rotary position embeddings -> residual; RMSNorm -> SwiGLU
// MLP -> residual), a final RMSNorm and a head over model.vocab token ids (256 by default: the
// bytes of text), no biases, no dropout; cross-entropy over the next token (gpt_loss). The modules
// are named as Hugging Face's LlamaForCausalLM names its parameters (llama_hf_name maps one onto
// the other). Split into pipeline stages like the GPT: the first stage embeds int64 ids, the
// boundaries carry the hidden states [batch, seq_len, hidden], the last stage returns the logits
// [batch, seq_len, vocab].
//
// Remat paths (relative to a stage): "layers.<i>" (a block), "layers.<i>.self_attn",
// "layers.<i>.self_attn.{q,k,v}_proj", "layers.<i>.mlp", "layers.<i>.mlp.{gate,up}_proj".
// Policies (stage_policy of zoo_stages.h): none; full (every block a checkpoint unit); selective
// (every block a unit whose q, k, v, gate and up projections are SAVE regions: their outputs are
// kept and their inputs, the two RMSNorms' outputs, rederived, so a replay recomputes the norms,
// the rotary embedding, the attention core, the SwiGLU product and the o / down projections but
// not the five GEMMs that read a normalized input).
//
// Tied embeddings (model.tie_embeddings): the head multiplies by the embedding's weight. In a
// model of one stage it exists once; across stages the last stage holds a copy (Note [Tied
// weights]), equal bit for bit at every step.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/models/gpt.h"
#include "pipemat/models/model.h"
#include "pipemat/remat/remat.h"

namespace pipemat::models {

// The Llama's sizes from a config's model section (kind llama). ConfigError naming the key for
// heads that do not divide hidden, kv_heads that do not divide heads, an odd head size (the
// rotary embedding rotates pairs), dropout (llama has none).
struct LlamaShape {
  int64_t layers = 4, hidden = 128, heads = 4, kv_heads = 4, ffn = 344, seq_len = 128,
          vocab = kByteVocab;
  double rope_theta = 10000.0, norm_eps = 1e-5;
  bool tie_embeddings = false;
  int64_t head_dim() const { return hidden / heads; }
};
LlamaShape llama_shape(const ModelOptions& model);

// Hugging Face's LlamaRMSNorm: in float32, x * rsqrt(mean(x^2) + eps), back to the input's dtype,
// times the weight (so a bf16 input gives weight's float32 times a bf16 value).
struct LlamaRMSNormImpl : torch::nn::Module {
  LlamaRMSNormImpl(int64_t hidden, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(LlamaRMSNorm);

// cos and sin of the rotary embedding for positions [0, seq_len) ([seq_len, head_dim] each,
// float32): inv_freq = 1 / theta^(arange(0, d, 2) / d), freqs = position x inv_freq,
// cos / sin of cat(freqs, freqs) (Hugging Face's LlamaRotaryEmbedding, default rope type).
std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq_len, int64_t head_dim, double theta);
// x * cos + rotate_half(x) * sin for x [B, heads, T, d]; rotate_half(x) = cat(-x2, x1) of x's
// halves; cos, sin [T, d] in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// q, k, v projections (no bias; k and v of kv_heads heads), RoPE on q and k, causal attention of
// every query head with its group's key/value head (one fused kernel, in float32 under bf16
// autocast, as the GPT's), o projection.
struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaShape& shape);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<CountedLinear> q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
  torch::nn::Linear o_proj{nullptr};
  int64_t heads, kv_heads, head_dim;
  at::Tensor cos, sin;  // rope_tables of seq_len (not parameters, not buffers)
};
TORCH_MODULE(LlamaAttention);

// down(silu(gate(x)) * up(x)), no biases.
struct LlamaMlpImpl : torch::nn::Module {
  explicit LlamaMlpImpl(const LlamaShape& shape);
  at::Tensor forward(const at::Tensor& x);
  remat::Remat<CountedLinear> gate_proj{nullptr}, up_proj{nullptr};
  torch::nn::Linear down_proj{nullptr};
};
TORCH_MODULE(LlamaMlp);

// x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)).
struct LlamaBlockImpl : torch::nn::Module {
  explicit LlamaBlockImpl(const LlamaShape& shape);
  at::Tensor forward(const at::Tensor& x);
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  remat::Remat<LlamaAttention> self_attn{nullptr};
  remat::Remat<LlamaMlp> mlp{nullptr};
  int64_t calls = 0;  // forward calls, replays included
};
TORCH_MODULE(LlamaBlock);

// The whole model's parts, built from a seed (normal(0, 0.02) for the embedding and every
// projection, as Hugging Face's initializer_range; norms at one). lm_head is null when tied.
// Deterministic for a seed and serialized process-wide, so ranks that run as threads build equal
// weights.
struct LlamaParts {
  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<LlamaBlock> layers;
  LlamaRMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
LlamaParts build_llama(const LlamaShape& shape, uint64_t seed);

// A pipeline stage of the Llama: embed_tokens (first stage), blocks [first, end) as "layers.*"
// (local numbering), norm and lm_head (last stage; with tied embeddings the head is the
// embedding's weight: on a last stage that is not the first, a copy of it registered as
// "embed_tokens.weight", which llama_tied declares tied, Note [Tied weights]).
struct LlamaStageImpl : torch::nn::Module {
  LlamaStageImpl(const LlamaParts& parts, int64_t first_block, int64_t end_block, bool first,
                 bool last);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor head_weight() const;  // tied: the weight the head multiplies by
  torch::nn::Embedding embed_tokens{nullptr};
  remat::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};
  std::shared_ptr<torch::nn::Module> head_copy;  // tied, last stage but not first
  bool tied = false;
};
TORCH_MODULE(LlamaStage);

// PipelineStage::tied of stage `stage` of `stages` (Note [Tied weights]): with tied embeddings
// and more than one stage, the first and the last stage each declare "embed_tokens.weight".
std::map<std::string, std::string> llama_tied(int stage, int stages, bool tie_embeddings);

// Block boundaries of `stages` stages, as partition_gpt (the embedding counted on the first
// stage, the norm and head on the last: with tied embeddings over several stages, the last
// stage's copy of the embedding).
std::vector<int64_t> partition_llama(const LlamaParts& parts, const PartitionOptions& partition,
                                     int stages);

// Hugging Face names of the parameters. `own` is a name of a single-process llama's parameters
// (a stage's named_parameters with the global block numbering of ModelRun::global_name):
// "embed_tokens.weight" -> "model.embed_tokens.weight", "layers.<i>.<rest>" ->
// "model.layers.<i>.<rest>", "norm.weight" -> "model.norm.weight", "lm_head.weight" as it is.
// llama_own_name is the inverse. Both throw ConfigError naming a name that is not one of a
// llama's parameters.
std::string llama_hf_name(const std::string& own);
std::string llama_own_name(const std::string& hf);
// Every parameter of the model of `shape` in model order: {own name, Hugging Face name}
// (no lm_head when tied).
std::vector<std::pair<std::string, std::string>> llama_hf_names(const LlamaShape& shape);

}  // namespace pipemat::models
