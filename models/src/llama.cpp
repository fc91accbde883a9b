#include "pipemat/models/llama.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <mutex>

#include "causal_attention.h"
#include "pipemat/core/error.h"
#include "pipemat/models/zoo_stages.h"

namespace pipemat::models {

LlamaShape llama_shape(const ModelOptions& m) {
  LlamaShape s;
  s.layers = m.layers;
  s.hidden = m.hidden;
  s.heads = m.heads;
  s.kv_heads = m.kv_heads > 0 ? m.kv_heads : m.heads;
  s.ffn = m.ffn > 0 ? m.ffn : 4 * m.hidden;
  s.seq_len = m.seq_len;
  s.vocab = m.vocab;
  s.rope_theta = m.rope_theta;
  s.norm_eps = m.norm_eps;
  s.tie_embeddings = m.tie_embeddings;
  PIPEMAT_CHECK(s.heads > 0 && s.hidden % s.heads == 0, ConfigError, "model.heads: ", s.heads,
                " does not divide model.hidden ", s.hidden);
  PIPEMAT_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, ConfigError,
                "model.kv_heads: ", s.kv_heads, " does not divide model.heads ", s.heads,
                " (every key/value head serves an equal group of query heads)");
  PIPEMAT_CHECK(s.head_dim() % 2 == 0, ConfigError, "model.heads: the head size model.hidden / ",
                "model.heads = ", s.head_dim(),
                " is odd; the rotary embedding rotates pairs of a head's features");
  PIPEMAT_CHECK(m.dropout == 0.0, ConfigError, "model.dropout: ", m.dropout,
                "; llama has no dropout (expected 0)");
  return s;
}

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t hidden, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({hidden}));
}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  const at::ScalarType dtype = x.scalar_type();
  at::Tensor h = x.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean({-1}, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(dtype);
}

std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq_len, int64_t head_dim, double theta) {
  const at::Tensor exponent =
      at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(head_dim);
  const at::Tensor inv_freq = 1.0 / at::pow(theta, exponent);  // [d / 2]
  const at::Tensor positions = at::arange(seq_len, at::kLong).to(at::kFloat);
  const at::Tensor freqs = at::outer(positions, inv_freq);  // [T, d / 2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);       // [T, d]
  return {emb.cos(), emb.sin()};
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

namespace {

torch::nn::LinearOptions no_bias(int64_t in, int64_t out) {
  return torch::nn::LinearOptions(in, out).bias(false);
}

// [B, kv_heads, T, d] -> [B, heads, T, d]: every key/value head repeated for its group of query
// heads (Hugging Face's repeat_kv).
at::Tensor repeat_kv(const at::Tensor& x, int64_t heads) {
  const int64_t b = x.size(0), kv = x.size(1), t = x.size(2), d = x.size(3);
  if (kv == heads) return x;
  return x.unsqueeze(2).expand({b, kv, heads / kv, t, d}).reshape({b, heads, t, d});
}

// x [B, T, hidden] as [B * T, hidden], the input of the SAVE regions (q, k, v, gate, up): under
// autocast each GEMM saves its bf16 cast of these rows, which remat rederives from the replayed
// norm (Note [Rederived casts] in remat/src/save_regions.cpp; a 3-d input's saved view of the
// cast is rederived as well).
at::Tensor flat_rows(const at::Tensor& x) { return x.reshape({-1, x.size(-1)}); }

}  // namespace

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaShape& shape)
    : heads(shape.heads), kv_heads(shape.kv_heads), head_dim(shape.head_dim()) {
  q_proj = register_module("q_proj", CountedLinear(no_bias(shape.hidden, heads * head_dim)));
  k_proj = register_module("k_proj", CountedLinear(no_bias(shape.hidden, kv_heads * head_dim)));
  v_proj = register_module("v_proj", CountedLinear(no_bias(shape.hidden, kv_heads * head_dim)));
  o_proj = register_module("o_proj", torch::nn::Linear(no_bias(heads * head_dim, shape.hidden)));
  std::tie(cos, sin) = rope_tables(shape.seq_len, head_dim, shape.rope_theta);
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), d = head_dim;
  PIPEMAT_CHECK(t <= cos.size(0), PipelineError, "llama: a sequence of ", t,
                " tokens is longer than model.seq_len ", cos.size(0));
  // The projections read [B * T, hidden] (flat_rows): under autocast each saves its own bf16
  // cast of that input whole, which the selective policy rederives instead of keeping.
  const at::Tensor rows = flat_rows(x);
  at::Tensor q = q_proj(rows).view({b, t, heads, d}).transpose(1, 2);  // [B, nh, T, d]
  at::Tensor k = k_proj(rows).view({b, t, kv_heads, d}).transpose(1, 2);
  at::Tensor v = v_proj(rows).view({b, t, kv_heads, d}).transpose(1, 2);
  const at::ScalarType dtype = q.scalar_type();
  const at::Tensor c = cos.narrow(0, 0, t).to(x.device(), dtype);
  const at::Tensor s = sin.narrow(0, 0, t).to(x.device(), dtype);
  q = apply_rope(q, c, s);
  k = repeat_kv(apply_rope(k, c, s), heads);
  v = repeat_kv(v, heads);
  const at::Tensor context = causal_attention(q, k, v);
  return o_proj(context.transpose(1, 2).reshape({b, t, heads * d}));
}

LlamaMlpImpl::LlamaMlpImpl(const LlamaShape& shape) {
  gate_proj = register_module("gate_proj", CountedLinear(no_bias(shape.hidden, shape.ffn)));
  up_proj = register_module("up_proj", CountedLinear(no_bias(shape.hidden, shape.ffn)));
  down_proj = register_module("down_proj", torch::nn::Linear(no_bias(shape.ffn, shape.hidden)));
}

at::Tensor LlamaMlpImpl::forward(const at::Tensor& x) {
  const at::Tensor rows = flat_rows(x);
  return down_proj(at::silu(gate_proj(rows)) * up_proj(rows)).view(x.sizes());
}

LlamaBlockImpl::LlamaBlockImpl(const LlamaShape& shape) {
  input_layernorm = register_module("input_layernorm", LlamaRMSNorm(shape.hidden, shape.norm_eps));
  self_attn = register_module("self_attn", LlamaAttention(shape));
  post_attention_layernorm =
      register_module("post_attention_layernorm", LlamaRMSNorm(shape.hidden, shape.norm_eps));
  mlp = register_module("mlp", LlamaMlp(shape));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x) {
  ++calls;
  const at::Tensor h = x + self_attn(input_layernorm(x));
  return h + mlp(post_attention_layernorm(h));
}

LlamaParts build_llama(const LlamaShape& shape, uint64_t seed) {
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  at::manual_seed(seed);
  at::NoGradGuard no_grad;
  const auto normal = [](const at::Tensor& w) { torch::nn::init::normal_(w, 0.0, 0.02); };
  LlamaParts parts;
  parts.embed_tokens = torch::nn::Embedding(shape.vocab, shape.hidden);
  normal(parts.embed_tokens->weight);
  for (int64_t i = 0; i < shape.layers; ++i) {
    LlamaBlock block(shape);
    for (const at::Tensor& w : {block->self_attn->q_proj->weight, block->self_attn->k_proj->weight,
                                block->self_attn->v_proj->weight, block->self_attn->o_proj->weight,
                                block->mlp->gate_proj->weight, block->mlp->up_proj->weight,
                                block->mlp->down_proj->weight}) {
      normal(w);
    }
    parts.layers.push_back(block);
  }
  parts.norm = LlamaRMSNorm(shape.hidden, shape.norm_eps);
  if (!shape.tie_embeddings) {
    parts.lm_head = torch::nn::Linear(no_bias(shape.hidden, shape.vocab));
    normal(parts.lm_head->weight);
  }
  return parts;
}

LlamaStageImpl::LlamaStageImpl(const LlamaParts& parts, int64_t first_block, int64_t end_block,
                               bool first, bool last)
    : tied(!parts.lm_head) {
  if (first) embed_tokens = register_module("embed_tokens", parts.embed_tokens);
  torch::nn::ModuleList list;
  for (int64_t i = first_block; i < end_block; ++i) list->push_back(parts.layers[i]);
  layers = register_module("layers", list);
  if (last) {
    norm = register_module("norm", parts.norm);
    if (!tied) lm_head = register_module("lm_head", parts.lm_head);
  }
  if (tied && last && !first) {
    // Note [Tied weights]: the last stage's own copy of the embedding's weight, under the
    // embedding's name (the checkpoint, export and import see one weight of one name).
    head_copy = register_module("embed_tokens", std::make_shared<torch::nn::Module>());
    head_copy->register_parameter("weight", parts.embed_tokens->weight.detach().clone());
  }
}

at::Tensor LlamaStageImpl::head_weight() const {
  return embed_tokens ? embed_tokens->weight : head_copy->named_parameters()["weight"];
}

at::Tensor LlamaStageImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  if (embed_tokens) {
    PIPEMAT_CHECK(input.dim() == 2 && input.scalar_type() == at::kLong, PipelineError,
                  "llama: the first stage takes int64 ids [batch, seq_len], got ",
                  c10::toString(input.scalar_type()), " ", input.sizes());
    x = embed_tokens(input);
  }
  for (auto& block : *layers) x = block->as<LlamaBlock>()->forward(x);
  if (!norm) return x;
  x = norm(x);
  return tied ? at::linear(x, head_weight()) : lm_head(x);
}

std::map<std::string, std::string> llama_tied(int stage, int stages, bool tie_embeddings) {
  if (!tie_embeddings || stages == 1 || (stage != 0 && stage != stages - 1)) return {};
  return {{"embed_tokens.weight", "embed_tokens.weight"}};
}

std::vector<int64_t> partition_llama(const LlamaParts& parts, const PartitionOptions& partition,
                                     int stages) {
  const auto count = [](const torch::nn::Module& m) {
    double n = 0;
    for (const auto& p : m.parameters()) n += static_cast<double>(p.numel());
    return n;
  };
  std::vector<double> sizes;
  for (const auto& block : parts.layers) sizes.push_back(count(*block));
  PIPEMAT_CHECK(!sizes.empty(), ConfigError, "model.layers: a llama needs at least one block");
  sizes.front() += count(*parts.embed_tokens);
  // The head's weight: its own, or with tied embeddings over several stages the last stage's
  // copy of the embedding (Note [Tied weights]).
  const double head =
      parts.lm_head ? count(*parts.lm_head) : (stages > 1 ? count(*parts.embed_tokens) : 0.0);
  sizes.back() += count(*parts.norm) + head;
  return partition_sizes(sizes, partition, stages);
}

namespace {

// The names of one block's parameters ("input_layernorm.weight", ...), in registration order.
const std::vector<std::string>& block_parameter_names() {
  static const std::vector<std::string> kNames = [] {
    LlamaShape tiny;
    tiny.hidden = 2;
    tiny.heads = 1;
    tiny.kv_heads = 1;
    tiny.ffn = 1;
    tiny.seq_len = 1;
    std::vector<std::string> names;
    for (const auto& item : LlamaBlock(tiny)->named_parameters()) names.push_back(item.key());
    return names;
  }();
  return kNames;
}

// "<i>.<rest>" with a block index and one of a block's parameter names, the rest of
// "layers.<i>.<rest>" after `prefix`.
bool is_block_name(const std::string& name, const std::string& prefix) {
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  const auto dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return false;
  const std::string index = name.substr(prefix.size(), dot - prefix.size());
  if (index.empty() ||
      !std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const std::vector<std::string>& rest = block_parameter_names();
  return std::find(rest.begin(), rest.end(), name.substr(dot + 1)) != rest.end();
}

}  // namespace

std::string llama_hf_name(const std::string& own) {
  if (own == "lm_head.weight") return own;
  if (own == "embed_tokens.weight" || own == "norm.weight" || is_block_name(own, "layers.")) {
    return "model." + own;
  }
  PIPEMAT_THROW(ConfigError, "llama: '", own,
                "' is not a parameter of a llama (expected embed_tokens.weight, "
                "layers.<i>.<parameter of a block>, norm.weight or lm_head.weight)");
}

std::string llama_own_name(const std::string& hf) {
  if (hf == "lm_head.weight") return hf;
  if (hf == "model.embed_tokens.weight" || hf == "model.norm.weight" ||
      is_block_name(hf, "model.layers.")) {
    return hf.substr(6);
  }
  PIPEMAT_THROW(ConfigError, "llama: '", hf,
                "' is not a Hugging Face Llama parameter this model has (expected "
                "model.embed_tokens.weight, model.layers.<i>.<parameter of a block>, "
                "model.norm.weight or lm_head.weight)");
}

std::vector<std::pair<std::string, std::string>> llama_hf_names(const LlamaShape& shape) {
  std::vector<std::string> own{"embed_tokens.weight"};
  for (int64_t i = 0; i < shape.layers; ++i) {
    for (const std::string& rest : block_parameter_names()) {
      own.push_back("layers." + std::to_string(i) + "." + rest);
    }
  }
  own.emplace_back("norm.weight");
  if (!shape.tie_embeddings) own.emplace_back("lm_head.weight");
  std::vector<std::pair<std::string, std::string>> names;
  for (const std::string& name : own) names.emplace_back(name, llama_hf_name(name));
  return names;
}

}  // namespace pipemat::models
