#include "pipemat/models/zoo_stages.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"
#include "pipemat/pp/pipeline.h"

namespace pipemat::models {

std::vector<torch::nn::AnyModule> build_layers(const ModelOptions& m, uint64_t seed) {
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  at::manual_seed(seed);
  const int64_t ffn = m.ffn > 0 ? m.ffn : 4 * m.hidden;
  std::vector<torch::nn::AnyModule> layers;
  for (int64_t i = 0; i < m.layers; ++i) {
    if (m.kind == ModelKind::kRmsNormGemm) {
      layers.emplace_back(models::SiluBlock(m.hidden));
    } else if (m.kind == ModelKind::kMlp) {
      layers.emplace_back(models::MlpBlock(m.hidden, ffn));
    } else if (m.kind == ModelKind::kTransformer) {
      PIPEMAT_CHECK(m.heads > 0 && m.hidden % m.heads == 0, ConfigError, "model.heads: ", m.heads,
                    " does not divide model.hidden ", m.hidden);
      layers.emplace_back(models::TransformerBlock(m.hidden, m.heads, ffn));
    } else if (m.kind == ModelKind::kMoe) {
      layers.emplace_back(models::MoELayer(m.hidden, m.experts, m.top_k));
    } else if (m.kind == ModelKind::kSaveChain) {
      // A small scale keeps the squaring chain bounded over many layers and steps.
      layers.emplace_back(models::SaveChain(0.25));
    } else {
      PIPEMAT_THROW(ConfigError, "model.kind: '", to_string(m.kind),
                    "' is not allowed; allowed: mlp, rmsnorm-gemm, transformer, moe, save-chain");
    }
  }
  return layers;
}

std::vector<int64_t> partition_layers(const std::vector<torch::nn::AnyModule>& layers,
                                      const PartitionOptions& partition, int stages) {
  std::vector<double> sizes;
  for (const auto& l : layers) {
    double p = 0;
    for (const auto& t : l.ptr()->parameters()) p += static_cast<double>(t.numel());
    sizes.push_back(p);
  }
  return partition_sizes(sizes, partition, stages);
}

std::vector<int64_t> partition_sizes(const std::vector<double>& sizes,
                                     const PartitionOptions& partition, int stages) {
  const auto n = static_cast<int64_t>(sizes.size());
  PIPEMAT_CHECK(n >= stages, ConfigError, "the model has ", n, " layers but the schedule has ",
                stages,
                " stages; every stage needs at least one layer (raise model.layers or "
                "lower schedule.ranks / schedule.virtual_stages)");
  PIPEMAT_CHECK(!partition.by_cost || stages == 1, ConfigError,
                "partition.layers_per_stage auto: the split is chosen by pipemat train and pipemat "
                "plan (train::choose_cost_split); give the layer counts to build stages here");
  std::vector<int64_t> bounds{0};
  if (!partition.layers_per_stage.empty()) {
    PIPEMAT_CHECK(static_cast<int>(partition.layers_per_stage.size()) == stages, ConfigError,
                  "partition.layers_per_stage has ", partition.layers_per_stage.size(),
                  " entries but the schedule has ", stages, " stages");
    for (size_t i = 0; i < partition.layers_per_stage.size(); ++i) {
      // Each entry within what is left: the running sum never overflows, whatever the entries.
      const int64_t c = partition.layers_per_stage[i];
      PIPEMAT_CHECK(c >= 1 && c <= n - bounds.back(), ConfigError, "partition.layers_per_stage[", i,
                    "] is ", c, "; expected 1 to ", n - bounds.back(),
                    " (every stage holds at least one of the model's ", n,
                    " layers, and the entries sum to model.layers)");
      bounds.push_back(bounds.back() + c);
    }
    PIPEMAT_CHECK(bounds.back() == n, ConfigError, "partition.layers_per_stage sums to ",
                  bounds.back(), " but model.layers is ", n);
    return bounds;
  }
  return pp::balance_by_size(sizes, stages);
}

StageImpl::StageImpl(const std::vector<torch::nn::AnyModule>& stage_layers) {
  torch::nn::Sequential seq;
  for (const auto& l : stage_layers) seq->push_back(l);
  layers = register_module("layers", seq);
}

at::Tensor StageImpl::forward(const at::Tensor& x) { return layers->forward(x); }

remat::RematPolicy stage_policy(const ModelOptions& model, const RematConfig& config) {
  remat::RematPolicy p;
  p.checkpoint_options.early_stop = config.early_stop;
  if (config.policy == RematPolicyKind::kNone) return p;
  if (config.policy == RematPolicyKind::kCustom) {
    p = config.custom;
    p.checkpoint_options.early_stop = config.early_stop;
    return p;
  }
  // gpt stages hold their blocks as "blocks.*" (gpt.h), llama's and the zoo's as "layers.*".
  const std::string units = model.kind == ModelKind::kGpt ? "blocks" : "layers";
  p.checkpoint = {units + ".*"};
  if (config.policy == RematPolicyKind::kFull) return p;
  PIPEMAT_CHECK(config.policy == RematPolicyKind::kSelective, ConfigError, "remat.policy: '",
                to_string(config.policy),
                "' is not allowed; allowed: none, full, selective, custom");
  if (model.kind == ModelKind::kGpt) {
    p.exclude = {{"blocks.*.attn.qkv", true}, {"blocks.*.mlp.up", true}};
  } else if (model.kind == ModelKind::kLlama) {
    // The five GEMMs that read a normalized input: the norms' outputs are rederived, not kept.
    p.exclude = {{"layers.*.self_attn.q_proj", true},
                 {"layers.*.self_attn.k_proj", true},
                 {"layers.*.self_attn.v_proj", true},
                 {"layers.*.mlp.gate_proj", true},
                 {"layers.*.mlp.up_proj", true}};
  } else if (model.kind == ModelKind::kRmsNormGemm) {
    p.exclude = {{"layers.*.gemm", true}};
  } else if (model.kind == ModelKind::kMlp) {
    p.exclude = {{"layers.*.up", true}};
  } else if (model.kind == ModelKind::kTransformer) {
    p.exclude = {{"layers.*.attn.qkv", true}, {"layers.*.mlp.up", true}};
  } else if (model.kind == ModelKind::kMoe) {
    p.exclude = {{"layers.*.experts", true}};
  } else if (model.kind == ModelKind::kSaveChain) {
    p.exclude = {{"layers.*.s1", false},
                 {"layers.*.s2", false},
                 {"layers.*.s3", false},
                 {"layers.*.s4", true}};
  }
  return p;
}

std::pair<at::Tensor, at::Tensor> micro_batch_data(const ModelOptions& m, uint64_t seed,
                                                   int64_t step, int64_t micro_batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL +
                                                      static_cast<uint64_t>(step) * 4099ULL +
                                                      static_cast<uint64_t>(micro_batch) + 17ULL);
  auto input = at::randn({m.tokens, m.hidden}, gen);
  auto target = at::randn({m.tokens, m.hidden}, gen);
  return {input, target};
}

at::Tensor micro_batch_loss(const at::Tensor& output, const at::Tensor& target,
                            int64_t micro_batches) {
  return (output - target).pow(2).mean() / static_cast<double>(micro_batches);
}

}  // namespace pipemat::models
