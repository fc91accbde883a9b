#include "pipemat/train/model_run.h"
#include "pipemat/train/weights.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/parse.h"
#include "pipemat/models/gpt.h"
#include "pipemat/models/llama.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/remat/policy.h"
#include "pipemat/train/text_data.h"

namespace pipemat::train {
namespace {

// "<prefix>.<local>.rest" -> "<prefix>.<local + offset>.rest".
std::string renumber(const std::string& name, const std::string& prefix, int64_t offset) {
  if (name.compare(0, prefix.size() + 1, prefix + ".") != 0) return name;
  const auto first = prefix.size();
  const auto second = name.find('.', first + 1);
  int64_t local = 0;
  const std::string index = name.substr(first + 1, second - first - 1);
  PIPEMAT_INTERNAL_ASSERT(parse_int64(index, &local) == IntParse::kOk, "parameter '", name,
                          "' of '", prefix, "' has no layer index after its prefix");
  return prefix + "." + std::to_string(offset + local) +
         (second == std::string::npos ? "" : name.substr(second));
}

ModelRun zoo_run(const TrainConfig& config, int stages) {
  ModelRun run;
  run.stages = stages;
  auto layers = std::make_shared<std::vector<torch::nn::AnyModule>>(
      models::build_layers(config.model, config.training.seed));
  const auto bounds = std::make_shared<std::vector<int64_t>>(
      models::partition_layers(*layers, config.partition, stages));
  run.stage = [layers, bounds](int s) {
    PIPEMAT_INTERNAL_ASSERT(!layers->empty(), "stage ", s, " asked after release_unused");
    return pp::make_stage(
        s, models::Stage(std::vector<torch::nn::AnyModule>(layers->begin() + (*bounds)[s],
                                                           layers->begin() + (*bounds)[s + 1])));
  };
  run.release_unused = [layers] { std::vector<torch::nn::AnyModule>().swap(*layers); };
  run.loss = [](const pp::Tensors& out, const pp::Tensors& target) {
    return models::micro_batch_loss(out.at(0), target.at(0), 1);  // pp divides by the micro-batches
  };
  run.train_data = [model = config.model, seed = config.training.seed](int64_t step, int64_t mb) {
    auto [input, target] = models::micro_batch_data(model, seed, step, mb);
    return pp::MicroBatch{{input}, {target}};
  };
  run.policy = models::stage_policy(config.model, config.remat);
  run.global_name = [bounds](int s, const std::string& name) {
    return renumber(name, "layers", (*bounds)[s]);
  };
  run.tokens_per_micro_batch = tokens_per_micro_batch(config.model);
  run.summary = std::string(to_string(config.model.kind)) + ": " +
                std::to_string(config.model.layers) + " layers, hidden " +
                std::to_string(config.model.hidden) + ", synthetic data";
  return run;
}

// The data of a gpt or llama run: train windows of every (step, micro-batch), validation
// windows that do not depend on the step (every evaluation sees the same tokens), the loss over
// the next token, and the summary's data part.
std::string text_run(const TrainConfig& config, ModelRun& run) {
  const int64_t batch = config.model.batch, seq_len = config.model.seq_len;
  auto data =
      std::make_shared<TokenData>(load_token_data(config.data, config.model.vocab, seq_len + 1));
  run.loss = [](const pp::Tensors& out, const pp::Tensors& target) {
    return models::gpt_loss(out.at(0), target.at(0));
  };
  const uint64_t seed = config.training.seed;
  run.train_data = [data, batch, seq_len, seed](int64_t step, int64_t mb) {
    auto [ids, next] = token_windows(*data->train, batch, seq_len, seed, step, mb);
    return pp::MicroBatch{{ids}, {next}};
  };
  run.eval_data = [data, batch, seq_len, seed](int64_t, int64_t mb) {
    auto [ids, next] = token_windows(*data->validation, batch, seq_len, seed, -1, mb);
    return pp::MicroBatch{{ids}, {next}};
  };
  run.tokens_per_micro_batch = tokens_per_micro_batch(config.model);
  run.validation_tokens_per_byte = data->validation_tokens_per_byte;
  return data->summary;
}

int64_t parameter_count(const std::vector<const torch::nn::Module*>& modules) {
  int64_t params = 0;
  for (const torch::nn::Module* m : modules) {
    if (m == nullptr) continue;
    for (const auto& p : m->parameters()) params += p.numel();
  }
  return params;
}

// The gpt's stages and names; with `with_data`, its text data and loss too.
ModelRun gpt_run(const TrainConfig& config, int stages, bool with_data) {
  const models::GptShape shape = models::gpt_shape(config.model);
  ModelRun run;
  const std::string text = with_data ? "; " + text_run(config, run) : std::string();
  auto parts = std::make_shared<models::GptParts>(models::build_gpt(shape, config.training.seed));
  const auto bounds = std::make_shared<std::vector<int64_t>>(
      models::partition_gpt(*parts, config.partition, stages));
  run.stages = stages;
  run.stage = [parts, bounds, stages](int s) {
    PIPEMAT_INTERNAL_ASSERT(!parts->blocks.empty(), "stage ", s, " asked after release_unused");
    pp::PipelineStage stage = pp::make_stage(
        s, models::GptStage(*parts, (*bounds)[s], (*bounds)[s + 1], s == 0, s == stages - 1));
    stage.layer_streams = true;  // Note [Random streams of a step]: the blocks key their dropout
    return stage;
  };
  run.release_unused = [parts] { *parts = models::GptParts{}; };
  run.policy = models::stage_policy(config.model, config.remat);
  run.global_name = [bounds](int s, const std::string& name) {
    return renumber(name, "blocks", (*bounds)[s]);
  };
  run.random = shape.dropout > 0;
  std::vector<const torch::nn::Module*> modules{parts->embed.get(), parts->head.get()};
  for (const auto& b : parts->blocks) modules.push_back(b.get());
  run.summary = "gpt: " + std::to_string(shape.layers) + " blocks, hidden " +
                std::to_string(shape.hidden) + ", " + std::to_string(shape.heads) + " heads, " +
                format_count(parameter_count(modules)) + " parameters" + text;
  return run;
}

// The llama's stages and names; with `with_data`, its text data and loss too.
ModelRun llama_run(const TrainConfig& config, int stages, bool with_data) {
  const models::LlamaShape shape = models::llama_shape(config.model);
  ModelRun run;
  const std::string text = with_data ? "; " + text_run(config, run) : std::string();
  auto parts =
      std::make_shared<models::LlamaParts>(models::build_llama(shape, config.training.seed));
  const auto bounds = std::make_shared<std::vector<int64_t>>(
      models::partition_llama(*parts, config.partition, stages));
  run.stages = stages;
  run.stage = [parts, bounds, stages, tie = shape.tie_embeddings](int s) {
    PIPEMAT_INTERNAL_ASSERT(!parts->layers.empty(), "stage ", s, " asked after release_unused");
    pp::PipelineStage stage = pp::make_stage(
        s, models::LlamaStage(*parts, (*bounds)[s], (*bounds)[s + 1], s == 0, s == stages - 1));
    stage.tied = models::llama_tied(s, stages, tie);  // Note [Tied weights]
    return stage;
  };
  run.release_unused = [parts] { *parts = models::LlamaParts{}; };
  run.policy = models::stage_policy(config.model, config.remat);
  run.global_name = [bounds](int s, const std::string& name) {
    return renumber(name, "layers", (*bounds)[s]);
  };
  std::vector<const torch::nn::Module*> modules{parts->embed_tokens.get(), parts->norm.get()};
  if (parts->lm_head) modules.push_back(parts->lm_head.get());  // null when tied
  for (const auto& b : parts->layers) modules.push_back(b.get());
  run.summary = "llama: " + std::to_string(shape.layers) + " blocks, hidden " +
                std::to_string(shape.hidden) + ", " + std::to_string(shape.heads) + " heads (" +
                std::to_string(shape.kv_heads) + " key/value), ffn " + std::to_string(shape.ffn) +
                (shape.tie_embeddings ? ", tied embeddings, " : ", ") +
                format_count(parameter_count(modules)) + " parameters" + text;
  return run;
}

// The config key of entry `index` of `list` ("checkpoint", "exclude") of the policy of stage `s`
// (-1: the policy of every stage without one of its own).
std::string remat_key(const models::RematConfig& remat, int s, const std::string& list,
                      size_t index) {
  const std::string item =
      list + "[" + std::to_string(index) + "]" + (list == "exclude" ? ".path" : "");
  if (s >= 0) {
    const models::StageRemat& entry = remat.stages[static_cast<size_t>(s)];
    if (entry.own) return "remat.stages[" + std::to_string(s) + "]." + item;
    if (entry.policy != models::RematPolicyKind::kCustom) {
      return "remat.stages[" + std::to_string(s) + "] (policy " + to_string(entry.policy) + ")";
    }
  } else if (remat.policy != models::RematPolicyKind::kCustom) {
    return std::string("remat.policy (") + to_string(remat.policy) + ")";
  }
  return "remat." + item;
}

// The model is whole on every rank here: a remat pattern that matches on none of the stages it
// applies to is a ConfigError naming its key, before any rank starts (the pipeline checks the
// same over its ranks, naming PipelineOptions::remat).
void check_remat_patterns(const ModelRun& run, const models::RematConfig& remat) {
  std::vector<std::string> shared;  // the paths of the stages without a policy of their own
  int shared_stages = 0;
  const auto check = [&](const remat::RematPolicy& policy, const std::vector<std::string>& paths,
                         int s, const std::string& stages) {
    const auto unmatched = remat::unmatched_patterns(policy, paths);
    if (unmatched.empty()) return;
    const remat::UnmatchedPattern& u = unmatched.front();
    PIPEMAT_THROW(
        ConfigError, remat_key(remat, s, u.list, u.index), ": '", u.pattern,
        "' matches no module on ", stages, " (paths are relative to each stage's module)",
        u.nearest.empty() ? std::string() : "; the nearest module path is '" + u.nearest + "'",
        ". Fix the pattern or remove it");
  };
  for (int s = 0; s < run.stages; ++s) {
    const std::vector<std::string> paths = remat::module_paths(*run.stage(s).module);
    const auto own = run.stage_policies.find(s);
    if (own != run.stage_policies.end()) {
      check(own->second, paths, s, "stage " + std::to_string(s));
    } else {
      shared.insert(shared.end(), paths.begin(), paths.end());
      ++shared_stages;
    }
  }
  if (shared_stages > 0) {
    check(run.policy, shared, -1,
          "any of the model's " + std::to_string(shared_stages) + " stages");
  }
}

// Note [Global names] (pipemat/pp/pipeline.h): every stage names its tensors as `pipemat export`
// does (Note [Weight names] in pipemat/train/weights.h), so its checkpoints resume on any split.
void name_stages(ModelRun& run, models::ModelKind kind) {
  run.stage = [build = run.stage, global = run.global_name, map = weight_name_map(kind)](int s) {
    pp::PipelineStage stage = build(s);
    stage.global_name = [global, map, s](const std::string& name) { return map(global(s, name)); };
    return stage;
  };
}

}  // namespace

ModelRun make_model_run(const TrainConfig& config, int stages) {
  const std::vector<models::StageRemat>& per_stage = config.remat.stages;
  PIPEMAT_CHECK(
      per_stage.empty() || static_cast<int>(per_stage.size()) == stages, ConfigError,
      "remat.stages: ", per_stage.size(), " entries for ", stages,
      " model stages (schedule.ranks x chunks per rank); give one policy per stage, e.g. [",
      join(std::vector<std::string>(static_cast<size_t>(stages), "selective"), ", "), "]");
  ModelRun run = config.model.kind == models::ModelKind::kGpt     ? gpt_run(config, stages, true)
                 : config.model.kind == models::ModelKind::kLlama ? llama_run(config, stages, true)
                                                                  : zoo_run(config, stages);
  for (int s = 0; s < static_cast<int>(per_stage.size()); ++s) {
    const models::StageRemat& entry = per_stage[static_cast<size_t>(s)];
    models::RematConfig one = config.remat;
    one.policy = entry.policy;
    if (entry.own) one.custom = entry.lists;  // the stage's own lists, not remat.checkpoint's
    run.stage_policies[s] = models::stage_policy(config.model, one);
  }
  check_remat_patterns(run, config.remat);
  name_stages(run, config.model.kind);
  return run;
}

ModelRun make_model_weights(const TrainConfig& config, int stages) {
  ModelRun run = config.model.kind == models::ModelKind::kGpt     ? gpt_run(config, stages, false)
                 : config.model.kind == models::ModelKind::kLlama ? llama_run(config, stages, false)
                                                                  : zoo_run(config, stages);
  name_stages(run, config.model.kind);
  return run;
}

int64_t tokens_per_micro_batch(const models::ModelOptions& model) {
  return models::is_text_model(model.kind) ? model.batch * model.seq_len : model.tokens;
}

double lr_at(const TrainingOptions& t, int64_t step) {
  if (step < t.warmup) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup);
  if (t.lr_decay != LrDecay::kCosine) return t.lr;
  const int64_t span = t.steps - 1 - t.warmup;
  const double progress =
      span <= 0 ? 1.0
                : std::min(1.0, static_cast<double>(step - t.warmup) / static_cast<double>(span));
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace pipemat::train
