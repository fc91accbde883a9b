// Declarative application: Sequential entries, AnyModule members, plain callables, path
// policies; several inputs, named inputs and tuple outputs.

#include <algorithm>

#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>

#include "pipemat/core/error.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

at::Tensor declared_input(int seed) {
  at::manual_seed(seed);
  return at::randn({4, kHidden});
}

// A Sequential with a concrete forward, so it can itself be an entry of a Sequential.
struct LayerImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  at::Tensor forward(at::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Layer);

// A model whose layers live in a Sequential; each layer is a Sequential of norm, gemm, act.
struct SeqModelImpl : torch::nn::Module {
  SeqModelImpl() {
    layers = register_module("layers", torch::nn::Sequential());
    for (int i = 0; i < 2; ++i) {
      Layer layer(Counted(rms_norm), Gemm(kHidden, kHidden),
                  Counted([](const at::Tensor& x) { return at::silu(x); }));
      layers->push_back(layer);
    }
  }
  at::Tensor forward(const at::Tensor& x) { return layers->forward(x); }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(SeqModel);

SeqModel make_seq_model() {
  at::manual_seed(9);
  return SeqModel();
}

TEST(Declare, PathPolicyOnSequentialMatchesNoCheckpointAndCountsBodies) {
  SeqModel plain = make_seq_model();
  SeqModel model = make_seq_model();
  RematPolicy policy;
  policy.checkpoint = {"layers.*"};
  policy.exclude = {{"layers.*.1", true}};
  PolicyResult applied = apply_policy(*model, policy);
  EXPECT_EQ(applied.checkpointed, (std::vector<std::string>{"layers.0", "layers.1"}));
  EXPECT_EQ(applied.excluded, (std::vector<std::string>{"layers.0.1", "layers.1.1"}));
  // Parameter names are unchanged by wrapping.
  EXPECT_EQ(model->named_parameters().keys(), plain->named_parameters().keys());

  Grads got = run_and_grad([&](const at::Tensor& x) { return model->forward(x); },
                           declared_input(1), model->parameters());
  Grads want = run_and_grad([&](const at::Tensor& x) { return plain->forward(x); },
                            declared_input(1), plain->parameters());
  expect_bitwise_equal(got, want);
  for (int i = 0; i < 2; ++i) {
    auto layer = model->layers[i]->as<LayerImpl>();
    EXPECT_EQ(layer->ptr(0)->as<CountedImpl>()->calls, 2) << "norm of layer " << i;
    EXPECT_EQ(layer->ptr(1)->as<GemmImpl>()->calls, 1) << "gemm of layer " << i;
    EXPECT_EQ(layer->ptr(2)->as<CountedImpl>()->calls, 2) << "act of layer " << i;
  }
}

TEST(Declare, PolicyErrorsNameThePath) {
  SeqModel model = make_seq_model();
  auto expect_error = [&](const RematPolicy& p, const std::string& text) {
    try {
      apply_policy(*model, p);
      FAIL() << "no error for " << text;
    } catch (const RematError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  RematPolicy unknown;
  unknown.checkpoint = {"layerz.*"};
  expect_error(unknown, "checkpoint path 'layerz.*' matches no module. Module paths are: layers");
  RematPolicy conflict;
  conflict.checkpoint = {"layers.0"};
  conflict.exclude = {{"layers.*", true}};
  expect_error(conflict,
               "module 'layers.0' is matched by checkpoint 'layers.0' and by exclude 'layers.*'");
  RematPolicy nested;
  nested.checkpoint = {"layers", "layers.0"};
  expect_error(nested, "checkpoint unit 'layers.0' is nested inside checkpoint unit 'layers'");
  RematPolicy save_output;
  save_output.exclude = {{"layers.0.1", true}, {"layers.*.1", false}};
  expect_error(save_output, "with a different save_output");
}

// A malformed glob is an error even for a policy that may leave patterns unmatched (today "["
// is a literal character to fnmatch, so it matched nothing and was skipped on every stage).
TEST(Declare, MalformedPatternIsAnErrorNamingIt) {
  EXPECT_EQ(pattern_problem("layers.[01].1"), "");
  EXPECT_EQ(pattern_problem("layers.[]].*"), "");  // a ']' first is a member of the set
  EXPECT_EQ(pattern_problem("layers.[[].x"), "");  // a literal '['
  EXPECT_EQ(pattern_problem("["),
            "component '[' opens a '[' set that it never closes (write '[[]' for a literal '[')");
  EXPECT_EQ(pattern_problem("layers.[!0"),
            "component '[!0' opens a '[' set that it never closes (write '[[]' for a literal '[')");
  EXPECT_EQ(pattern_problem("layers..1"),
            "it has an empty component (two dots, or a dot at an end)");
  SeqModel model = make_seq_model();
  RematPolicy bad;
  bad.checkpoint = {"["};
  bad.allow_unmatched = true;
  try {
    apply_policy(*model, bad);
    FAIL() << "no error for '['";
  } catch (const RematError& e) {
    EXPECT_EQ(std::string(e.what()),
              "remat policy: checkpoint path '[' is malformed: component '[' opens a '[' set that "
              "it never closes (write '[[]' for a literal '[')");
  }
}

// A pattern that matches nothing names the nearest module path; over several trees (the stages
// of a pipeline) a pattern is unmatched only when it matches on none.
TEST(Declare, UnmatchedPatternNamesTheNearestModulePath) {
  SeqModel model = make_seq_model();
  RematPolicy typo;
  typo.exclude = {{"layer.*.1", true}};
  try {
    apply_policy(*model, typo);
    FAIL() << "no error for a misspelt exclude path";
  } catch (const RematError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("exclude path 'layer.*.1' matches no module. Module paths are: layers, "),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("; the nearest to 'layer.*.1' is 'layers.0.1'"), std::string::npos) << what;
  }
  const std::vector<std::string> paths = module_paths(*model);
  EXPECT_EQ(paths.front(), "layers");
  EXPECT_NE(std::find(paths.begin(), paths.end(), "layers.1.2"), paths.end());
  RematPolicy policy;
  policy.checkpoint = {"head", "haed"};
  policy.exclude = {{"embed", true}, {"layers.*.up", true}};
  const std::vector<std::string> first{"embed", "layers.0", "layers.0.up"};
  const std::vector<std::string> last{"layers.1", "head"};
  std::vector<std::string> both = first;
  both.insert(both.end(), last.begin(), last.end());
  const auto unmatched = unmatched_patterns(policy, both);
  ASSERT_EQ(unmatched.size(), 1u);
  EXPECT_EQ(unmatched[0].list, "checkpoint");
  EXPECT_EQ(unmatched[0].index, 1u);
  EXPECT_EQ(unmatched[0].pattern, "haed");
  EXPECT_EQ(unmatched[0].nearest, "head");
  // On one stage alone, the other stage's modules are unmatched.
  EXPECT_EQ(unmatched_patterns(policy, first).size(), 2u);
  EXPECT_EQ(unmatched_patterns(policy, {}).front().nearest, "");
}

TEST(Declare, PolicyRefusesAModuleItsParentCallsDirectly) {
  struct DirectImpl : torch::nn::Module {
    DirectImpl() { gemm = register_module("gemm", Gemm(kHidden, kHidden)); }
    at::Tensor forward(const at::Tensor& x) { return gemm(x); }
    Gemm gemm{nullptr};  // a plain typed member: calls cannot be intercepted
  };
  auto model = std::make_shared<DirectImpl>();
  RematPolicy p;
  p.exclude = {{"gemm", true}};
  try {
    apply_policy(*model, p);
    FAIL() << "no error";
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("module 'gemm'"), std::string::npos) << what;
    EXPECT_NE(what.find("pipemat::remat::Remat<...>"), std::string::npos) << what;
  }
}

TEST(Declare, AnyModuleMemberWrappedInPlace) {
  struct AnyImpl : torch::nn::Module {
    AnyImpl() {
      norm = torch::nn::AnyModule(Counted(rms_norm));
      gemm = torch::nn::AnyModule(Gemm(kHidden, kHidden));
      register_module("norm", norm.ptr());
      register_module("gemm", gemm.ptr());
    }
    at::Tensor forward(const at::Tensor& x) { return gemm.forward(norm.forward(x)).sin(); }
    torch::nn::AnyModule norm, gemm;
  };
  at::manual_seed(4);
  auto plain = std::make_shared<AnyImpl>();
  at::manual_seed(4);
  Remat<torch::nn::ModuleHolder<AnyImpl>> unit = std::make_shared<AnyImpl>();
  unit = checkpoint_wrapper(unit);
  unit->gemm = checkpoint_exclude_wrapper(unit->gemm);
  Grads got = run_and_grad([&](const at::Tensor& x) { return unit(x); }, declared_input(2),
                           unit->parameters());
  Grads want = run_and_grad([&](const at::Tensor& x) { return plain->forward(x); },
                            declared_input(2), plain->parameters());
  expect_bitwise_equal(got, want);
  EXPECT_EQ(unit->gemm.ptr()->as<GemmImpl>()->calls, 1);
  EXPECT_EQ(unit->norm.ptr()->as<CountedImpl>()->calls, 2);
}

TEST(Declare, CallablesWithSeveralNamedInputsAndTupleOutputs) {
  at::manual_seed(6);
  auto w = at::randn({kHidden, kHidden}).requires_grad_(true);
  // A SAVE region taking (x, {"scale": s, "shift": b}) and returning a tuple.
  auto save_fn = [w](const at::Tensor& x, c10::Dict<std::string, at::Tensor> named) {
    auto y = at::matmul(x, w) * named.at("scale") + named.at("shift");
    return std::make_tuple(y, y.tanh());
  };
  auto body = [&](const at::Tensor& x, const auto& region) {
    auto h = x.sin();
    c10::Dict<std::string, at::Tensor> named;
    named.insert("scale", h.cos());
    named.insert("shift", h * 0.5);
    auto [a, b] = region(h, named);
    return (a * b).exp();
  };
  auto save = checkpoint_exclude_wrapper(save_fn, SaveRegionOptions{true, "tuple_region"});
  int save_calls = 0;
  auto counted_save = [&](const at::Tensor& h, c10::Dict<std::string, at::Tensor> n) {
    ++save_calls;
    return save(h, n);
  };
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return body(x, counted_save); },
                                 CheckpointOptions{});
  reset_counters();
  Grads got = run_and_grad([&](const at::Tensor& x) { return unit(x); }, declared_input(3), {w});
  Grads want =
      run_and_grad([&](const at::Tensor& x) { return body(x, save_fn); }, declared_input(3), {w});
  expect_bitwise_equal(got, want);
  EXPECT_EQ(save_calls, 2);             // the wrapper is entered in forward and in replay ...
  EXPECT_EQ(counters().save_calls, 1);  // ... its body runs once ...
  EXPECT_EQ(counters().save_skips, 1);  // ... and replay skips it
}

}  // namespace
}  // namespace pipemat::remat::testing

namespace pipemat::remat::testing {
namespace {

struct ListModelImpl : torch::nn::Module {
  ListModelImpl() {
    layers = register_module("layers", torch::nn::ModuleList(Block(kHidden), Block(kHidden)));
    heads = register_module("heads", torch::nn::ModuleDict());
    heads->update({{"out", Gemm(kHidden, kHidden).ptr()}});
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : *layers) x = layer->as<Block>()->forward(x);
    return heads["out"]->as<Gemm>()->forward(x);
  }
  ModuleList layers{nullptr};  // was torch::nn::ModuleList
  ModuleDict heads{nullptr};   // was torch::nn::ModuleDict
};
TORCH_MODULE(ListModel);

TEST(Declare, ModuleListAndModuleDictChildrenFollowThePolicy) {
  at::manual_seed(21);
  ListModel plain;
  at::manual_seed(21);
  ListModel model;
  RematPolicy policy;
  policy.checkpoint = {"layers.*"};
  policy.exclude = {{"layers.*.gemm", true}};
  apply_policy(*model, policy);
  Grads got = run_and_grad([&](const at::Tensor& x) { return model->forward(x); },
                           declared_input(8), model->parameters());
  Grads want = run_and_grad([&](const at::Tensor& x) { return plain->forward(x); },
                            declared_input(8), plain->parameters());
  expect_bitwise_equal(got, want);
  for (size_t i = 0; i < 2; ++i) {
    auto* block = model->layers[i]->as<Block>().get();
    EXPECT_EQ(block->pre->calls, 2);
    EXPECT_EQ(block->gemm->calls, 1);
  }
  try {
    model->layers[0]->as<Gemm>();
    FAIL() << "no error";
  } catch (const RematError& e) {
    EXPECT_NE(std::string(e.what()).find("is not of the requested type"), std::string::npos);
  }
  RematPolicy dict_policy;
  dict_policy.checkpoint = {"heads.out"};
  apply_policy(*model, dict_policy);
  reset_counters();
  run_and_grad([&](const at::Tensor& x) { return model->forward(x); }, declared_input(8),
               model->parameters());
  EXPECT_EQ(counters().unit_calls, 3);  // two layers + the head
}

}  // namespace
}  // namespace pipemat::remat::testing

namespace pipemat::remat::testing {
namespace {

TEST(Declare, PathPatternsMatchComponentWise) {
  EXPECT_TRUE(path_matches("layers.*", "layers.0"));
  EXPECT_FALSE(path_matches("layers.*", "layers.0.gemm"));
  EXPECT_TRUE(path_matches("layers.*.s*", "layers.3.s1"));
  EXPECT_FALSE(path_matches("layers.*.s*", "layers.3.gemm"));
  EXPECT_TRUE(path_matches("**.gemm", "encoder.layers.1.gemm"));
  EXPECT_TRUE(path_matches("**.gemm", "gemm"));
  EXPECT_TRUE(path_matches("layers.[01].gemm", "layers.1.gemm"));
  EXPECT_FALSE(path_matches("layers.[01].gemm", "layers.2.gemm"));
}

}  // namespace
}  // namespace pipemat::remat::testing
