// RECOMPUTE -> SAVE saved-input rederivation (docs/remat.md, "RECOMPUTE -> SAVE"):
// values and gradients against the no-checkpoint run, exact allocator bytes, fallbacks by reason.

#include <gtest/gtest.h>

#include "pipemat/core/error.h"
#include "pipemat/models/zoo.h"
#include "pipemat/remat/memory.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t layers_, int64_t hidden) {
    torch::nn::ModuleList list;
    for (int64_t i = 0; i < layers_; ++i) list->push_back(Block(hidden));
    layers = register_module("layers", list);
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : *layers) x = layer->as<Block>()->forward(x);
    return x;
  }
  ModuleList layers{nullptr};
};
TORCH_MODULE(Stack);

RematPolicy gemm_policy() {
  RematPolicy p;
  p.checkpoint = {"layers.*"};
  p.exclude = {{"layers.*.gemm", true}};
  return p;
}

struct Resident {
  int64_t after_forward = 0;  // allocator bytes held after forward above the pre-forward baseline
  Grads grads;
  RematReport report;
};

// Forward of `model` on a fresh [T, H] input under one invocation scope with rederivation on or
// off: allocator bytes held after forward, the scope's report, and the gradients.
template <typename Model>
Resident measure(Model& model, int64_t T, int64_t H, bool rederive, uint64_t data_seed) {
  install_tracking_allocator();
  set_rederivation_enabled(rederive);
  at::manual_seed(data_seed);
  auto x = at::randn({T, H}).requires_grad_(true);
  Resident r;
  const int64_t baseline = memory_stats().current_bytes;
  std::shared_ptr<InvocationGroup> group;
  at::Tensor out;
  {
    InvocationScope scope({0, 0, 0});
    out = model->forward(x);
    group = scope.group();
  }
  r.after_forward = memory_stats().current_bytes - baseline;
  r.report = group->report();
  auto loss = (out * at::linspace(-1, 1, out.numel()).reshape(out.sizes())).sum();
  std::vector<at::Tensor> inputs{x};
  auto params = model->parameters();
  inputs.insert(inputs.end(), params.begin(), params.end());
  auto grads = torch::autograd::grad({loss}, inputs);
  r.grads.out = out.detach();
  r.grads.dx = grads[0];
  r.grads.dparams.assign(grads.begin() + 1, grads.end());
  set_rederivation_enabled(true);
  return r;
}

Resident measure_stack(int64_t L, int64_t T, int64_t H, bool rederive) {
  at::manual_seed(1);
  Stack model(L, H);
  apply_policy(*model, gemm_policy());
  Resident r = measure(model, T, H, rederive, 2);
  for (auto& layer : *model->layers) {
    auto* b = layer->as<Block>().get();
    EXPECT_EQ(b->pre->calls, 2) << "RMSNorm runs in forward and in replay";
    EXPECT_EQ(b->gemm->calls, 1) << "the GEMM body runs only in forward";
  }
  return r;
}

TEST(Rederive, RmsNormToGemmInputIsNotResidentAndGradientsAreExact) {
  const int64_t L = 3, T = 16, H = 32;
  Resident legacy = measure_stack(L, T, H, /*rederive=*/false);
  Resident rederived = measure_stack(L, T, H, /*rederive=*/true);
  EXPECT_EQ(legacy.after_forward - rederived.after_forward, L * T * H * 4)
      << "legacy " << legacy.after_forward << " B, rederive " << rederived.after_forward << " B";
  expect_bitwise_equal(rederived.grads, legacy.grads);
  EXPECT_EQ(rederived.report.rederived_slots, L);
  EXPECT_EQ(rederived.report.rederived_bytes, L * T * H * 4);
  EXPECT_EQ(legacy.report.rederived_slots, 0);
  EXPECT_EQ(legacy.report.fallbacks[6], L) << "legacy keeps each GEMM input (reason: disabled)";
  EXPECT_EQ(rederived.report.save_resident_bytes, 0) << "the GEMM keeps only its weight";
  EXPECT_EQ(legacy.report.save_resident_bytes, L * T * H * 4);
  // And against no checkpoint at all.
  at::manual_seed(1);
  Stack plain(L, H);
  at::manual_seed(2);
  Grads want = run_and_grad([&](const at::Tensor& x) { return plain->forward(x); },
                            at::randn({T, H}), plain->parameters());
  expect_bitwise_equal(rederived.grads, want);
}

// A unit around one SAVE callable; returns grads and the report of the unit's invocation.
template <typename SaveFn, typename Body>
std::pair<Grads, RematReport> run_unit(SaveFn save_fn, Body body,
                                       const std::vector<at::Tensor>& params) {
  auto save = checkpoint_exclude_wrapper(save_fn, SaveRegionOptions{true, "region"});
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return body(x, save); },
                                 CheckpointOptions{true, true, "unit"});
  std::shared_ptr<InvocationGroup> group;
  RematReport report;
  Grads g = run_and_grad(
      [&](const at::Tensor& x) {
        InvocationScope scope({0, 0, 0});
        auto out = unit(x);
        group = scope.group();
        report = group->report();
        return out;
      },
      [] {
        at::manual_seed(3);
        return at::randn({4, 6});
      }(),
      params);
  Grads want = run_and_grad([&](const at::Tensor& x) { return body(x, save_fn); },
                            [] {
                              at::manual_seed(3);
                              return at::randn({4, 6});
                            }(),
                            params);
  expect_bitwise_equal(g, want);
  return {g, report};
}

TEST(Rederive, ActivationsInternalToARegionAreKeptNotMistakenForInputs) {
  auto [g, report] = run_unit(
      [](const at::Tensor& x) {
        auto h = x.sin();  // saves x: the input, rederived
        return h * h;      // saves h twice: internal, kept
      },
      [](const at::Tensor& x, const auto& save) { return save(x.cos()).exp(); }, {});
  EXPECT_EQ(report.rederived_slots, 1);
  EXPECT_EQ(report.save_resident_bytes, 4 * 6 * 4) << "h is kept once (one storage)";
  EXPECT_EQ(report.fallback_total(), 0);
}

TEST(Rederive, ViewsSeveralInputsNamedInputsAndTupleOutputs) {
  at::manual_seed(8);
  auto w = at::randn({4, 4}).requires_grad_(true);
  auto [g, report] = run_unit(
      [w](const at::Tensor& a, c10::Dict<std::string, at::Tensor> named) {
        auto b = named.at("b");
        auto top = a.narrow(0, 0, 2) * b.narrow(0, 2, 2);  // views of two inputs
        auto t = at::matmul(a.t(), w);                     // a transposed view of a
        return std::make_tuple(top, t, std::vector<at::Tensor>{b * 2.0});
      },
      [](const at::Tensor& x, const auto& save) {
        c10::Dict<std::string, at::Tensor> named;
        named.insert("b", x.cos());
        auto [top, t, list] = save(x.sin(), named);
        return top.sum(0) + t.sum(1) + list[0].sum(0);
      },
      {w});
  EXPECT_EQ(report.rederived_slots, 3) << "a[0:2], b[2:4] and a.t()";
  EXPECT_EQ(report.fallback_total(), 0);
}

TEST(Rederive, InPlaceChangeInsideTheRegionFallsBackAndIsCounted) {
  auto [g, report] = run_unit(
      [](const at::Tensor& x) {
        auto y = x * 1.0;
        y.mul_(2.0);         // in place on an internal tensor: not an input, nothing to count
        x.mul_(3.0);         // in place on the input itself
        return x.sin() + y;  // sin saves the mutated input: must be kept
      },
      [](const at::Tensor& x, const auto& save) { return save(x.cos()); }, {});
  EXPECT_EQ(report.rederived_slots, 0);
  EXPECT_EQ(report.fallbacks[3], 1) << report.str();  // inplace
}

TEST(Rederive, SaveToSaveInputsAreNeverRederived) {
  auto first = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x * 2.0; },
                                          SaveRegionOptions{true, "first"});
  auto [g, report] =
      run_unit([](const at::Tensor& x) { return x.sin(); },
               [&](const at::Tensor& x, const auto& save) { return save(first(x.cos())); }, {});
  EXPECT_EQ(report.rederived_slots, 0);
  EXPECT_EQ(report.fallbacks[0], 1) << report.str();  // save_sourced
}

TEST(Rederive, UnitInputsAndParametersAreKeptNotRederived) {
  at::manual_seed(9);
  auto w = at::randn({6}).requires_grad_(true);
  auto [g, report] =
      run_unit([](const at::Tensor& x, const at::Tensor& weight) { return x.sin() * weight; },
               [&](const at::Tensor& x, const auto& save) { return save(x, w); }, {w});
  EXPECT_EQ(report.rederived_slots, 0);
  EXPECT_EQ(report.fallbacks[1], 1) << report.str();  // unit_input (x)
  EXPECT_EQ(report.fallbacks[2], 1) << report.str();  // leaf (w)
}

TEST(Rederive, LayoutChangeDiscoveredAtReplayIsAClearError) {
  int calls = 0;
  auto produce = [&calls](const at::Tensor& x) {
    ++calls;
    auto y = x.cos();
    return calls == 1 ? y : y.t().contiguous().t();  // same shape, other strides in replay
  };
  auto save = checkpoint_exclude_wrapper([](const at::Tensor& h) { return h.sin(); },
                                         SaveRegionOptions{true, "gemm"});
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return save(produce(x)); },
                                 CheckpointOptions{true, true, "layer"});
  at::manual_seed(1);
  auto x = at::randn({4, 6}).requires_grad_(true);
  auto out = unit(x);
  try {
    out.sum().backward();
    FAIL() << "no error";
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("SAVE region 'gemm' in checkpoint unit 'layer' (standalone unit call"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("input args[0] has a different layout in replay"), std::string::npos)
        << what;
    EXPECT_NE(what.find("(phase: replay)"), std::string::npos) << what;
  }
}

TEST(Rederive, SameWrapperTwiceInFlightAndConsecutiveStepsKeepSlotsApart) {
  at::manual_seed(4);
  auto w = at::randn({6, 6}).requires_grad_(true);
  auto gemm = checkpoint_exclude_wrapper([w](const at::Tensor& h) { return at::matmul(h, w); },
                                         SaveRegionOptions{true, "gemm"});
  auto body = [&](const at::Tensor& x, const auto& g) { return g(g(x.sin()).cos()).tanh(); };
  auto plain_gemm = [w](const at::Tensor& h) { return at::matmul(h, w); };
  auto unit =
      checkpoint_wrapper([&](const at::Tensor& x) { return body(x, gemm); }, CheckpointOptions{});
  for (int step = 0; step < 2; ++step) {
    std::vector<at::Tensor> xs, losses;
    std::vector<std::shared_ptr<InvocationGroup>> groups;
    for (int mb = 0; mb < 3; ++mb) {
      at::manual_seed(100 * step + mb);
      xs.push_back(at::randn({4, 6}).requires_grad_(true));
      InvocationScope scope({step, 0, mb});
      losses.push_back(unit(xs.back()).sum());
      groups.push_back(scope.group());
      EXPECT_EQ(groups.back()->report().rederived_slots, 2);
    }
    for (int mb = 2; mb >= 0; --mb) {
      groups[mb]->pretrigger();
      auto got = torch::autograd::grad({losses[mb]}, {xs[mb], w});
      groups[mb]->release();
      at::manual_seed(100 * step + mb);
      auto x = at::randn({4, 6}).requires_grad_(true);
      auto want = torch::autograd::grad({body(x, plain_gemm).sum()}, {x, w});
      EXPECT_TRUE(at::equal(got[0], want[0])) << "step " << step << " mb " << mb;
      EXPECT_TRUE(at::equal(got[1], want[1])) << "step " << step << " mb " << mb;
    }
  }
}

TEST(Rederive, SaveRegionAtTheEndOfAUnitStillReachedByReplay) {
  // Nothing after the SAVE region saves a tensor: early stop must not end replay before the
  // region fills its slot.
  auto [g, report] =
      run_unit([](const at::Tensor& h) { return h.sin(); },
               [](const at::Tensor& x, const auto& save) { return save(x.cos()) + 1.0; }, {});
  EXPECT_EQ(report.rederived_slots, 1);
}

Resident measure_moe(int64_t L, int64_t T, int64_t H, int64_t E, int64_t K, bool rederive) {
  at::manual_seed(5);
  models::MoEStack model(L, H, E, K);
  RematPolicy p;
  p.checkpoint = {"layers.*"};
  p.exclude = {{"layers.*.experts", true}};
  apply_policy(*model, p);
  return measure(model, T, H, rederive, 6);
}

TEST(Rederive, MoEDispatchToGroupedGemmEndToEnd) {
  const int64_t L = 2, T = 32, H = 16, E = 4, K = 2;
  Resident legacy = measure_moe(L, T, H, E, K, false);
  Resident rederived = measure_moe(L, T, H, E, K, true);
  expect_bitwise_equal(rederived.grads, legacy.grads);
  EXPECT_EQ(legacy.after_forward - rederived.after_forward, L * T * K * H * 4)
      << "the packed tokens [T*k, H] of every layer are not resident";
  EXPECT_EQ(rederived.report.rederived_bytes, L * T * K * H * 4);
  // One slice per expert that received tokens: all E of every layer (T * K = 64 picks).
  EXPECT_EQ(rederived.report.rederived_slots, L * E) << "one slice per non-empty expert";
  // Against no checkpoint at all.
  at::manual_seed(5);
  models::MoEStack plain(L, H, E, K);
  at::manual_seed(6);
  auto x = at::randn({T, H}).requires_grad_(true);
  auto out = plain->forward(x);
  std::vector<at::Tensor> inputs{x};
  auto params = plain->parameters();
  inputs.insert(inputs.end(), params.begin(), params.end());
  auto grads = torch::autograd::grad(
      {(out * at::linspace(-1, 1, out.numel()).reshape(out.sizes())).sum()}, inputs);
  EXPECT_TRUE(at::equal(out, rederived.grads.out));
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(at::equal(grads[i], i == 0 ? rederived.grads.dx : rederived.grads.dparams[i - 1]))
        << "gradient " << i;
  }
}

TEST(Rederive, NoLeakOverAThousandSteps) {
  install_tracking_allocator();
  at::manual_seed(1);
  Stack model(2, 16);
  apply_policy(*model, gemm_policy());
  auto params = model->parameters();
  int64_t baseline = -1;
  for (int step = 0; step < 1000; ++step) {
    {
      auto x = at::randn({8, 16}).requires_grad_(true);
      std::shared_ptr<InvocationGroup> group;
      at::Tensor out;
      {
        InvocationScope scope({step, 0, 0});
        out = model->forward(x);
        group = scope.group();
      }
      if (step % 2 == 0) group->pretrigger();
      torch::autograd::grad({out.sum()}, params);
      group->release();
      EXPECT_EQ(group->report().invocations, 0);
    }
    const int64_t now = memory_stats().current_bytes;
    if (baseline < 0) baseline = now;
    ASSERT_EQ(now, baseline) << "allocator bytes grew at step " << step;
  }
}

}  // namespace
}  // namespace pipemat::remat::testing
