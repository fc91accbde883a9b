#include "scenario.h"

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"

namespace pipemat::models {

Scenario make_scenario(const BenchRematOptions& o) {
  Scenario s;
  if (o.scenario == "rmsnorm-gemm") {
    auto model = std::make_shared<RmsNormGemmStackImpl>(o.layers, o.hidden);
    s.module = model;
    s.forward = [model](const at::Tensor& x) { return model->forward(x); };
    s.save_body_calls = [model] {
      int64_t n = 0;
      for (auto& l : *model->layers) n += l->as<SiluBlock>().get()->gemm->calls;
      return n;
    };
    s.recompute_body_calls = [model] {
      int64_t n = 0;
      for (auto& l : *model->layers) n += l->as<SiluBlock>().get()->norm->calls;
      return n;
    };
    s.exclude = {{"layers.*.gemm", true}};
  } else if (o.scenario == "moe") {
    auto model = std::make_shared<MoEStackImpl>(o.layers, o.hidden, o.experts, o.top_k);
    s.module = model;
    s.forward = [model](const at::Tensor& x) { return model->forward(x); };
    s.save_body_calls = [model] {
      int64_t n = 0;
      for (auto& l : *model->layers) n += l->as<MoELayer>().get()->experts->calls;
      return n;
    };
    s.recompute_body_calls = [model] {
      int64_t n = 0;
      for (auto& l : *model->layers) n += l->as<MoELayer>().get()->norm->calls;
      return n;
    };
    s.exclude = {{"layers.*.experts", true}};
  } else if (o.scenario == "save-chain") {
    auto model = std::make_shared<SaveChainStackImpl>(o.layers);
    s.module = model;
    s.forward = [model](const at::Tensor& x) { return model->forward(x); };
    s.save_body_calls = [model] {
      int64_t n = 0;
      for (auto& l : *model->layers) {
        auto* c = l->as<SaveChain>().get();
        n += c->s1->calls + c->s2->calls + c->s3->calls + c->s4->calls;
      }
      return n;
    };
    s.recompute_body_calls = [model] {
      int64_t n = 0;
      for (auto& l : *model->layers) n += l->as<SaveChain>().get()->calls;
      return n;
    };
    // legacy: all four regions cache their output; rederive: the chain of SPEC 2.5.
    s.exclude_legacy = {{"layers.*.s*", true}};
    s.exclude = {{"layers.*.s1", false}, {"layers.*.s2", false}, {"layers.*.s3", false},
                 {"layers.*.s4", true}};
    s.legacy_disables_rederivation = false;
  } else {
    PIPEMAT_THROW(ConfigError, "bench remat: unknown --scenario '", o.scenario,
                  "'; allowed: rmsnorm-gemm, moe, save-chain");
  }
  return s;
}

}  // namespace pipemat::models
