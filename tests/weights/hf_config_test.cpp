// A Hugging Face Llama's config.json (pipemat/weights/hf_config.h): read as transformers'
// LlamaConfig reads it, each refusal naming its field, the writer's bytes read back, and
// transformers itself as the oracle of the values (hf_config_oracle.py).

#include "pipemat/weights/hf_config.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace pipemat::weights {
namespace {

namespace fs = std::filesystem;

const std::string kFile = "m/config.json";

// A llama config.json with the shape given and `extra` fields after it.
std::string config_with(const std::string& extra = "") {
  return R"({"model_type": "llama", "hidden_size": 48, "intermediate_size": 128,
             "num_hidden_layers": 3, "num_attention_heads": 6, "vocab_size": 256)" +
         (extra.empty() ? std::string() : ", " + extra) + "}";
}

// The WeightsError text of parsing `text`; "" when it parses.
std::string config_error_of(const std::string& text) {
  try {
    parse_llama_config(text, kFile);
  } catch (const WeightsError& e) {
    return e.what();
  }
  return "";
}

// As transformers 5 writes a LlamaConfig (keys sorted, RoPE in rope_parameters, "dtype").
const char* const kFull = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "dtype": "bfloat16",
  "eos_token_id": 2,
  "head_dim": 8,
  "hidden_act": "silu",
  "hidden_size": 48,
  "initializer_range": 0.02,
  "intermediate_size": 128,
  "max_position_embeddings": 64,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 6,
  "num_hidden_layers": 3,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "rope_theta": 500000.0,
    "rope_type": "default"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.25.0",
  "use_cache": true,
  "vocab_size": 256
})";

TEST(HfConfig, ReadsTheFieldsOfALlamaConfig) {
  const LlamaConfig c = parse_llama_config(kFull, kFile);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.hidden_size, 48);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.num_attention_heads, 6);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 64);
  EXPECT_TRUE(c.defaulted.empty());
}

TEST(HfConfig, AbsentFieldsTakeTransformersDefaultsAndSaySo) {
  const LlamaConfig c = parse_llama_config(
      R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4})",
      kFile);
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.defaulted,
            (std::vector<std::string>{"attention_bias", "mlp_bias", "hidden_act", "vocab_size",
                                      "num_key_value_heads", "head_dim", "max_position_embeddings",
                                      "rms_norm_eps", "tie_word_embeddings", "rope_theta"}));
  EXPECT_TRUE(c.is_default("vocab_size"));
  EXPECT_FALSE(c.is_default("hidden_size"));
  // null is "absent" exactly where transformers reads it so: num_key_value_heads, head_dim,
  // rope_parameters, rope_scaling, pad_token_id.
  const LlamaConfig n = parse_llama_config(
      config_with(R"("num_key_value_heads": null, "head_dim": null, "rope_parameters": null,
                     "rope_scaling": null, "pad_token_id": null)"),
      kFile);
  EXPECT_EQ(n.num_key_value_heads, 6);
  EXPECT_TRUE(n.is_default("num_key_value_heads"));
  EXPECT_TRUE(n.is_default("head_dim"));
  EXPECT_EQ(n.rope_theta, 10000.0);
}

TEST(HfConfig, RopeParametersOfTransformers5WinOverTheTopLevelRopeTheta) {
  EXPECT_EQ(parse_llama_config(config_with(R"("rope_theta": 5.0,
                                              "rope_parameters": {"rope_type": "default",
                                                                  "rope_theta": 7.0})"),
                               kFile)
                .rope_theta,
            7.0);
  const LlamaConfig top = parse_llama_config(
      config_with(R"("rope_theta": 5.0, "rope_parameters": {"rope_type": "default"})"), kFile);
  EXPECT_EQ(top.rope_theta, 5.0);
  EXPECT_FALSE(top.is_default("rope_theta"));
  const LlamaConfig inner =
      parse_llama_config(config_with(R"("rope_parameters": {"rope_theta": 9})"), kFile);
  EXPECT_EQ(inner.rope_theta, 9.0);
  EXPECT_FALSE(inner.is_default("rope_theta"));
}

TEST(HfConfig, TheFindingsOfIssue53AreErrorsNamingTheirCause) {
  const std::string at = kFile + ": field ";
  // No model_type, or another one.
  EXPECT_EQ(config_error_of(R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4})"),
            at + "'model_type' is missing; a Llama config.json says \"model_type\": \"llama\" "
                 "(without it the file does not say which model it describes)");
  EXPECT_EQ(config_error_of(R"({"model_type": null})"),
            at + "'model_type' is missing; a Llama config.json says \"model_type\": \"llama\" "
                 "(without it the file does not say which model it describes)");
  EXPECT_EQ(config_error_of(R"({"model_type": "mistral"})"),
            at + "'model_type' is 'mistral'; expected llama");
  EXPECT_EQ(config_error_of(R"({"model_type": 7})"), at + "'model_type' is 7; expected llama");
  // A key twice, at any depth.
  EXPECT_EQ(config_error_of(config_with(R"("hidden_size": 128)")),
            kFile + ": key 'hidden_size' appears twice in the top-level object");
  EXPECT_EQ(
      config_error_of(config_with(R"("rope_parameters": {"rope_theta": 1.0, "rope_theta": 2.0})")),
      kFile + ": key 'rope_theta' appears twice in the object at 'rope_parameters'");
  // Text that is not JSON says where and why.
  EXPECT_EQ(config_error_of(config_with(R"("rms_norm_eps": NaN)")),
            kFile +
                ": not valid JSON (parse error at line 2, column 99: syntax error while "
                "parsing value - invalid literal; last read: '\"rms_norm_eps\": N')");
  EXPECT_EQ(config_error_of(config_with(R"("rope_theta": 1e999)")),
            kFile +
                ": not valid JSON (parse error at line 2, column 101: number overflow parsing "
                "'1e999')");
  EXPECT_EQ(config_error_of("{\"model_type\": \"ll\xe9ma\"}"),
            kFile +
                ": not valid JSON (parse error at line 1, column 20: syntax error while "
                "parsing value - invalid string: ill-formed UTF-8 byte; last read: "
                "'\"ll\\xe9m')");
  EXPECT_EQ(config_error_of("[1, 2"),
            kFile +
                ": not valid JSON (parse error at line 1, column 6: syntax error while "
                "parsing array - unexpected end of input; expected ']')");
  EXPECT_EQ(config_error_of("[1, 2]"),
            kFile + " is a JSON array, not an object (a Hugging Face config.json)");
}

TEST(HfConfig, TheShapeIsRequiredAndEveryFieldChecked) {
  const std::string at = kFile + ": field ";
  EXPECT_EQ(config_error_of(R"({"model_type": "llama", "hidden_size": 32})"),
            at + "'num_hidden_layers' is missing; the model's shape comes from the file "
                 "(transformers' LlamaConfig would take 32, Llama-7B's, for it)");
  EXPECT_EQ(config_error_of(R"({"model_type": "llama", "num_hidden_layers": 2})"),
            at + "'hidden_size' is missing; the model's shape comes from the file "
                 "(transformers' LlamaConfig would take 4096, Llama-7B's, for it)");
  EXPECT_EQ(config_error_of(R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8,
                         "num_attention_heads": 2})"),
            at + "'intermediate_size' is missing; the model's shape comes from the file "
                 "(transformers' LlamaConfig would take 11008, Llama-7B's, for it)");
  struct Case {
    std::string field;
    std::string value;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"hidden_size", "\"48\"", "'hidden_size' is \"48\"; expected an integer >= 1"},
           {"hidden_size", "48.0", "'hidden_size' is 48.0; expected an integer >= 1"},
           {"hidden_size", "true", "'hidden_size' is true; expected an integer >= 1"},
           {"hidden_size", "null", "'hidden_size' is null; expected an integer >= 1"},
           {"hidden_size", "0", "'hidden_size' is 0; expected an integer >= 1"},
           {"hidden_size", "-48", "'hidden_size' is -48; expected an integer >= 1"},
           {"hidden_size", "50",
            "'hidden_size' is 50, not a multiple of num_attention_heads 6 (transformers' "
            "LlamaConfig refuses it too)"},
           {"num_hidden_layers", "18446744073709551615",
            "'num_hidden_layers' is 18446744073709551615, too large; expected an integer >= 1"},
           {"num_hidden_layers", "1e3", "'num_hidden_layers' is 1000.0; expected an integer >= 1"},
           {"vocab_size", "null",
            "'vocab_size' is null; expected an integer >= 1 (transformers' LlamaConfig refuses "
            "null here; leave the field out for its default)"},
           {"vocab_size", "[256]", "'vocab_size' is [256]; expected an integer >= 1"},
           {"num_key_value_heads", "4",
            "'num_key_value_heads' is 4, which does not divide num_attention_heads 6"},
           {"num_key_value_heads", "0", "'num_key_value_heads' is 0; expected an integer >= 1"},
           {"head_dim", "16",
            "'head_dim' is 16; only hidden_size / num_attention_heads (8) is "
            "supported"},
           {"max_position_embeddings", "null",
            "'max_position_embeddings' is null; expected an integer >= 1 (transformers' "
            "LlamaConfig refuses null here; leave the field out for its default)"},
           {"rms_norm_eps", "1",
            "'rms_norm_eps' is 1, an integer; transformers' LlamaConfig "
            "wants a float here (write it with a decimal point)"},
           {"rms_norm_eps", "-1e-5", "'rms_norm_eps' is -1e-05; expected a number > 0"},
           {"rms_norm_eps", "\"1e-5\"", "'rms_norm_eps' is \"1e-5\"; expected a number > 0"},
           {"rope_theta", "0.0", "'rope_theta' is 0.0; expected a number > 0"},
           {"rope_theta", "null",
            "'rope_theta' is null; expected a number > 0 (transformers' LlamaConfig refuses "
            "null here; leave the field out for its default)"},
           {"tie_word_embeddings", "0", "'tie_word_embeddings' is 0; expected true or false"},
           {"tie_word_embeddings", "null",
            "'tie_word_embeddings' is null; expected true or false (transformers' LlamaConfig "
            "refuses null here; leave the field out for its default)"},
           {"rope_scaling", R"({"type": "linear"})",
            "'rope_scaling' is set; only null (plain RoPE) is supported"},
           {"rope_parameters", R"({"rope_type": "llama3", "factor": 8.0})",
            "'rope_parameters.rope_type' is \"llama3\"; only \"default\" (plain RoPE) is "
            "supported"},
           {"rope_parameters", R"({"rope_type": null})",
            "'rope_parameters.rope_type' is null; only \"default\" (plain RoPE) is supported"},
           {"rope_parameters", R"({"rope_theta": null})",
            "'rope_parameters.rope_theta' is null; expected a number > 0"},
           {"rope_parameters", R"({"rope_theta": -2})",
            "'rope_parameters.rope_theta' is -2; expected a number > 0"},
           {"rope_parameters", "[]", "'rope_parameters' is []; expected an object"},
           {"attention_bias", "true",
            "'attention_bias' is true; the llama's projections have no biases (expected false)"},
           {"mlp_bias", "true",
            "'mlp_bias' is true; the llama's projections have no biases (expected false)"},
           {"mlp_bias", "1", "'mlp_bias' is 1; expected true or false"},
           {"hidden_act", "\"gelu\"", "'hidden_act' is 'gelu'; only silu (SwiGLU) is supported"},
           {"hidden_act", "null",
            "'hidden_act' is null; expected a string (transformers' LlamaConfig refuses null "
            "here; leave the field out for its default)"},
           {"attention_dropout", "0.1",
            "'attention_dropout' is 0.1; the llama has no attention dropout (transformers would "
            "drop attention weights in training), expected 0"},
           {"pad_token_id", "0",
            "'pad_token_id' is 0; the llama's embedding has no padding row (transformers zeroes "
            "that row and its gradient), expected null"},
       }) {
    // The field replaces config_with's own (a duplicate key would be refused first).
    nlohmann::json j = nlohmann::json::parse(config_with());
    j.erase(c.field);
    std::string text = j.dump();
    text.insert(1, "\"" + c.field + "\": " + c.value + ", ");
    EXPECT_EQ(config_error_of(text), at + c.message) << text;
  }
  // A long value is cut in the message.
  EXPECT_EQ(
      config_error_of(config_with("\"hidden_act\": \"" + std::string(100, 'x') + "\"")).size(),
      config_error_of(config_with("\"hidden_act\": \"x\"")).size() + 99);
  EXPECT_EQ(config_error_of(config_with("\"rms_norm_eps\": \"" + std::string(100, 'x') + "\"")),
            at + "'rms_norm_eps' is \"" + std::string(56, 'x') + "...; expected a number > 0");
}

TEST(HfConfig, TheWriterReadsBackEqualWithItsExactBytes) {
  LlamaConfig c;
  c.vocab_size = 256;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 16;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.tie_word_embeddings = true;
  const std::string text = write_llama_config(c);
  EXPECT_EQ(text, R"({
  "architectures": [
    "LlamaForCausalLM"
  ],
  "model_type": "llama",
  "hidden_size": 16,
  "intermediate_size": 32,
  "num_hidden_layers": 4,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 8,
  "rope_theta": 500000.0,
  "rope_parameters": {
    "rope_theta": 500000.0,
    "rope_type": "default"
  },
  "rms_norm_eps": 1e-05,
  "vocab_size": 256,
  "max_position_embeddings": 16,
  "tie_word_embeddings": true,
  "hidden_act": "silu",
  "attention_bias": false,
  "mlp_bias": false,
  "torch_dtype": "float32"
}
)");
  EXPECT_EQ(parse_llama_config(text, kFile), c);
  // Every double survives the trip bit for bit.
  for (const double eps : {1e-6, 1.0 / 3.0, 2.2250738585072014e-308, 0.1 + 0.2}) {
    c.rms_norm_eps = eps;
    c.rope_theta = 1.0 / eps;
    EXPECT_EQ(parse_llama_config(write_llama_config(c), kFile), c) << eps;
  }
  EXPECT_EQ(parse_llama_config(write_llama_config(LlamaConfig{}), kFile), LlamaConfig{});
}

// ---- transformers as the oracle ---------------------------------------------------------------

std::string file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(HfConfig, TransformersReadsTheSameValuesFromTheSameFiles) {
  const fs::path dir =
      fs::temp_directory_path() / ("pipemat_hf_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  // Files pipemat reads (transformers must read the same values) and files it refuses because
  // transformers refuses them too.
  const std::vector<std::string> read = {
      kFull,
      config_with(),
      R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4})",
      config_with(R"("num_key_value_heads": null, "head_dim": null, "rope_parameters": null,
                     "rope_scaling": null, "pad_token_id": null, "attention_dropout": 0)"),
      config_with(R"("rope_theta": 5.0, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 7.0})"),
      config_with(R"("rope_theta": 5.0, "rope_parameters": {"rope_type": "default"})"),
      config_with(R"("rope_parameters": {"rope_theta": 9})"),
      config_with(R"("rope_theta": 5.0, "rope_parameters": null)"),
      config_with(R"("rope_theta": 123, "num_key_value_heads": 3, "head_dim": 8)"),
      write_llama_config(parse_llama_config(kFull, kFile)),
  };
  const std::vector<std::string> refused = {
      config_with(R"("rms_norm_eps": 1)"),
      R"({"model_type": "llama", "hidden_size": 50, "intermediate_size": 128,
          "num_hidden_layers": 3, "num_attention_heads": 6, "vocab_size": 256})",
      config_with(R"("max_position_embeddings": null)"),
      config_with(R"("tie_word_embeddings": 0)"),
      config_with(R"("hidden_act": null)"),
  };
  std::string args;
  std::vector<std::string> dirs;
  for (size_t i = 0; i < read.size() + refused.size(); ++i) {
    const fs::path d = dir / std::to_string(i);
    fs::create_directories(d);
    std::ofstream(d / "config.json") << (i < read.size() ? read[i] : refused[i - read.size()]);
    dirs.push_back(d.string());
    args += " '" + d.string() + "'";
  }
  const fs::path log = dir / "oracle.out";
  const std::string command = std::string("'") + PIPEMAT_WEIGHTS_PYTHON + "' '" +
                              PIPEMAT_HF_CONFIG_ORACLE + "'" + args + " > '" + log.string() +
                              "' 2> '" + (dir / "oracle.err").string() + "'";
  const int status = std::system(command.c_str());
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const std::string out = file_text(log);
  if (rc == 3) {
    fs::remove_all(dir);
    GTEST_SKIP() << "transformers is not installed: " << out;
  }
  ASSERT_EQ(rc, 0) << out << file_text(dir / "oracle.err");
  const nlohmann::json oracle = nlohmann::json::parse(out.substr(out.rfind("\n{") + 1));
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string text = file_text(fs::path(dirs[i]) / "config.json");
    const nlohmann::json& hf = oracle.at(dirs[i]);
    if (i >= read.size()) {
      EXPECT_NE(config_error_of(text), "") << text;
      EXPECT_TRUE(hf.contains("error")) << text << "\ntransformers: " << hf.dump();
      continue;
    }
    const LlamaConfig c = parse_llama_config(text, kFile);
    ASSERT_FALSE(hf.contains("error")) << text << "\ntransformers: " << hf.dump();
    EXPECT_EQ(hf.at("vocab_size"), c.vocab_size) << text;
    EXPECT_EQ(hf.at("hidden_size"), c.hidden_size) << text;
    EXPECT_EQ(hf.at("intermediate_size"), c.intermediate_size) << text;
    EXPECT_EQ(hf.at("num_hidden_layers"), c.num_hidden_layers) << text;
    EXPECT_EQ(hf.at("num_attention_heads"), c.num_attention_heads) << text;
    EXPECT_EQ(hf.at("num_key_value_heads"), c.num_key_value_heads) << text;
    EXPECT_EQ(hf.at("head_dim"), c.head_dim()) << text;
    EXPECT_EQ(hf.at("max_position_embeddings"), c.max_position_embeddings) << text;
    EXPECT_EQ(hf.at("rms_norm_eps").get<double>(), c.rms_norm_eps) << text;
    EXPECT_EQ(hf.at("rope_theta").get<double>(), c.rope_theta) << text;
    EXPECT_EQ(hf.at("rope_type"), "default") << text;
    EXPECT_EQ(hf.at("tie_word_embeddings"), c.tie_word_embeddings) << text;
    EXPECT_EQ(hf.at("hidden_act"), "silu") << text;
    EXPECT_EQ(hf.at("attention_bias"), false) << text;
    EXPECT_EQ(hf.at("mlp_bias"), false) << text;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pipemat::weights
