// Note [Layer streams]: a layer's draws depend on the generator's seed and the layer's key only,
// so a stack split into stages reseeded alike draws what the whole stack draws, and checkpoint
// units of one layer, part of one or several replay the forward's masks.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

#include "pipemat/remat/remat.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

// dropout(x * w) and `inner` (dropout, then sin), drawn inside LayerStream(key).
struct KeyedLayerImpl : torch::nn::Module {
  explicit KeyedLayerImpl(int64_t key_) : key(key_) {
    w = register_parameter("w", at::linspace(0.5, 1.5, kHidden));
    inner = register_module(
        "inner", Counted([](const at::Tensor& x) { return at::dropout(x, 0.5, true).sin(); }));
  }
  at::Tensor forward(const at::Tensor& x) {
    LayerStream stream(key);
    return inner(at::dropout(x * w, 0.5, true));
  }
  at::Tensor w;
  Remat<Counted> inner{nullptr};
  int64_t key;
};
TORCH_MODULE(KeyedLayer);

// Layers [first, end) of a model, as a pipeline stage holds them. Paths: layers.<i> (one
// layer), layers.<i>.inner (part of one).
struct KeyedLayersImpl : torch::nn::Module {
  KeyedLayersImpl(int64_t first, int64_t end) {
    torch::nn::ModuleList list;
    for (int64_t k = first; k < end; ++k) list->push_back(KeyedLayer(k));
    layers = register_module("layers", list);
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : *layers) x = layer->as<KeyedLayer>()->forward(x);
    return x;
  }
  remat::ModuleList layers{nullptr};
};
TORCH_MODULE(KeyedLayers);

// A stage: its layers under "body" (a unit of several layers).
struct KeyedStageImpl : torch::nn::Module {
  KeyedStageImpl(int64_t first, int64_t end) {
    body = register_module("body", KeyedLayers(first, end));
  }
  at::Tensor forward(const at::Tensor& x) { return body(x); }
  Remat<KeyedLayers> body{nullptr};
};
TORCH_MODULE(KeyedStage);

at::Tensor input() { return at::randn({16, kHidden}, at::make_generator<at::CPUGeneratorImpl>(3)); }

TEST(LayerStreams, DrawsDependOnTheSeedAndTheKeyOnly) {
  ThreadGeneratorScope scope(7);
  const auto drawn = [](int64_t key) {
    LayerStream stream(key);
    return at::randn({8});
  };
  const at::Tensor two = drawn(2);
  at::randn({5});  // draws before a layer do not move its stream
  EXPECT_TRUE(at::equal(drawn(2), two));
  EXPECT_FALSE(at::equal(drawn(3), two));
  EXPECT_TRUE(
      at::equal(two, at::randn({8}, at::make_generator<at::CPUGeneratorImpl>(layer_seed(7, 2)))));
  // The scope leaves the generator where it found it.
  const at::Tensor next = at::randn({4});
  scope.generator().set_current_seed(7);
  at::randn({5});
  drawn(4);
  EXPECT_TRUE(at::equal(at::randn({4}), next));
  // Another seed, other draws for the same key.
  scope.generator().set_current_seed(8);
  EXPECT_FALSE(at::equal(drawn(2), two));
}

// Stages [0, 1) and [1, 4), each forward from the same reseed, give what [0, 4) gives.
TEST(LayerStreams, AStackSplitIntoStagesDrawsWhatTheWholeStackDraws) {
  KeyedStage whole(0, 4), first(0, 1), rest(1, 4);
  at::Tensor want, got;
  {
    ThreadGeneratorScope scope(11);
    want = whole(input());
  }
  {
    ThreadGeneratorScope scope(11);
    got = first(input());
  }
  {
    ThreadGeneratorScope scope(11);
    got = rest(got);
  }
  EXPECT_TRUE(at::equal(got, want));
  ThreadGeneratorScope scope(12);
  EXPECT_FALSE(at::equal(whole(input()), want));
}

// Forward from seed 5, then the generator moved on (a rank reseeds for its other stages before
// this backward), then backward: the replayed units draw the forward's masks whether a unit is
// several layers, one layer or part of one, and the gradients are those without remat.
TEST(LayerStreams, ReplayOfUnitsOfSeveralLayersOneOrPartOfOneDrawsTheForwardsMasks) {
  const auto grads = [](const std::vector<std::string>& checkpoint, int64_t* replays) {
    KeyedStage stage(0, 3);
    if (!checkpoint.empty()) {
      RematPolicy policy;
      policy.checkpoint = checkpoint;
      apply_policy(*stage, policy);
    }
    ThreadGeneratorScope scope(5);
    const at::Tensor x = input().requires_grad_(true);
    const at::Tensor out = stage(x);
    scope.generator().set_current_seed(99);
    at::randn({7});
    std::vector<at::Tensor> wrt{x};
    for (const auto& p : stage->parameters()) wrt.push_back(p);
    std::vector<at::Tensor> g = torch::autograd::grad({(out * out).sum()}, wrt);
    g.push_back(out.detach());
    *replays = 0;
    for (size_t i = 0; i < 3; ++i) {
      *replays += stage->body->layers.ptr(i)->as<KeyedLayerImpl>()->inner->calls - 1;
    }
    return g;
  };
  int64_t replays = 0;
  const std::vector<at::Tensor> want = grads({}, &replays);
  EXPECT_EQ(replays, 0);
  for (const std::string unit : {"body", "body.layers.*", "body.layers.*.inner"}) {
    SCOPED_TRACE(unit);
    const std::vector<at::Tensor> got = grads({unit}, &replays);
    EXPECT_EQ(replays, 3) << "every layer replayed";
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << i;
  }
}

}  // namespace
}  // namespace pipemat::remat::testing
