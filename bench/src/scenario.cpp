#include "scenario.h"

#include "pipemat/core/error.h"
#include "pipemat/models/gpt.h"
#include "pipemat/models/zoo.h"

namespace pipemat::bench {

namespace {

// The main job's decoder blocks as a stack (paths layers.<i>...): [tokens, hidden] rows are
// read as sequences of kSeqLen tokens.
constexpr int64_t kSeqLen = 128;
struct GptStackImpl : torch::nn::Module {
  explicit GptStackImpl(const models::GptShape& shape) {
    torch::nn::ModuleList list;
    for (int64_t i = 0; i < shape.layers; ++i) list->push_back(models::GptBlock(shape));
    layers = register_module("layers", list);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x.view({-1, kSeqLen, x.size(1)});
    for (auto& layer : *layers) h = layer->as<models::GptBlock>()->forward(h);
    return h.reshape({x.size(0), x.size(1)});
  }
  remat::ModuleList layers{nullptr};
};

// A stack of RMSNorm + GEMM blocks whose GEMMs are saved.
Scenario rmsnorm_gemm_scenario(const BenchRematOptions& o) {
  Scenario s;
  auto model = std::make_shared<models::RmsNormGemmStackImpl>(o.layers, o.hidden);
  s.module = model;
  s.forward = [model](const at::Tensor& x) { return model->forward(x); };
  s.save_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) n += l->as<models::SiluBlock>().get()->gemm->calls;
    return n;
  };
  s.recompute_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) n += l->as<models::SiluBlock>().get()->norm->calls;
    return n;
  };
  s.exclude = {{"layers.*.gemm", true}};
  return s;
}

// A stack of MoE layers whose experts are saved.
Scenario moe_scenario(const BenchRematOptions& o) {
  Scenario s;
  auto model = std::make_shared<models::MoEStackImpl>(o.layers, o.hidden, o.experts, o.top_k);
  s.module = model;
  s.forward = [model](const at::Tensor& x) { return model->forward(x); };
  s.save_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) n += l->as<models::MoELayer>().get()->experts->calls;
    return n;
  };
  s.recompute_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) n += l->as<models::MoELayer>().get()->norm->calls;
    return n;
  };
  s.exclude = {{"layers.*.experts", true}};
  return s;
}

// A stack of four-region save chains, legacy and rederived.
Scenario save_chain_scenario(const BenchRematOptions& o) {
  Scenario s;
  auto model = std::make_shared<models::SaveChainStackImpl>(o.layers);
  s.module = model;
  s.forward = [model](const at::Tensor& x) { return model->forward(x); };
  s.save_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) {
      auto* c = l->as<models::SaveChain>().get();
      n += c->s1->calls + c->s2->calls + c->s3->calls + c->s4->calls;
    }
    return n;
  };
  s.recompute_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) n += l->as<models::SaveChain>().get()->calls;
    return n;
  };
  // legacy: all four regions cache their output; rederive: the chain of docs/remat.md.
  s.exclude_legacy = {{"layers.*.s*", true}};
  s.exclude = {{"layers.*.s1", false},
               {"layers.*.s2", false},
               {"layers.*.s3", false},
               {"layers.*.s4", true}};
  s.legacy_disables_rederivation = false;
  return s;
}

// The main job's decoder blocks, with the QKV and MLP-up projections saved.
Scenario gpt_scenario(const BenchRematOptions& o) {
  PIPEMAT_CHECK(o.tokens % kSeqLen == 0 && o.hidden % 4 == 0, ConfigError,
                "bench remat: --scenario gpt reads --tokens as sequences of ", kSeqLen,
                " and has 4 heads; need --tokens a multiple of ", kSeqLen,
                " and --hidden a multiple of 4, got ", o.tokens, " and ", o.hidden);
  models::GptShape shape;
  shape.layers = o.layers;
  shape.hidden = o.hidden;
  shape.heads = 4;
  shape.ffn = 4 * o.hidden;
  shape.seq_len = kSeqLen;
  Scenario s;
  auto model = std::make_shared<GptStackImpl>(shape);
  s.module = model;
  s.forward = [model](const at::Tensor& x) { return model->forward(x); };
  s.save_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) {
      auto* block = l->as<models::GptBlock>().get();
      n += block->attn->qkv->calls + block->mlp->up->calls;
    }
    return n;
  };
  s.recompute_body_calls = [model] {
    int64_t n = 0;
    for (auto& l : *model->layers) n += l->as<models::GptBlock>().get()->calls;
    return n;
  };
  s.exclude = {{"layers.*.attn.qkv", true}, {"layers.*.mlp.up", true}};
  return s;
}

}  // namespace

Scenario make_scenario(const BenchRematOptions& o) {
  if (o.scenario == "rmsnorm-gemm") return rmsnorm_gemm_scenario(o);
  if (o.scenario == "moe") return moe_scenario(o);
  if (o.scenario == "save-chain") return save_chain_scenario(o);
  if (o.scenario == "gpt") return gpt_scenario(o);
  PIPEMAT_THROW(ConfigError, "bench remat: unknown --scenario '", o.scenario,
                "'; allowed: rmsnorm-gemm, moe, save-chain, gpt");
}

}  // namespace pipemat::bench
