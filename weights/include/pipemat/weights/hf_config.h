#pragma once
// The config.json of a Hugging Face Llama (transformers' LlamaConfig): read strictly, as
// transformers reads it, and written as pipemat's export writes it. No LibTorch.
//
// Note [Llama config.json]
// A config.json decides the model: read loosely, a file could train another model than the one
// transformers builds from the same file, in silence. parse_llama_config reads it with core's
// strict JSON (Note [Strict JSON]: no key twice at any depth, no NaN, no number that overflows,
// UTF-8 only) and then takes each field as transformers 5's LlamaConfig does, refusing what
// this llama does not model:
//   - "model_type" must be "llama" (it says which model the file describes: AutoConfig needs it);
//   - the shape has no default here: num_hidden_layers, hidden_size, num_attention_heads and
//     intermediate_size must be given (LlamaConfig would fill in Llama-7B's 32, 4096, 32 and
//     11008; a file without them is more likely damaged than meant for that model);
//   - where LlamaConfig has a default, the same default applies, exactly where transformers
//     applies it: vocab_size 32000, max_position_embeddings 2048, rms_norm_eps 1e-6, rope_theta
//     10000, tie_word_embeddings false, hidden_act silu, attention_bias and mlp_bias false when
//     the field is absent; num_key_value_heads = num_attention_heads and head_dim =
//     hidden_size / num_attention_heads when absent or null; rope_parameters (transformers 5:
//     {"rope_type", "rope_theta"}) absent or null is plain RoPE with the top-level rope_theta;
//   - null is refused where transformers refuses it (every other field above: its strict
//     config checks the type), and so are a float for an integer field, an integer
//     rms_norm_eps, a number for a boolean;
//   - what this llama does not model is an error naming the field: a rope_scaling or a
//     rope_type other than default, attention or MLP biases, an activation other than silu, a
//     head_dim other than hidden_size / num_attention_heads, an attention_dropout other than 0
//     (transformers would drop attention weights in training), a pad_token_id (transformers
//     zeroes that embedding row and its gradient);
//   - sizes are integers >= 1, hidden_size a multiple of num_attention_heads (transformers
//     refuses it too) and num_key_value_heads a divisor of num_attention_heads; rms_norm_eps and
//     rope_theta finite numbers > 0.
// Other fields (architectures, torch_dtype, bos_token_id, use_cache, ...) change nothing of the
// model and are ignored, as transformers' LlamaForCausalLM ignores them. What pipemat itself
// allows (vocab_size 256 for a byte-level llama, seq_len within max_position_embeddings) is the
// caller's (train's model.from).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat::weights {

// The fields of transformers' LlamaConfig that decide the model, with its defaults.
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // = num_attention_heads when the file gives none
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  // The fields the file did not give (or gave null where transformers reads null as absent),
  // which hold transformers' defaults: "vocab_size", "num_key_value_heads", "head_dim", ...
  std::vector<std::string> defaulted;

  // hidden_size / num_attention_heads (the only head_dim this llama models).
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // Whether `field` is one of `defaulted`.
  bool is_default(std::string_view field) const;

  bool operator==(const LlamaConfig&) const = default;
};

// The config.json text `text` of the file `file` (Note [Llama config.json]). WeightsError
// "<file>: field 'X' ..." naming the field and what was expected, or "<file>: not valid JSON
// (parse error at line L, column C: ...)".
LlamaConfig parse_llama_config(std::string_view text, const std::string& file);

// The config.json of `config` for a float32 LlamaForCausalLM, as transformers writes one (keys
// in a fixed order, two-space indent, a final newline): the same config always gives the same
// bytes, and parse_llama_config reads it back equal (with nothing defaulted). The shape fields,
// rope_theta both at the top level (transformers 4) and in rope_parameters (5), head_dim,
// hidden_act silu, no biases, architectures ["LlamaForCausalLM"], torch_dtype float32.
std::string write_llama_config(const LlamaConfig& config);

}  // namespace pipemat::weights
