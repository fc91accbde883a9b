// model.from: a llama's shape from a Hugging Face config.json, read as transformers' LlamaConfig
// reads it (Note [Llama config.json] in pipemat/weights/hf_config.h); what this file adds is
// pipemat's own rules: the model kind, keys given in one place, a vocabulary that holds the
// bytes, seq_len within max_position_embeddings.

#include <cstdint>
#include <filesystem>
#include <string>

#include "config_reader.h"
#include "pipemat/core/files.h"
#include "pipemat/models/gpt.h"
#include "pipemat/weights/hf_config.h"

namespace pipemat::train::config_detail {
namespace {

// config.json is small; a larger file is not one.
constexpr int64_t kMaxConfigJsonBytes = int64_t{1} << 20;

}  // namespace

void apply_model_from(TrainConfig& config, const ConfigReader& reader) {
  models::ModelOptions& m = config.model;
  if (m.from.empty()) return;
  if (m.kind != models::ModelKind::kLlama) {
    reader.fail_at("model.from", std::string("reads a Hugging Face Llama config.json; it needs "
                                             "model.kind llama, not ") +
                                     to_string(m.kind));
  }
  for (const char* key :
       {"model.layers", "model.hidden", "model.heads", "model.kv_heads", "model.ffn", "model.vocab",
        "model.rope_theta", "model.norm_eps", "model.tie_embeddings"}) {
    if (reader.given(key)) {
      reader.fail_at(key, "is set by model.from (" + m.from +
                              "/config.json); give it in one place: remove it here or drop "
                              "model.from");
    }
  }
  const std::string file = m.from + "/config.json";
  const std::string content = read_regular_file(file, "model.from", kMaxConfigJsonBytes);
  weights::LlamaConfig hf;
  try {
    hf = weights::parse_llama_config(content, file);
  } catch (const WeightsError& e) {
    reader.fail_at("model.from", e.what());
  }
  // The text's bytes are ids 0 .. 255 (no tokenizer is read yet): a smaller vocabulary cannot
  // hold them. A larger one's other ids are rows no byte uses. (Absent, vocab_size is
  // transformers' default, 32000, as transformers would read the file.)
  if (hf.vocab_size < models::kByteVocab) {
    reader.fail_at("model.from", file + ": field 'vocab_size' is " + std::to_string(hf.vocab_size) +
                                     "; the llama trains on bytes of text (data.path), ids 0 to " +
                                     std::to_string(models::kByteVocab - 1) +
                                     ", so it needs at least " +
                                     std::to_string(models::kByteVocab));
  }
  m.vocab = hf.vocab_size;
  m.layers = hf.num_hidden_layers;
  m.hidden = hf.hidden_size;
  m.heads = hf.num_attention_heads;
  m.kv_heads = hf.num_key_value_heads;
  m.ffn = hf.intermediate_size;
  m.rope_theta = hf.rope_theta;
  m.norm_eps = hf.rms_norm_eps;
  m.tie_embeddings = hf.tie_word_embeddings;
  // max_position_embeddings (transformers' default 2048 when the file gives none) caps seq_len.
  if (m.seq_len > hf.max_position_embeddings) {
    if (reader.given("model.seq_len")) {
      reader.fail_at(
          "model.seq_len",
          std::to_string(m.seq_len) + " is longer than max_position_embeddings " +
              std::to_string(hf.max_position_embeddings) + " of " + file +
              (hf.is_default("max_position_embeddings") ? " (not given: transformers' default)"
                                                        : ""));
    }
    m.seq_len = hf.max_position_embeddings;
  }
  // The tokenizer of the model, when the directory holds one and data.tokenizer names none.
  if (config.data.tokenizer.empty()) {
    for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
      std::error_code ec;
      if (std::filesystem::is_regular_file(m.from + "/" + name, ec)) {
        config.data.tokenizer = m.from;
        break;
      }
    }
  }
  m.from.clear();
}

}  // namespace pipemat::train::config_detail
