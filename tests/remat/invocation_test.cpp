// Invocations: pipeline scopes, pre-triggered replay, split backward (I then W), many
// invocations in flight, and lifetime of everything remat holds.

#include <gtest/gtest.h>

#include "pipemat/core/error.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

Remat<Block> make_unit(bool save_gemm = true) {
  at::manual_seed(7);
  Remat<Block> unit = Block(kHidden);
  unit = checkpoint_wrapper(unit);
  if (save_gemm) unit->gemm = checkpoint_exclude_wrapper(unit->gemm);
  return unit;
}

at::Tensor leaf_input(int seed) {
  at::manual_seed(seed);
  return at::randn({4, kHidden}).requires_grad_(true);
}

at::Tensor loss_of(const at::Tensor& out) {
  return (out * at::linspace(-1, 1, out.numel()).reshape(out.sizes())).sum();
}

TEST(Invocation, PretriggerThenSplitBackwardReplaysOnceAndMatchesFusedBackward) {
  auto unit = make_unit();
  auto params = unit->parameters();

  // Fused reference (lazy replay).
  auto x_ref = leaf_input(1);
  auto fused = torch::autograd::grad({loss_of(unit(x_ref))}, {x_ref, params[0], params[1]});

  reset_counters();
  auto x = leaf_input(1);
  std::shared_ptr<InvocationGroup> group;
  at::Tensor loss;
  {
    InvocationScope scope({/*step=*/0, /*stage=*/0, /*micro_batch=*/0});
    loss = loss_of(unit(x));
    group = scope.group();
  }
  ASSERT_EQ(group->size(), 1u);
  group->pretrigger();  // schedule action R
  EXPECT_EQ(counters().replays, 1);
  EXPECT_EQ(unit->pre->calls, 4);  // reference: forward + replay; here: forward + R
  at::Tensor dx, dw, db;
  {
    PhaseScope phase(Phase::kBackwardInput);
    dx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
  }
  {
    PhaseScope phase(Phase::kBackwardWeight);
    auto w = torch::autograd::grad({loss}, {params[0], params[1]});
    dw = w[0];
    db = w[1];
  }
  group->release();
  EXPECT_EQ(counters().replays, 1) << "I and W must unpack the same retained replay";
  EXPECT_EQ(unit->pre->calls, 4);  // no replay during I or W
  EXPECT_EQ(unit->gemm->calls, 2);
  EXPECT_TRUE(at::equal(dx, fused[0]));
  EXPECT_TRUE(at::equal(dw, fused[1]));
  EXPECT_TRUE(at::equal(db, fused[2]));
}

TEST(Invocation, RetainWithoutPretriggerReplaysLazilyOnceForIAndW) {
  auto unit = make_unit();
  auto params = unit->parameters();
  reset_counters();
  auto x = leaf_input(2);
  InvocationScope scope({3, 1, 2});
  auto loss = loss_of(unit(x));
  scope.group()->retain();
  EXPECT_EQ(counters().replays, 0);
  torch::autograd::grad({loss}, {x}, {}, true);
  torch::autograd::grad({loss}, params);
  EXPECT_EQ(counters().replays, 1);
  scope.group()->release();
}

TEST(Invocation, FourInFlightReplayedAndBackpropagatedInReverseOrder) {
  auto unit = make_unit();
  auto params = unit->parameters();
  std::vector<at::Tensor> xs, losses;
  std::vector<std::shared_ptr<InvocationGroup>> groups;
  for (int mb = 0; mb < 4; ++mb) {
    xs.push_back(leaf_input(10 + mb));
    InvocationScope scope({0, 0, mb});
    losses.push_back(loss_of(unit(xs.back())));
    groups.push_back(scope.group());
  }
  reset_counters();
  std::vector<std::vector<at::Tensor>> got(4);
  for (int mb = 3; mb >= 0; --mb) {
    groups[mb]->pretrigger();
    std::vector<at::Tensor> inputs{xs[mb]};
    inputs.insert(inputs.end(), params.begin(), params.end());
    got[mb] = torch::autograd::grad({losses[mb]}, inputs);
    groups[mb]->release();
  }
  EXPECT_EQ(counters().replays, 4);
  // Each micro-batch alone, no checkpoint.
  at::manual_seed(7);
  Block plain(kHidden);
  for (int mb = 0; mb < 4; ++mb) {
    auto x = leaf_input(10 + mb);
    std::vector<at::Tensor> inputs{x};
    auto pp = plain->parameters();
    inputs.insert(inputs.end(), pp.begin(), pp.end());
    auto want = torch::autograd::grad({loss_of(plain(x))}, inputs);
    ASSERT_EQ(want.size(), got[mb].size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(at::equal(want[i], got[mb][i])) << "micro-batch " << mb << " grad " << i;
    }
  }
}

TEST(Invocation, IdsNameStepChunkMicroBatchAndCall) {
  InvocationId id;
  id.key = {3, 1, 2};
  id.call = 4;
  id.standalone = false;
  EXPECT_EQ(id.str(), "step 3, stage 1, micro-batch 2, unit call #4");
  InvocationId lone;
  lone.call = 9;
  EXPECT_EQ(lone.str(), "standalone unit call #9");
}

TEST(Invocation, UnpackAfterReleaseIsAnErrorNamingTheInvocation) {
  auto unit = make_unit();
  auto x = leaf_input(3);
  InvocationScope scope({5, 0, 1});
  auto loss = loss_of(unit(x));
  scope.group()->release();
  try {
    loss.backward();
    FAIL() << "no error";
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("(step 5, stage 0, micro-batch 1, unit call #0) was released before its "
                        "backward used it"),
              std::string::npos)
        << what;
  }
}

c10::weak_intrusive_ptr<c10::StorageImpl> weak_storage(const at::Tensor& t) {
  return t.storage().getWeakStorageImpl();
}

TEST(Invocation, NothingRematHeldSurvivesBackward) {
  auto unit = make_unit();
  auto leaf = leaf_input(4);
  auto x = leaf * 1.5;  // a non-leaf unit input, held by the invocation for replay
  auto w_input = weak_storage(x);
  c10::weak_intrusive_ptr<c10::StorageImpl> w_out = weak_storage(x);
  {
    auto out = unit(x);
    w_out = weak_storage(out);
    x = at::Tensor();
    loss_of(out).backward();
  }
  EXPECT_TRUE(w_input.expired()) << "the unit input outlived backward";
  EXPECT_TRUE(w_out.expired()) << "the unit output outlived backward";
}

TEST(Invocation, ReleaseFreesPretriggeredReplayAndCachedOutputs) {
  auto unit = make_unit();
  auto x = leaf_input(5);
  std::shared_ptr<InvocationGroup> group;
  at::Tensor loss;
  {
    InvocationScope scope({0, 0, 0});
    loss = loss_of(unit(x));
    group = scope.group();
  }
  group->pretrigger();
  RematReport before = group->report();
  EXPECT_EQ(before.invocations, 1);
  // What the replay saved, one count per storage: x (by pow and the multiply), the rsqrt's
  // [4, 1] result (by rsqrt and the multiply), the gemm's input (the SAVE region's slot, filled
  // from the replay) and silu's input (the gemm's output): three [4, kHidden] float32 tensors
  // and one [4, 1].
  EXPECT_EQ(before.replayed_bytes, 3 * (4 * kHidden * 4) + 4 * 4);
  EXPECT_EQ(before.cached_output_bytes, 4 * kHidden * 4);  // the gemm output, float32
  loss.backward();
  group->release();
  RematReport after = group->report();
  EXPECT_EQ(after.invocations, 0);
  EXPECT_EQ(after.replayed_bytes, 0);
  EXPECT_EQ(after.cached_output_bytes, 0);
}

}  // namespace
}  // namespace pipemat::remat::testing
