#include "pipemat/train/generate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/gpt.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/train/config.h"

namespace pipemat::train {

GenerateResult generate_text(const std::string& dir, const SampleOptions& options) {
  const pp::CheckpointManifest manifest = pp::read_checkpoint_manifest(dir);
  PIPEMAT_CHECK(!manifest.metadata.empty(), ConfigError, "generate: ", dir,
                " holds no run config in its manifest; sample from a checkpoint that "
                "`pipemat train` wrote for a gpt model");
  const TrainConfig config = parse_config(manifest.metadata, dir + "/manifest.json (metadata)");
  PIPEMAT_CHECK(config.model.kind == models::ModelKind::kGpt, ConfigError, "generate: ", dir,
                " is a checkpoint of model.kind ", to_string(config.model.kind),
                "; pipemat generate samples text from gpt checkpoints only");
  const models::GptShape shape = models::gpt_shape(config.model);
  const models::GptParts parts = models::build_gpt(shape, config.training.seed);
  const std::vector<int64_t> bounds =
      models::partition_gpt(parts, config.partition, manifest.stages);
  std::vector<models::GptStage> stages;
  std::vector<torch::nn::Module*> modules;
  for (int s = 0; s < manifest.stages; ++s) {
    stages.emplace_back(parts, bounds[s], bounds[s + 1], s == 0, s == manifest.stages - 1);
    stages.back()->eval();
    modules.push_back(stages.back().ptr().get());
  }
  pp::load_stage_weights(dir, modules);

  c10::AutoGradMode no_grad(false);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<int64_t> context;
  for (unsigned char c : options.prompt) context.push_back(c);
  if (context.empty()) context.push_back('\n');
  GenerateResult result;
  result.step = manifest.step;
  result.model = std::to_string(shape.layers) + " blocks, hidden " + std::to_string(shape.hidden) +
                 ", " + std::to_string(shape.heads) + " heads, seq_len " +
                 std::to_string(shape.seq_len);
  for (int64_t n = 0; n < options.tokens; ++n) {
    const auto size = static_cast<int64_t>(context.size());
    const int64_t take = std::min(size, shape.seq_len);
    at::Tensor x = at::tensor(std::vector<int64_t>(context.end() - take, context.end()), at::kLong)
                       .unsqueeze(0);
    for (auto& stage : stages) x = stage->forward(x);
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
