// model.from: a llama's shape from a Hugging Face config.json (LlamaConfig's fields).

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "config_reader.h"
#include "pipemat/core/files.h"
#include "pipemat/models/gpt.h"

namespace pipemat::train::config_detail {
namespace {

// config.json is small; a larger file is not one.
constexpr int64_t kMaxConfigJsonBytes = int64_t{1} << 20;

class HfConfig {
 public:
  HfConfig(nlohmann::json json, std::string file, const ConfigReader& reader)
      : json_(std::move(json)), file_(std::move(file)), reader_(reader) {}

  [[noreturn]] void fail(const std::string& field, const std::string& message) const {
    reader_.fail_at("model.from", file_ + ": field '" + field + "' " + message);
  }
  bool has(const std::string& field) const {
    return json_.contains(field) && !json_.at(field).is_null();
  }
  int64_t integer(const std::string& field, int64_t min) const {
    if (!has(field)) fail(field, "is missing; a llama config.json gives it");
    const nlohmann::json& v = json_.at(field);
    if (!v.is_number_integer() || v.get<int64_t>() < min) {
      fail(field, "is " + v.dump() + "; expected an integer >= " + std::to_string(min));
    }
    return v.get<int64_t>();
  }
  double number(const std::string& field) const {
    const nlohmann::json& v = json_.at(field);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0) {
      fail(field, "is " + v.dump() + "; expected a number > 0");
    }
    return v.get<double>();
  }
  bool boolean(const std::string& field) const {
    const nlohmann::json& v = json_.at(field);
    if (!v.is_boolean()) fail(field, "is " + v.dump() + "; expected true or false");
    return v.get<bool>();
  }
  const nlohmann::json& object(const std::string& field) const {
    const nlohmann::json& v = json_.at(field);
    if (!v.is_object()) fail(field, "is " + v.dump() + "; expected an object");
    return v;
  }
  std::string text(const std::string& field) const {
    const nlohmann::json& v = json_.at(field);
    if (!v.is_string()) fail(field, "is " + v.dump() + "; expected a string");
    return v.get<std::string>();
  }

 private:
  nlohmann::json json_;
  std::string file_;
  const ConfigReader& reader_;
};

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
       {"model.layers", "model.hidden", "model.heads", "model.kv_heads", "model.ffn",
        "model.rope_theta", "model.norm_eps", "model.tie_embeddings"}) {
    if (reader.given(key)) {
      reader.fail_at(key, "is set by model.from (" + m.from +
                              "/config.json); give it in one place: remove it here or drop "
                              "model.from");
    }
  }
  const std::string file = m.from + "/config.json";
  const std::string content = read_regular_file(file, "model.from", kMaxConfigJsonBytes);
  nlohmann::json json = nlohmann::json::parse(content, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    reader.fail_at("model.from", file + " is not a JSON object (a Hugging Face config.json)");
  }
  const HfConfig hf(std::move(json), file, reader);
  // What this llama does not model is an error naming the field, never silently another model.
  if (hf.has("model_type") && hf.text("model_type") != "llama") {
    hf.fail("model_type", "is '" + hf.text("model_type") + "'; expected llama");
  }
  if (hf.has("rope_scaling"))
    hf.fail("rope_scaling", "is set; only null (plain RoPE) is supported");
  for (const char* field : {"attention_bias", "mlp_bias"}) {
    if (hf.has(field) && hf.boolean(field)) {
      hf.fail(field, "is true; the llama's projections have no biases (expected false)");
    }
  }
  if (hf.has("hidden_act") && hf.text("hidden_act") != "silu") {
    hf.fail("hidden_act", "is '" + hf.text("hidden_act") + "'; only silu (SwiGLU) is supported");
  }
  if (hf.has("vocab_size") && hf.integer("vocab_size", 1) != models::kByteVocab) {
    hf.fail("vocab_size", "is " + std::to_string(hf.integer("vocab_size", 1)) +
                              "; the llama trains on bytes of text (data.path), expected " +
                              std::to_string(models::kByteVocab));
  }
  m.layers = hf.integer("num_hidden_layers", 1);
  m.hidden = hf.integer("hidden_size", 1);
  m.heads = hf.integer("num_attention_heads", 1);
  m.kv_heads = hf.has("num_key_value_heads") ? hf.integer("num_key_value_heads", 1) : m.heads;
  m.ffn = hf.integer("intermediate_size", 1);
  if (hf.has("head_dim") && hf.integer("head_dim", 1) * m.heads != m.hidden) {
    hf.fail("head_dim", "is " + std::to_string(hf.integer("head_dim", 1)) +
                            "; only hidden_size / num_attention_heads is supported");
  }
  m.rope_theta = hf.has("rope_theta") ? hf.number("rope_theta") : 10000.0;
  // transformers 5 writes the RoPE's parameters as an object: {"rope_theta", "rope_type"}.
  if (hf.has("rope_parameters")) {
    const HfConfig rope(hf.object("rope_parameters"), file + " rope_parameters", reader);
    if (rope.has("rope_type") && rope.text("rope_type") != "default") {
      rope.fail("rope_type",
                "is '" + rope.text("rope_type") + "'; only default (plain RoPE) is supported");
    }
    if (rope.has("rope_theta")) m.rope_theta = rope.number("rope_theta");
  }
  m.norm_eps = hf.has("rms_norm_eps") ? hf.number("rms_norm_eps") : 1e-6;  // LlamaConfig's
  m.tie_embeddings = hf.has("tie_word_embeddings") && hf.boolean("tie_word_embeddings");
  if (hf.has("max_position_embeddings")) {
    const int64_t max_positions = hf.integer("max_position_embeddings", 1);
    if (m.seq_len > max_positions) {
      if (reader.given("model.seq_len")) {
        reader.fail_at("model.seq_len", std::to_string(m.seq_len) +
                                            " is longer than max_position_embeddings " +
                                            std::to_string(max_positions) + " of " + file);
      }
      m.seq_len = max_positions;
    }
  }
  m.from.clear();
}

}  // namespace pipemat::train::config_detail
