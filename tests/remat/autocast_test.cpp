// Note [Autocast in replay]: a replay computes in its forward's dtypes whatever the replaying
// thread's autocast state, and leaves that thread's autocast state, nesting and grad mode as it
// found them. Values and gradients against the same model without remat under the same
// autocast, bitwise.

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <vector>

#include "pipemat/core/error.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

// CPU autocast to bf16 for the scope, as a region of its own (nesting counted, cache cleared
// at its end), the way torch.autocast does it.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool on) : on_(on) {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, false);
  }

 private:
  bool on_;
};

int nesting() {
  const int now = at::autocast::increment_nesting() - 1;
  at::autocast::decrement_nesting();
  return now;
}

// matmul -> gemm (SAVE when declared) -> silu, recording the dtype of its own matmul each time
// its forward runs: in the unit's forward and again in its replay. With `toggle` the block
// turns CPU autocast on and off itself with the plain calls around its matmul and gemm.
struct ProbeImpl : torch::nn::Module {
  explicit ProbeImpl(bool toggle = false) : toggle_(toggle) {
    weight = register_parameter("weight", at::randn({kHidden, kHidden}) * 0.1);
    gemm = register_module("gemm", Gemm(kHidden, kHidden));
    post = register_module("post", Counted([](const at::Tensor& x) { return at::silu(x); }));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (toggle_) {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::increment_nesting();
    }
    const at::Tensor y = at::matmul(x, weight.t());
    dtypes.push_back(y.scalar_type());
    const at::Tensor z = post(gemm(y));
    // After the last op that saves a tensor: an early-stopped replay never gets here.
    if (toggle_) {
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      at::autocast::set_autocast_enabled(at::kCPU, false);
    }
    return z.to(at::kFloat);
  }
  bool toggle_;
  at::Tensor weight;
  Remat<Gemm> gemm{nullptr};
  Remat<Counted> post{nullptr};
  std::vector<at::ScalarType> dtypes;
};
TORCH_MODULE(Probe);

struct TwoProbesImpl : torch::nn::Module {
  explicit TwoProbesImpl(bool toggle) {
    a = register_module("a", Probe(toggle));
    b = register_module("b", Probe(toggle));
  }
  at::Tensor forward(const at::Tensor& x) { return b(a(x)); }
  Remat<Probe> a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoProbes);

TwoProbes make_probes(bool remat, bool toggle = false, bool save_gemm = true) {
  at::manual_seed(3);
  TwoProbes m(toggle);
  if (remat) {
    for (auto* p : {&m->a, &m->b}) {
      if (save_gemm) (**p).gemm = checkpoint_exclude_wrapper((**p).gemm);
      *p = checkpoint_wrapper(*p);
    }
  }
  return m;
}

at::Tensor probe_input() {
  at::manual_seed(5);
  return at::randn({4, kHidden});
}

enum class Around { kNothing, kForward, kForwardAndBackward };

// Forward and backward with autocast around `around`.
Grads run(TwoProbes& m, Around around) {
  auto xin = probe_input().requires_grad_(true);
  at::Tensor out;
  std::vector<at::Tensor> grads;
  {
    CpuAutocast outer(around == Around::kForwardAndBackward);
    {
      CpuAutocast inner(around == Around::kForward);
      out = m->forward(xin);
    }
    const auto w = at::linspace(-1, 1, out.numel()).reshape(out.sizes());
    std::vector<at::Tensor> inputs{xin};
    for (const auto& p : m->parameters()) inputs.push_back(p);
    grads = torch::autograd::grad({(out * w).sum()}, inputs);
  }
  Grads g;
  g.out = out.detach();
  g.dx = grads[0];
  g.dparams.assign(grads.begin() + 1, grads.end());
  return g;
}

// (a) The unit's own matmul checks its dtype in forward and again in replay: bf16 both times
// under autocast (also when the backward, which replays, runs outside it), float32 without.
TEST(AutocastReplay, TheUnitsMatmulRunsInItsForwardsDtypeInReplay) {
  for (const Around around : {Around::kNothing, Around::kForward, Around::kForwardAndBackward}) {
    SCOPED_TRACE(static_cast<int>(around));
    TwoProbes m = make_probes(true);
    const Grads got = run(m, around);
    const at::ScalarType want = around == Around::kNothing ? at::kFloat : at::kBFloat16;
    for (auto* p : {&m->a, &m->b}) {
      EXPECT_EQ((**p).dtypes, std::vector<at::ScalarType>({want, want}))
          << "forward, then replay (a recomputed matmul)";
    }
    TwoProbes plain = make_probes(false);
    expect_bitwise_equal(got, run(plain, around));
  }
}

// A pre-triggered replay (the pipeline's R action, outside any autocast region) recomputes in
// its forward's bf16, and the report counts the bf16 tensors at 2 bytes an element: each unit's
// cached gemm output [4, kHidden] and, of its replay, what the matmul saves (autocast's bf16
// casts of its input [4, kHidden] and weight [kHidden, kHidden]), the gemm's slot (the
// matmul's output) and silu's input. Gradients as without remat, bitwise.
TEST(AutocastReplay, APretriggeredReplayRecomputesInBf16AndCountsItsBytes) {
  TwoProbes m = make_probes(true);
  auto xin = probe_input().requires_grad_(true);
  std::shared_ptr<InvocationGroup> group;
  at::Tensor out;
  {
    InvocationScope scope({0, 0, 0});
    CpuAutocast on(true);
    out = m->forward(xin);
    group = scope.group();
  }
  group->pretrigger();
  EXPECT_EQ(m->a->dtypes, std::vector<at::ScalarType>({at::kBFloat16, at::kBFloat16}));
  const RematReport report = group->report();
  EXPECT_EQ(report.invocations, 2);
  EXPECT_EQ(report.cached_output_bytes, 2 * (4 * kHidden * 2));
  EXPECT_EQ(report.replayed_bytes,
            2 * (4 * kHidden + kHidden * kHidden + 4 * kHidden + 4 * kHidden) * 2);
  const auto w = at::linspace(-1, 1, out.numel()).reshape(out.sizes());
  std::vector<at::Tensor> inputs{xin};
  for (const auto& p : m->parameters()) inputs.push_back(p);
  const auto grads = torch::autograd::grad({(out * w).sum()}, inputs);
  group->release();
  TwoProbes plain = make_probes(false);
  const Grads want = run(plain, Around::kForward);
  EXPECT_TRUE(at::equal(out, want.out));
  EXPECT_TRUE(at::equal(grads[0], want.dx));
  for (size_t i = 0; i < want.dparams.size(); ++i) {
    EXPECT_TRUE(at::equal(grads[i + 1], want.dparams[i])) << "parameter " << i;
  }
}

// Note [Rederived casts]: RMSNorm (RECOMPUTE, float32 ops) feeding a SAVE GEMM under autocast:
// the GEMM saves autocast's bf16 cast of the normalized input, which replay rederives from the
// replayed input plus the cast instead of keeping it, as float32 rederives the input itself. On
// a 3-d input the GEMM saves a 2-d view of the cast, rederived as the cast viewed. Gradients as
// without remat under the same autocast, bitwise.
TEST(AutocastReplay, AGemmsBf16CastOfARecomputedInputIsRederived) {
  const auto make = [](bool remat) {
    at::manual_seed(13);
    Remat<Block> block{Block(kHidden)};
    if (remat) {
      block->gemm = checkpoint_exclude_wrapper(block->gemm);
      block = checkpoint_wrapper(block);
    }
    return block;
  };
  for (const bool three_d : {false, true}) {
    for (const bool on : {false, true}) {
      SCOPED_TRACE(std::string(on ? "bf16" : "float32") + (three_d ? ", 3-d input" : ""));
      Remat<Block> remat = make(true), plain = make(false);
      const at::Tensor input = three_d ? probe_input().reshape({2, 2, kHidden}) : probe_input();
      auto x = input.clone().requires_grad_(true);
      auto x2 = input.clone().requires_grad_(true);
      std::shared_ptr<InvocationGroup> group;
      at::Tensor out, want;
      {
        InvocationScope scope({0, 0, 0});
        CpuAutocast autocast(on);
        out = remat(x).to(at::kFloat);
        group = scope.group();
      }
      {
        CpuAutocast autocast(on);
        want = plain(x2).to(at::kFloat);
      }
      const RematReport report = group->report();
      EXPECT_EQ(report.rederived_slots, 1);
      EXPECT_EQ(report.rederived_bytes, 4 * kHidden * (on ? 2 : 4));
      EXPECT_EQ(report.fallback_total(), 0);
      out.sum().backward();
      want.sum().backward();
      EXPECT_TRUE(at::equal(out, want));
      EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
      EXPECT_TRUE(at::equal(remat->gemm->weight.grad(), plain->gemm->weight.grad()));
    }
  }
}

// (b) A unit that turns autocast on and off itself, with early stop (replay ends at the silu's
// saved input, before the block's "off"), and without early stop: bitwise equal, and the
// thread's autocast state, nesting and grad mode are what they were.
TEST(AutocastReplay, AUnitThatTogglesAutocastLeavesTheThreadAsItFoundIt) {
  for (const bool early_stop : {true, false}) {
    SCOPED_TRACE(early_stop ? "early stop" : "full replay");
    at::manual_seed(3);
    TwoProbes m(true);
    CheckpointOptions options;
    options.early_stop = early_stop;
    for (auto* p : {&m->a, &m->b}) {
      (**p).gemm = checkpoint_exclude_wrapper((**p).gemm);
      *p = checkpoint_wrapper(*p, options);
    }
    for (int step = 0; step < 3; ++step) {
      TwoProbes plain = make_probes(false, true);
      const Grads got = run(m, Around::kNothing);
      expect_bitwise_equal(got, run(plain, Around::kNothing));
      EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
      EXPECT_EQ(nesting(), 0) << "after step " << step;
      EXPECT_TRUE(c10::GradMode::is_enabled());
    }
    EXPECT_EQ(m->a->dtypes, std::vector<at::ScalarType>(6, at::kBFloat16));
  }
}

// A unit with a SAVE region that turns autocast off for what follows it inside the unit: in
// replay (the SAVE body skipped) what follows computes in float32 too, as in forward.
struct OffAfterSaveImpl : torch::nn::Module {
  OffAfterSaveImpl() {
    gemm = register_module("gemm", Counted([this](const at::Tensor& x) {
                             const at::Tensor y = at::matmul(x, weight.t());
                             at::autocast::set_autocast_enabled(at::kCPU, false);
                             return y;
                           }));
    weight = register_parameter("weight", at::randn({kHidden, kHidden}) * 0.1);
    tail = register_parameter("tail", at::randn({kHidden, kHidden}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = gemm(x);
    const at::Tensor z = at::matmul(y.to(at::kFloat), tail.t());
    dtypes.push_back(z.scalar_type());
    return z.sin();
  }
  at::Tensor weight, tail;
  Remat<Counted> gemm{nullptr};
  std::vector<at::ScalarType> dtypes;
};
TORCH_MODULE(OffAfterSave);

TEST(AutocastReplay, ASaveRegionThatTurnsAutocastOffStaysOffInReplay) {
  at::manual_seed(9);
  OffAfterSave m;
  m->gemm = checkpoint_exclude_wrapper(m->gemm);
  Remat<OffAfterSave> unit = checkpoint_wrapper(Remat<OffAfterSave>(m));
  auto x = probe_input().requires_grad_(true);
  at::Tensor out;
  {
    CpuAutocast on(true);
    out = unit(x);
  }
  at::autocast::set_autocast_enabled(at::kCPU, true);  // an ambient state replay must not use
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  out.sum().backward();
  EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU)) << "the thread's state is kept";
  at::autocast::set_autocast_enabled(at::kCPU, false);
  EXPECT_EQ(m->dtypes, std::vector<at::ScalarType>({at::kFloat, at::kFloat}));
  EXPECT_EQ(m->gemm->calls, 1) << "the SAVE body ran once";
}

// Two units sharing one weight (tied layers) under autocast: autocast caches the weight's bf16
// cast for its region, so the second unit's forward reuses the first one's cast. A replay
// outside any region opens its own and casts the weight again (its cache cleared when it ends);
// inside the caller's open region it is nested in it and may reuse that region's cast, whose
// autograd history leads to the same weight. Either way the weight's gradient sums both units'
// shares as without remat, bitwise: autocast around the forward only and around forward and
// backward, the units replayed in the backward and pre-triggered.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    weight = register_parameter("weight", at::randn({kHidden, kHidden}) * 0.1);
    const auto unit = [this](const at::Tensor& x) { return at::silu(at::matmul(x, weight.t())); };
    a = register_module("a", Counted(unit));
    b = register_module("b", Counted(unit));
  }
  at::Tensor forward(const at::Tensor& x) { return b(a(x)).to(at::kFloat); }
  at::Tensor weight;
  Remat<Counted> a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

TEST(AutocastReplay, TwoUnitsSharingOneWeightAreBitwiseEqual) {
  const auto once = [](Tied& m, Around around, bool pretrigger) {
    auto x = probe_input().requires_grad_(true);
    at::Tensor out, dx, dw;
    {
      CpuAutocast outer(around == Around::kForwardAndBackward);
      std::shared_ptr<InvocationGroup> group;
      {
        InvocationScope scope({0, 0, 0});
        CpuAutocast inner(around == Around::kForward);
        out = m->forward(x);
        group = scope.group();
      }
      if (pretrigger) group->pretrigger();
      const auto w = at::linspace(-1, 1, out.numel()).reshape(out.sizes());
      const auto grads = torch::autograd::grad({(out * w).sum()}, {x, m->weight});
      dx = grads[0];
      dw = grads[1];
      group->release();
    }
    EXPECT_EQ(nesting(), 0);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
    return std::vector<at::Tensor>{out.detach(), dx, dw};
  };
  for (const Around around : {Around::kForward, Around::kForwardAndBackward}) {
    for (const bool pretrigger : {false, true}) {
      SCOPED_TRACE(std::string(around == Around::kForward ? "forward" : "forward and backward") +
                   (pretrigger ? ", pre-triggered" : ""));
      at::manual_seed(21);
      Tied remat;
      remat->a = checkpoint_wrapper(remat->a);
      remat->b = checkpoint_wrapper(remat->b);
      at::manual_seed(21);
      Tied plain;
      const auto got = once(remat, around, pretrigger);
      const auto want = once(plain, around, false);
      EXPECT_EQ(got[0].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(got[0], want[0])) << "outputs";
      EXPECT_TRUE(at::equal(got[1], want[1])) << "input gradients";
      EXPECT_TRUE(at::equal(got[2], want[2])) << "the shared weight's gradient";
      EXPECT_GT(got[2].abs().sum().item<float>(), 0.0f);
      EXPECT_EQ(remat->a->calls, 2) << "forward and replay";
      EXPECT_EQ(remat->b->calls, 2);
    }
  }
}

// Dropout inside a unit under autocast (a SAVE region that draws too): the same masks and
// values as without remat, and the dropout after the SAVE region replays.
TEST(AutocastReplay, DropoutInsideAUnitUnderAutocastIsBitwiseEqual) {
  auto plain = std::make_shared<DropImpl>();
  Remat<torch::nn::ModuleHolder<DropImpl>> unit = std::make_shared<DropImpl>();
  unit = checkpoint_wrapper(unit);
  unit->save = checkpoint_exclude_wrapper(unit->save);
  const auto once = [](const std::function<at::Tensor(const at::Tensor&)>& fn) {
    at::manual_seed(77);
    auto x = probe_input().requires_grad_(true);
    at::Tensor out;
    {
      CpuAutocast on(true);
      out = at::matmul(fn(x), at::eye(kHidden)).to(at::kFloat);
    }
    out.sum().backward();
    return std::make_pair(out.detach(), x.grad());
  };
  const auto [out1, dx1] = once([&](const at::Tensor& x) { return unit(x); });
  const auto [out2, dx2] = once([&](const at::Tensor& x) { return plain->forward(x); });
  EXPECT_TRUE(at::equal(out1, out2));
  EXPECT_TRUE(at::equal(dx1, dx2));
  EXPECT_EQ(unit->post->calls, 2) << "replayed";
}

}  // namespace
}  // namespace pipemat::remat::testing
