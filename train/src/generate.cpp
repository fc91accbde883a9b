#include "pipemat/train/generate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <sys/stat.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/data/tokenizer.h"
#include "pipemat/models/gpt.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/train/config.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/weights.h"

namespace pipemat::train {

bool is_checkpoint_dir(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {  // said missing by the reader it was meant for
    const std::string suffix = ".safetensors";
    return path.size() < suffix.size() ||
           path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0;
  }
  return S_ISDIR(st.st_mode) && (path_exists(path + "/manifest.json") ||
                                 (!path_exists(path + "/model.safetensors") &&
                                  !path_exists(path + "/model.safetensors.index.json")));
}

GenerateResult generate_text(const std::string& dir, const SampleOptions& options) {
  const bool checkpoint = is_checkpoint_dir(dir);
  pp::CheckpointManifest manifest;
  TrainConfig config;
  if (checkpoint) {
    manifest = pp::read_checkpoint_manifest(dir);
    PIPEMAT_CHECK(!manifest.metadata.empty(), ConfigError, "generate: ", dir,
                  " holds no run config in its manifest; sample from a checkpoint that "
                  "`pipemat train` wrote for a gpt or llama model");
    config = parse_config(manifest.metadata, dir + "/manifest.json (metadata)");
  } else {
    config = config_of_weights(dir);  // one whole model: one stage
    manifest.stages = 1;
    manifest.step = -1;
  }
  PIPEMAT_CHECK(models::is_text_model(config.model.kind), ConfigError, "generate: ", dir,
                checkpoint ? " is a checkpoint" : " holds the weights", " of model.kind ",
                to_string(config.model.kind), "; pipemat generate samples text from gpt and llama ",
                checkpoint ? "checkpoints" : "models", " only");
  // Every stage of the run in this process (make_model_weights builds them, reading no data).
  const ModelRun run = make_model_weights(config, manifest.stages);
  std::vector<pp::PipelineStage> stages;
  for (int s = 0; s < manifest.stages; ++s) stages.push_back(run.stage(s));
  const std::string model = run.summary;
  const int64_t seq_len = config.model.seq_len;
  std::vector<torch::nn::Module*> modules;
  for (const auto& stage : stages) {
    stage.module->eval();
    modules.push_back(stage.module.get());
  }
  if (checkpoint) {
    std::vector<const pp::PipelineStage*> named;
    for (const auto& stage : stages) named.push_back(&stage);
    pp::load_stage_weights(dir, named, config.training.allow_non_finite);
  } else {
    // One stage of every block: its names are the single-process model's.
    const WeightNameMap map = weight_name_map(config.model.kind);
    WeightShapes shapes;
    for (const auto& item : modules[0]->named_parameters()) {
      shapes[map(item.key())] = item.value().sizes().vec();
    }
    load_weights(
        dir, "generate", shapes, [](int, const std::string& name) { return name; },
        config.model.kind, {{0, modules[0]}}, config.training.allow_non_finite);
  }

  // Note [Text to tokens] (pipemat/data/tokenizer.h): with a tokenizer the prompt is its ids and
  // the output its decoded text; without one both are bytes.
  const std::string tokenizer_path =
      options.tokenizer.empty() ? config.data.tokenizer : options.tokenizer;
  std::unique_ptr<data::Tokenizer> tokenizer;
  if (!tokenizer_path.empty()) {
    try {
      tokenizer = data::load_tokenizer(tokenizer_path);
    } catch (const DataError& e) {
      PIPEMAT_THROW(ConfigError, "generate: the tokenizer ", tokenizer_path, ": ", e.what());
    }
    PIPEMAT_CHECK(tokenizer->vocab_size() <= config.model.vocab, ConfigError,
                  "generate: ", tokenizer->describe(), " has ", tokenizer->vocab_size(),
                  " ids but the model (", dir, ") has ", config.model.vocab,
                  "; give the model's own tokenizer");
  }
  const int64_t width = tokenizer ? tokenizer->vocab_size() : models::kByteVocab;
  c10::AutoGradMode no_grad(false);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<int64_t> context;
  if (tokenizer) {
    for (int32_t id : tokenizer->encode(options.prompt)) context.push_back(id);
    if (context.empty() && tokenizer->bos_id()) context.push_back(*tokenizer->bos_id());
    if (context.empty()) {
      for (int32_t id : tokenizer->encode("\n")) context.push_back(id);
    }
  } else {
    for (unsigned char c : options.prompt) context.push_back(c);
    if (context.empty()) context.push_back('\n');
  }
  GenerateResult result;
  result.step = manifest.step;
  result.model = model + ", seq_len " + std::to_string(seq_len);
  if (tokenizer) result.model += ", tokenizer " + tokenizer->describe();
  std::optional<data::StreamDecoder> decoder;
  if (tokenizer) decoder.emplace(*tokenizer);
  for (int64_t n = 0; n < options.tokens; ++n) {
    const auto size = static_cast<int64_t>(context.size());
    const int64_t take = std::min(size, seq_len);
    at::Tensor x = at::tensor(std::vector<int64_t>(context.end() - take, context.end()), at::kLong)
                       .unsqueeze(0);
    for (const auto& stage : stages) x = stage.forward({x}).at(0);
    // The ids the text can hold: the tokenizer's, or the 256 bytes (of model.vocab rows).
    at::Tensor logits = x[0][take - 1].slice(0, 0, width).to(at::kFloat);
    int64_t next = 0;
    if (options.greedy) {  // the most likely id
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / options.temperature;
      if (options.top_k > 0 && options.top_k < width) {
        const at::Tensor kth = std::get<0>(logits.topk(options.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      const at::Tensor probabilities = at::softmax(logits, -1);
      // Weights loaded with training.allow_non_finite may give NaN: a clear error, not torch's.
      PIPEMAT_CHECK(at::isfinite(probabilities).all().item<bool>(), ConfigError, "generate: ", dir,
                    ": the model's next-token probabilities after ", n,
                    " generated tokens are not finite; its weights hold NaN or infinite values "
                    "(they were loaded with training.allow_non_finite: true)");
      next = at::multinomial(probabilities, 1, false, gen).item<int64_t>();
    }
    context.push_back(next);
    result.ids.push_back(next);
    if (decoder) {
      result.text += decoder->push(static_cast<int32_t>(next));
    } else {
      result.text.push_back(static_cast<char>(next));
    }
  }
  if (decoder) result.text += decoder->finish();
  return result;
}

}  // namespace pipemat::train
