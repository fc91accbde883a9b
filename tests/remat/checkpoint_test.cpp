// Checkpoint units and SAVE regions: values, gradients and execution counts against the
// no-checkpoint run.

#include <gtest/gtest.h>

#include "pipemat/core/error.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(int64_t hidden) {
    b1 = register_module("b1", Block(hidden));
    b2 = register_module("b2", Block(hidden));
  }
  at::Tensor forward(const at::Tensor& x) { return b2(b1(x)); }
  Remat<Block> b1{nullptr};
  Remat<Block> b2{nullptr};
};
TORCH_MODULE(Model);

Model make_model() {
  at::manual_seed(7);
  return Model(kHidden);
}

at::Tensor make_input(int seed = 11) {
  at::manual_seed(seed);
  return at::randn({4, kHidden});
}

Grads reference(int seed = 11) {
  Model m = make_model();
  return run_and_grad([&](const at::Tensor& x) { return m->forward(x); }, make_input(seed),
                      m->parameters());
}

enum class Save { kNone, kStart, kMiddle, kEnd, kAll };

Model make_checkpointed(Save where, bool two_units) {
  Model m = make_model();
  m->b1 = checkpoint_wrapper(m->b1);
  if (two_units) m->b2 = checkpoint_wrapper(m->b2);
  for (auto* b : {&m->b1, &m->b2}) {
    auto& blk = **b;
    if (where == Save::kStart || where == Save::kAll) blk.pre = checkpoint_exclude_wrapper(blk.pre);
    if (where == Save::kMiddle || where == Save::kAll)
      blk.gemm = checkpoint_exclude_wrapper(blk.gemm);
    if (where == Save::kEnd || where == Save::kAll) blk.post = checkpoint_exclude_wrapper(blk.post);
  }
  return m;
}

class CheckpointEquality : public ::testing::TestWithParam<std::tuple<Save, bool>> {};

TEST_P(CheckpointEquality, ValueAndEveryGradientBitwiseEqualToNoCheckpoint) {
  auto [where, two_units] = GetParam();
  Model m = make_checkpointed(where, two_units);
  Grads got = run_and_grad([&](const at::Tensor& x) { return m->forward(x); }, make_input(),
                           m->parameters());
  expect_bitwise_equal(got, reference());
}

INSTANTIATE_TEST_SUITE_P(AllPlacements, CheckpointEquality,
                         ::testing::Combine(::testing::Values(Save::kNone, Save::kStart,
                                                              Save::kMiddle, Save::kEnd,
                                                              Save::kAll),
                                            ::testing::Bool()));

TEST(Checkpoint, TwoTrainingStepsWithDifferentInputs) {
  Model m = make_checkpointed(Save::kMiddle, true);
  Model ref = make_model();
  for (int step = 0; step < 2; ++step) {
    Grads got = run_and_grad([&](const at::Tensor& x) { return m->forward(x); },
                             make_input(100 + step), m->parameters());
    Grads want = run_and_grad([&](const at::Tensor& x) { return ref->forward(x); },
                              make_input(100 + step), ref->parameters());
    expect_bitwise_equal(got, want);
    // An SGD step on both, so step 2 runs with different weights.
    at::NoGradGuard no_grad;
    auto pm = m->parameters();
    auto pr = ref->parameters();
    for (size_t i = 0; i < pm.size(); ++i) {
      pm[i].sub_(got.dparams[i] * 0.1);
      pr[i].sub_(want.dparams[i] * 0.1);
    }
  }
}

TEST(Checkpoint, RecomputeBodiesRunTwiceSaveBodiesOnce) {
  Model m = make_checkpointed(Save::kMiddle, false);
  // post (silu) saves its input, so replay runs to the end of the unit.
  run_and_grad([&](const at::Tensor& x) { return m->forward(x); }, make_input(), m->parameters());
  auto& b1 = *m->b1;
  EXPECT_EQ(b1.pre->calls, 2);
  EXPECT_EQ(b1.gemm->calls, 1);
  EXPECT_EQ(b1.post->calls, 2);
  auto& b2 = *m->b2;  // not checkpointed
  EXPECT_EQ(b2.pre->calls, 1);
  EXPECT_EQ(b2.gemm->calls, 1);
  EXPECT_EQ(b2.post->calls, 1);
}

// A unit whose tail saves nothing: pre (saves) -> gemm (SAVE) -> tail (x + 1, saves nothing).
struct TailImpl : torch::nn::Module {
  TailImpl() {
    pre = register_module("pre", Counted([](const at::Tensor& x) { return x.sin(); }));
    gemm = register_module("gemm", Gemm(kHidden, kHidden));
    tail = register_module("tail", Counted([](const at::Tensor& x) { return x + 1.0; }));
  }
  at::Tensor forward(const at::Tensor& x) { return tail(gemm(pre(x))); }
  Remat<Counted> pre{nullptr};
  Remat<Gemm> gemm{nullptr};
  Remat<Counted> tail{nullptr};
};
TORCH_MODULE(Tail);

TEST(Checkpoint, EarlyStopSkipsTheTailAfterTheLastSavedTensor) {
  for (bool early_stop : {true, false}) {
    at::manual_seed(3);
    Tail plain;
    at::manual_seed(3);
    Remat<Tail> unit = Tail();
    CheckpointOptions options;
    options.early_stop = early_stop;
    unit = checkpoint_wrapper(unit, options);
    unit->gemm = checkpoint_exclude_wrapper(unit->gemm);
    reset_counters();
    Grads got = run_and_grad([&](const at::Tensor& x) { return unit(x); }, make_input(),
                             unit->parameters());
    Grads want = run_and_grad([&](const at::Tensor& x) { return plain(x); }, make_input(),
                              plain->parameters());
    expect_bitwise_equal(got, want);
    EXPECT_EQ(unit->pre->calls, 2);
    EXPECT_EQ(unit->gemm->calls, 1);
    EXPECT_EQ(unit->tail->calls, early_stop ? 1 : 2) << "early_stop=" << early_stop;
    EXPECT_EQ(counters().early_stops, early_stop ? 1 : 0);
    EXPECT_EQ(counters().replays, 1);
  }
}

TEST(Checkpoint, SameWrapperCalledTwiceInOneUnitReplaysInCallOrder) {
  struct TwiceImpl : torch::nn::Module {
    TwiceImpl() {
      gemm = register_module("gemm", Gemm(kHidden, kHidden));
      act = register_module("act", Counted([](const at::Tensor& x) { return at::tanh(x); }));
    }
    at::Tensor forward(const at::Tensor& x) { return act(gemm(act(gemm(x)))); }
    Remat<Gemm> gemm{nullptr};
    Remat<Counted> act{nullptr};
  };
  at::manual_seed(5);
  auto plain = std::make_shared<TwiceImpl>();
  at::manual_seed(5);
  Remat<torch::nn::ModuleHolder<TwiceImpl>> unit = std::make_shared<TwiceImpl>();
  unit = checkpoint_wrapper(unit);
  unit->gemm = checkpoint_exclude_wrapper(unit->gemm);
  Grads got =
      run_and_grad([&](const at::Tensor& x) { return unit(x); }, make_input(), unit->parameters());
  Grads want = run_and_grad([&](const at::Tensor& x) { return plain->forward(x); }, make_input(),
                            plain->parameters());
  expect_bitwise_equal(got, want);
  EXPECT_EQ(unit->gemm->calls, 2);  // two forward calls, no replay calls
  EXPECT_EQ(unit->act->calls, 4);   // two forward calls + two replay calls
}

TEST(Checkpoint, SaveWrapperIsTransparentOutsideAUnit) {
  Model m = make_model();
  m->b1->gemm = checkpoint_exclude_wrapper(m->b1->gemm);
  reset_counters();
  Grads got = run_and_grad([&](const at::Tensor& x) { return m->forward(x); }, make_input(),
                           m->parameters());
  expect_bitwise_equal(got, reference());
  EXPECT_EQ(counters().save_calls, 0);
  EXPECT_EQ(counters().unit_calls, 0);
  EXPECT_EQ(m->b1->gemm->calls, 1);
}

TEST(Checkpoint, InPlaceChangeOfASavedTensorIsAClearError) {
  // The unit returns exp(x); exp saves its output, which the caller then modifies in place.
  auto unit = checkpoint_wrapper([](const at::Tensor& x) { return x.exp(); },
                                 CheckpointOptions{true, true, "expunit"});
  auto x = make_input().requires_grad_(true);
  auto y = unit(x);
  {
    at::NoGradGuard g;
    y.add_(1.0);
  }
  try {
    y.sum().backward();
    FAIL() << "no error";
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("checkpoint unit 'expunit'"), std::string::npos) << what;
    EXPECT_NE(what.find("modified by an inplace operation: it is at version 1; expected version 0"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("Float [4, 8]"), std::string::npos) << what;
  }
}

TEST(Checkpoint, InPlaceChangeOfAUnitInputIsAClearError) {
  auto unit = checkpoint_wrapper([](const at::Tensor& x) { return x.sin(); },
                                 CheckpointOptions{true, true, "sinunit"});
  auto leaf = make_input().requires_grad_(true);
  auto x = leaf * 2.0;
  auto y = unit(x);
  {
    at::NoGradGuard g;
    x.mul_(3.0);
  }
  try {
    y.sum().backward();
    FAIL() << "no error";
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("input args[0] (Float [4, 8]) of checkpoint unit 'sinunit'"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("at version 1; expected version 0"), std::string::npos) << what;
  }
}

TEST(Checkpoint, DropoutAfterASaveRegionThatConsumesRngReplaysIdentically) {
  // DropImpl (test_modules.h) with its SAVE region declared.
  auto plain = std::make_shared<DropImpl>();
  Remat<torch::nn::ModuleHolder<DropImpl>> unit = std::make_shared<DropImpl>();
  unit = checkpoint_wrapper(unit);
  unit->save = checkpoint_exclude_wrapper(unit->save);
  at::manual_seed(42);
  Grads want =
      run_and_grad([&](const at::Tensor& x) { return plain->forward(x); }, make_input(), {});
  at::manual_seed(42);
  Grads got = run_and_grad([&](const at::Tensor& x) { return unit(x); }, make_input(), {});
  expect_bitwise_equal(got, want);
  EXPECT_EQ(unit->save->calls, 1);
  EXPECT_EQ(unit->post->calls, 2);
}

TEST(Checkpoint, NestedUnitsAreRejected) {
  Model m = make_model();
  m->b1 = checkpoint_wrapper(m->b1, CheckpointOptions{true, true, "outer"});
  m->b1->gemm = checkpoint_wrapper(m->b1->gemm, CheckpointOptions{true, true, "inner"});
  auto x = make_input().requires_grad_(true);
  try {
    m->forward(x);
    FAIL() << "no error";
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("checkpoint unit 'inner' was called inside checkpoint unit 'outer'"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("nested checkpoint units are not supported"), std::string::npos);
  }
}

TEST(Checkpoint, ConflictingDeclarationsAndEmptyModulesAreRejected) {
  Model m = make_model();
  m->b1->gemm = checkpoint_exclude_wrapper(m->b1->gemm);
  try {
    checkpoint_wrapper(m->b1->gemm);
    FAIL() << "no error";
  } catch (const RematError& e) {
    EXPECT_NE(std::string(e.what()).find("is already a SAVE region"), std::string::npos);
  }
  Remat<Gemm> empty{nullptr};
  EXPECT_THROW(checkpoint_wrapper(empty), RematError);
  EXPECT_THROW(checkpoint_exclude_wrapper(Gemm(nullptr)), RematError);
  EXPECT_THROW(empty(make_input()), RematError);
  torch::nn::AnyModule none;
  try {
    checkpoint_exclude_wrapper(none);
    FAIL() << "no error";
  } catch (const RematError& e) {
    EXPECT_NE(std::string(e.what()).find("empty torch::nn::AnyModule"), std::string::npos);
  }
}

}  // namespace
}  // namespace pipemat::remat::testing
