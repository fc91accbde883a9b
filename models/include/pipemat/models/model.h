#pragma once
// What a model of the zoo is made of, as plain values: its kind and shape (ModelOptions), how its
// layers map to pipeline stages (PartitionOptions), and which of its modules recompute
// (RematConfig). A training config holds them; the models read them.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/remat/policy.h"

namespace pipemat::models {

// model.kind and remat.policy / remat.stages are spelled as words, in the pattern of
// schedule::ScheduleKind: to_string gives the spelling of a value (the YAML value, the CLI
// choice); parse_* gives the value of a spelling, or nullopt for any other text (the caller names
// the key or flag in its error); the *_values() lists hold every value in the order messages and
// docs list them (pipemat::spellings in core/spelled.h gives their words).
enum class ModelKind { kGpt, kLlama, kMlp, kRmsNormGemm, kTransformer, kMoe, kSaveChain };
enum class RematPolicyKind { kNone, kFull, kSelective, kCustom };

// gpt | llama | mlp | rmsnorm-gemm | transformer | moe | save-chain
const char* to_string(ModelKind kind);
const char* to_string(RematPolicyKind policy);  // none | full | selective | custom

std::optional<ModelKind> parse_model_kind(const std::string& text);
std::optional<RematPolicyKind> parse_remat_policy(const std::string& text);

const std::vector<ModelKind>& model_kind_values();
const std::vector<RematPolicyKind>& remat_policy_values();

// The model. Kind gpt (gpt.h): a byte-level GPT of `layers` decoder blocks trained on the text
// of `data` with cross-entropy; a micro-batch is `batch` windows of `seq_len` bytes. Kind llama
// (llama.h): the same with Llama-family blocks (RMSNorm, grouped-query attention with rotary
// embeddings, SwiGLU). The zoo
// kinds: a stack of `layers` identical layers fed with synthetic data (fixed seeds, no
// downloads); input and target of a micro-batch are [tokens, hidden], the loss is the mean
// squared error on the last stage.
// The vocabulary of byte-level text: every byte value is a token id (gpt, llama).
inline constexpr int64_t kByteVocab = 256;

struct ModelOptions {
  ModelKind kind = ModelKind::kRmsNormGemm;
  int64_t layers = 8;
  int64_t hidden = 64;
  int64_t tokens = 32;          // tokens (rows) per micro-batch
  int64_t heads = 4;            // transformer
  int64_t ffn = 0;              // mlp / transformer inner size; 0 = 4 * hidden
  int64_t experts = 4;          // moe
  int64_t top_k = 2;            // moe
  int64_t seq_len = 128;        // gpt: bytes per sequence (the position table's size)
  int64_t batch = 8;            // gpt: sequences per micro-batch
  int64_t vocab = kByteVocab;   // gpt, llama: token ids [0, vocab); the first 256 are bytes
  double dropout = 0.0;         // gpt: after the embedding and on both residual branches
  int64_t kv_heads = 0;         // llama: key/value heads (grouped-query attention); 0 = heads
  double rope_theta = 10000.0;  // llama: base of the rotary embedding's frequencies
  double norm_eps = 1e-5;       // llama: the RMSNorms' epsilon
  bool tie_embeddings = false;  // llama: the head is the embedding's weight (one stage only)
  std::string from;             // llama: a directory with a Hugging Face config.json (read into
                                // the keys above by the config reader); empty: none
};

// gpt and llama: byte-level language models on text (data.path, validation, sampling).
inline bool is_text_model(ModelKind kind) {
  return kind == ModelKind::kGpt || kind == ModelKind::kLlama;
}

// How layers map to stages. `layers_per_stage` empty: balanced by parameter count (contiguous
// ranges, as equal as the layer sizes allow); otherwise one entry per stage, summing to
// model.layers. The number of stages is schedule.ranks * schedule.virtual_stages (2 per rank
// for zb-v); stage s runs on the rank the schedule's stage_to_rank gives.
struct PartitionOptions {
  std::vector<int64_t> layers_per_stage;
  // `layers_per_stage: auto`: train chooses the counts by measured cost (Note [Split by cost] in
  // pipemat/train/plan.h) before any stage is built; the partition functions refuse it.
  bool by_cost = false;
  // `partition.memory_budget`, bytes per rank (one for every rank, or one per rank; empty: no
  // budget): the split `auto` chooses must fit it. Only with by_cost.
  std::vector<int64_t> memory_budget;
};

// Which modules recompute. `none`: no checkpoint. `full`: every layer a checkpoint unit.
// `selective`: every layer a checkpoint unit with the model kind's GEMM-like member a SAVE region
// (rmsnorm-gemm: gemm; moe: experts; transformer: attn.qkv and mlp.up; llama: the q, k, v, gate
// and up projections; mlp: up; save-chain: the chain). `custom`: the `checkpoint` / `exclude`
// paths given (paths relative to a stage, e.g. "layers.*" and "layers.*.gemm").
// One entry of remat.stages: a policy name, or a stage's own checkpoint units and SAVE regions
// (YAML `{checkpoint: [...], exclude: [...]}`, what `pipemat plan --out` writes: a choice per
// layer). Paths are relative to the stage's module, like remat.checkpoint's.
struct StageRemat {
  RematPolicyKind policy = RematPolicyKind::kSelective;
  bool own = false;          // a mapping: policy is kCustom and `lists` holds its lists
  remat::RematPolicy lists;  // checkpoint and exclude of an own entry
  static StageRemat named(RematPolicyKind kind) { return {kind, false, {}}; }
  static StageRemat of(std::vector<std::string> checkpoint,
                       std::vector<remat::ExcludeRule> exclude);
};
// Same policy name, or the same lists in the same order (checkpoint options aside).
bool operator==(const StageRemat& a, const StageRemat& b);
inline bool operator!=(const StageRemat& a, const StageRemat& b) { return !(a == b); }

struct RematConfig {
  RematPolicyKind policy = RematPolicyKind::kSelective;
  remat::RematPolicy custom;  // used with policy kCustom
  // One entry per model stage (schedule.ranks x chunks per rank) instead of `policy` on every
  // stage; empty: `policy` everywhere.
  std::vector<StageRemat> stages;
  bool early_stop = true;
};

}  // namespace pipemat::models
