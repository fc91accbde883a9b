// A Hugging Face Llama config.json: Note [Llama config.json] in pipemat/weights/hf_config.h.

#include "pipemat/weights/hf_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "pipemat/core/json.h"

namespace pipemat::weights {
namespace {

using Json = nlohmann::json;

// A value as a message shows it: its JSON, cut after 60 characters.
std::string shown(const Json& value) {
  std::string text = value.dump(-1, ' ', /*ensure_ascii=*/true);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

// The fields of one JSON object of the config (the top level or rope_parameters), each read as
// LlamaConfig reads it, failing with the field's name.
class Fields {
 public:
  Fields(const Json& object, std::string file, std::string prefix, LlamaConfig& config)
      : object_(object), file_(std::move(file)), prefix_(std::move(prefix)), config_(config) {}

  [[noreturn]] void fail(const std::string& field, const std::string& message) const {
    PIPEMAT_THROW(WeightsError, file_, ": field '", prefix_, field, "' ", message);
  }

  bool given(const std::string& field) const { return object_.contains(field); }
  bool null(const std::string& field) const { return given(field) && object_.at(field).is_null(); }
  const Json& at(const std::string& field) const { return object_.at(field); }

  // The field's value, or nullptr when it is absent (or null where `null_is_absent`): then the
  // field is noted as defaulted. A null where transformers refuses it is an error saying what
  // was expected.
  const Json* value(const std::string& field, bool null_is_absent, const char* expected) {
    if (!given(field) || (null_is_absent && null(field))) {
      config_.defaulted.push_back(prefix_ + field);
      return nullptr;
    }
    if (null(field)) {
      fail(field, std::string("is null; expected ") + expected +
                      " (transformers' LlamaConfig refuses null here; leave the field out for "
                      "its default)");
    }
    return &at(field);
  }

  // An integer >= 1 that fits int64.
  int64_t integer(const std::string& field, const Json& v) const {
    if (!v.is_number_integer()) fail(field, "is " + shown(v) + "; expected an integer >= 1");
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(field, "is " + shown(v) + ", too large; expected an integer >= 1");
    }
    const auto i = v.get<int64_t>();
    if (i < 1) fail(field, "is " + shown(v) + "; expected an integer >= 1");
    return i;
  }
  // The integer field, required: pipemat takes the model's shape from the file.
  int64_t required(const std::string& field, int64_t transformers_default) const {
    if (!given(field)) {
      fail(field,
           "is missing; the model's shape comes from the file (transformers' LlamaConfig "
           "would take " +
               std::to_string(transformers_default) + ", Llama-7B's, for it)");
    }
    if (null(field)) fail(field, "is null; expected an integer >= 1");
    return integer(field, at(field));
  }
  // A finite number > 0; `float_only`: an integer is refused, as LlamaConfig refuses it.
  double positive(const std::string& field, const Json& v, bool float_only) const {
    if (float_only && v.is_number_integer()) {
      fail(field, "is " + shown(v) +
                      ", an integer; transformers' LlamaConfig wants a float here (write it with "
                      "a decimal point)");
    }
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0) {
      fail(field, "is " + shown(v) + "; expected a number > 0");
    }
    return v.get<double>();
  }
  bool boolean(const std::string& field, const Json& v) const {
    if (!v.is_boolean()) fail(field, "is " + shown(v) + "; expected true or false");
    return v.get<bool>();
  }
  std::string text(const std::string& field, const Json& v) const {
    if (!v.is_string()) fail(field, "is " + shown(v) + "; expected a string");
    return v.get<std::string>();
  }

 private:
  const Json& object_;
  std::string file_;
  std::string prefix_;  // "" or "rope_parameters."
  LlamaConfig& config_;
};

// rope_parameters (transformers 5): its rope_theta wins over the top-level one.
void read_rope_parameters(const Json& top, const std::string& file, LlamaConfig& c) {
  Fields hf(top, file, "", c);
  if (!hf.given("rope_parameters") || hf.null("rope_parameters")) return;
  const Json& object = hf.at("rope_parameters");
  if (!object.is_object())
    hf.fail("rope_parameters", "is " + shown(object) + "; expected an object");
  Fields rope(object, file, "rope_parameters.", c);
  if (rope.given("rope_type")) {
    const Json& type = rope.at("rope_type");
    if (!type.is_string() || type.get<std::string>() != "default") {
      rope.fail("rope_type", "is " + shown(type) + "; only \"default\" (plain RoPE) is supported");
    }
  }
  if (rope.given("rope_theta")) {
    if (rope.null("rope_theta")) rope.fail("rope_theta", "is null; expected a number > 0");
    c.rope_theta = rope.positive("rope_theta", rope.at("rope_theta"), false);
    c.defaulted.erase(std::remove(c.defaulted.begin(), c.defaulted.end(), "rope_theta"),
                      c.defaulted.end());
  }
}

}  // namespace

bool LlamaConfig::is_default(std::string_view field) const {
  return std::find(defaulted.begin(), defaulted.end(), field) != defaulted.end();
}

LlamaConfig parse_llama_config(std::string_view text, const std::string& file) {
  Json top;
  try {
    top = parse_json(text);
  } catch (const JsonError& e) {
    if (e.kind() == JsonError::Kind::kSyntax) {
      PIPEMAT_THROW(WeightsError, file, ": not valid JSON (", e.what(), ")");
    }
    PIPEMAT_THROW(WeightsError, file, ": ", e.what());
  }
  PIPEMAT_CHECK(top.is_object(), WeightsError, file, " is a JSON ", top.type_name(),
                ", not an object (a Hugging Face config.json)");
  LlamaConfig c;
  Fields hf(top, file, "", c);
  // What the file is: a llama, nothing this llama does not model.
  if (!hf.given("model_type") || hf.null("model_type")) {
    hf.fail("model_type",
            "is missing; a Llama config.json says \"model_type\": \"llama\" (without it the file "
            "does not say which model it describes)");
  }
  if (!hf.at("model_type").is_string() || hf.at("model_type").get<std::string>() != "llama") {
    const Json& type = hf.at("model_type");
    hf.fail("model_type",
            "is " + (type.is_string() ? "'" + type.get<std::string>() + "'" : shown(type)) +
                "; expected llama");
  }
  if (hf.given("rope_scaling") && !hf.null("rope_scaling")) {
    hf.fail("rope_scaling", "is set; only null (plain RoPE) is supported");
  }
  for (const char* field : {"attention_bias", "mlp_bias"}) {
    const Json* v = hf.value(field, false, "true or false");
    if (v != nullptr && hf.boolean(field, *v)) {
      hf.fail(field, "is true; the llama's projections have no biases (expected false)");
    }
  }
  if (const Json* v = hf.value("hidden_act", false, "a string"); v != nullptr) {
    if (const std::string act = hf.text("hidden_act", *v); act != "silu") {
      hf.fail("hidden_act", "is '" + act + "'; only silu (SwiGLU) is supported");
    }
  }
  if (hf.given("attention_dropout")) {
    const Json& v = hf.at("attention_dropout");
    if (!v.is_number() || v.get<double>() != 0) {
      hf.fail("attention_dropout",
              "is " + shown(v) +
                  "; the llama has no attention dropout (transformers would drop attention "
                  "weights in training), expected 0");
    }
  }
  if (hf.given("pad_token_id") && !hf.null("pad_token_id")) {
    hf.fail("pad_token_id", "is " + shown(hf.at("pad_token_id")) +
                                "; the llama's embedding has no padding row (transformers zeroes "
                                "that row and its gradient), expected null");
  }

  // The shape.
  c.num_hidden_layers = hf.required("num_hidden_layers", 32);
  c.hidden_size = hf.required("hidden_size", 4096);
  c.num_attention_heads = hf.required("num_attention_heads", 32);
  c.intermediate_size = hf.required("intermediate_size", 11008);
  if (c.hidden_size % c.num_attention_heads != 0) {
    hf.fail("hidden_size", "is " + std::to_string(c.hidden_size) +
                               ", not a multiple of num_attention_heads " +
                               std::to_string(c.num_attention_heads) +
                               " (transformers' LlamaConfig refuses it too)");
  }
  if (const Json* v = hf.value("vocab_size", false, "an integer >= 1"); v != nullptr) {
    c.vocab_size = hf.integer("vocab_size", *v);
  }
  c.num_key_value_heads = c.num_attention_heads;
  if (const Json* v = hf.value("num_key_value_heads", true, ""); v != nullptr) {
    c.num_key_value_heads = hf.integer("num_key_value_heads", *v);
    if (c.num_attention_heads % c.num_key_value_heads != 0) {
      hf.fail("num_key_value_heads", "is " + std::to_string(c.num_key_value_heads) +
                                         ", which does not divide num_attention_heads " +
                                         std::to_string(c.num_attention_heads));
    }
  }
  if (const Json* v = hf.value("head_dim", true, ""); v != nullptr) {
    if (const int64_t head_dim = hf.integer("head_dim", *v); head_dim != c.head_dim()) {
      hf.fail("head_dim", "is " + std::to_string(head_dim) +
                              "; only hidden_size / num_attention_heads (" +
                              std::to_string(c.head_dim()) + ") is supported");
    }
  }
  if (const Json* v = hf.value("max_position_embeddings", false, "an integer >= 1"); v != nullptr) {
    c.max_position_embeddings = hf.integer("max_position_embeddings", *v);
  }
  if (const Json* v = hf.value("rms_norm_eps", false, "a number > 0"); v != nullptr) {
    c.rms_norm_eps = hf.positive("rms_norm_eps", *v, true);
  }
  if (const Json* v = hf.value("tie_word_embeddings", false, "true or false"); v != nullptr) {
    c.tie_word_embeddings = hf.boolean("tie_word_embeddings", *v);
  }
  // RoPE's base: rope_parameters.rope_theta (transformers 5), else the top-level rope_theta
  // (transformers 4), else 10000.
  if (const Json* v = hf.value("rope_theta", false, "a number > 0"); v != nullptr) {
    c.rope_theta = hf.positive("rope_theta", *v, false);
  }
  read_rope_parameters(top, file, c);
  return c;
}

std::string write_llama_config(const LlamaConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim();
  j["rope_theta"] = c.rope_theta;  // older transformers read it here, 5.x in rope_parameters
  j["rope_parameters"] = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

}  // namespace pipemat::weights
