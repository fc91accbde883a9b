#include "pipemat/train/generate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/gpt.h"
#include "pipemat/models/llama.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/train/config.h"

namespace pipemat::train {

GenerateResult generate_text(const std::string& dir, const SampleOptions& options) {
  const pp::CheckpointManifest manifest = pp::read_checkpoint_manifest(dir);
  PIPEMAT_CHECK(!manifest.metadata.empty(), ConfigError, "generate: ", dir,
                " holds no run config in its manifest; sample from a checkpoint that "
                "`pipemat train` wrote for a gpt or llama model");
  const TrainConfig config = parse_config(manifest.metadata, dir + "/manifest.json (metadata)");
  PIPEMAT_CHECK(models::is_text_model(config.model.kind), ConfigError, "generate: ", dir,
                " is a checkpoint of model.kind ", to_string(config.model.kind),
                "; pipemat generate samples text from gpt and llama checkpoints only");
  // Every stage of the run in this process, each a module and its forward.
  std::vector<std::shared_ptr<torch::nn::Module>> stages;
  std::vector<std::function<at::Tensor(const at::Tensor&)>> forwards;
  std::string model;
  if (config.model.kind == models::ModelKind::kGpt) {
    const models::GptShape shape = models::gpt_shape(config.model);
    const models::GptParts parts = models::build_gpt(shape, config.training.seed);
    const std::vector<int64_t> bounds =
        models::partition_gpt(parts, config.partition, manifest.stages);
    for (int s = 0; s < manifest.stages; ++s) {
      models::GptStage stage(parts, bounds[s], bounds[s + 1], s == 0, s == manifest.stages - 1);
      stages.push_back(stage.ptr());
      forwards.emplace_back([stage](const at::Tensor& x) mutable { return stage->forward(x); });
    }
    model = std::to_string(shape.layers) + " blocks, hidden " + std::to_string(shape.hidden) +
            ", " + std::to_string(shape.heads) + " heads";
  } else {
    const models::LlamaShape shape = models::llama_shape(config.model);
    const models::LlamaParts parts = models::build_llama(shape, config.training.seed);
    const std::vector<int64_t> bounds =
        models::partition_llama(parts, config.partition, manifest.stages);
    for (int s = 0; s < manifest.stages; ++s) {
      models::LlamaStage stage(parts, bounds[s], bounds[s + 1], s == 0, s == manifest.stages - 1);
      stages.push_back(stage.ptr());
      forwards.emplace_back([stage](const at::Tensor& x) mutable { return stage->forward(x); });
    }
    model = "llama, " + std::to_string(shape.layers) + " blocks, hidden " +
            std::to_string(shape.hidden) + ", " + std::to_string(shape.heads) + " heads (" +
            std::to_string(shape.kv_heads) + " key/value)";
  }
  const int64_t seq_len = config.model.seq_len;
  std::vector<torch::nn::Module*> modules;
  for (const auto& stage : stages) {
    stage->eval();
    modules.push_back(stage.get());
  }
  pp::load_stage_weights(dir, modules);

  c10::AutoGradMode no_grad(false);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<int64_t> context;
  for (unsigned char c : options.prompt) context.push_back(c);
  if (context.empty()) context.push_back('\n');
  GenerateResult result;
  result.step = manifest.step;
  result.model = model + ", seq_len " + std::to_string(seq_len);
  for (int64_t n = 0; n < options.tokens; ++n) {
    const auto size = static_cast<int64_t>(context.size());
    const int64_t take = std::min(size, seq_len);
    at::Tensor x = at::tensor(std::vector<int64_t>(context.end() - take, context.end()), at::kLong)
                       .unsqueeze(0);
    for (auto& forward : forwards) x = forward(x);
    at::Tensor logits = x[0][take - 1] / options.temperature;
    if (options.top_k > 0 && options.top_k < models::kByteVocab) {
      const at::Tensor kth = std::get<0>(logits.topk(options.top_k)).min();
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    const int64_t next = at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>();
    context.push_back(next);
    result.text.push_back(static_cast<char>(next));
  }
  return result;
}

}  // namespace pipemat::train
