// SAVE -> SAVE chains with save_output = false (docs/remat.md, "SAVE -> SAVE").

#include <gtest/gtest.h>

#include "pipemat/core/error.h"
#include "pipemat/remat/memory.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

at::Tensor chain_input(int seed, int64_t t = 4, int64_t h = 6) {
  at::manual_seed(seed);
  return at::randn({t, h});
}

TEST(SaveChain, SingleTupleListAndNestedOutputsMatchAndCountLeaves) {
  at::manual_seed(2);
  auto w = at::randn({6, 6}).requires_grad_(true);
  int calls1 = 0, calls2 = 0, calls3 = 0, calls4 = 0;
  // single -> tuple -> list -> nested (IValue) -> last (save_output = true)
  auto f1 = [&](const at::Tensor& x) {
    ++calls1;
    return at::matmul(x, w).relu();
  };
  auto f2 = [&](const at::Tensor& y) {
    ++calls2;
    return std::make_tuple(y * 2.0, y.exp());
  };
  auto f3 = [&](std::tuple<at::Tensor, at::Tensor> t) {
    ++calls3;
    return std::vector<at::Tensor>{std::get<0>(t) + 1.0, std::get<1>(t).sin(), std::get<0>(t)};
  };
  auto f4 = [&](std::vector<at::Tensor> v) -> c10::IValue {
    ++calls4;
    c10::impl::GenericList nested(c10::AnyType::get());
    nested.push_back(c10::ivalue::Tuple::create({v[0] * v[1], v[2]}));
    nested.push_back(v[1].tanh());
    return nested;
  };
  auto last = [](const c10::IValue& nested) {
    auto list = nested.toList();
    auto pair = list.get(0).toTupleRef().elements();
    return pair[0].toTensor() + pair[1].toTensor() * list.get(1).toTensor();
  };
  auto body = [&](const at::Tensor& x, auto&& s1, auto&& s2, auto&& s3, auto&& s4, auto&& s5) {
    return s5(s4(s3(s2(s1(x.cos()))))).sigmoid();
  };
  auto r1 = checkpoint_exclude_wrapper(f1, SaveRegionOptions{false, "s1"});
  auto r2 = checkpoint_exclude_wrapper(f2, SaveRegionOptions{false, "s2"});
  auto r3 = checkpoint_exclude_wrapper(f3, SaveRegionOptions{false, "s3"});
  auto r4 = checkpoint_exclude_wrapper(f4, SaveRegionOptions{false, "s4"});
  auto r5 = checkpoint_exclude_wrapper(last, SaveRegionOptions{true, "s5"});
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return body(x, r1, r2, r3, r4, r5); },
                                 CheckpointOptions{});
  reset_counters();
  Grads got = run_and_grad([&](const at::Tensor& x) { return unit(x); }, chain_input(1), {w});
  const auto c = counters();
  EXPECT_EQ(calls1, 1);
  EXPECT_EQ(calls2, 1);
  EXPECT_EQ(calls3, 1);
  EXPECT_EQ(calls4, 1);
  EXPECT_EQ(c.output_leaves, 1 + 2 + 3 + 3);
  EXPECT_EQ(c.placeholders, c.output_leaves) << "replay hands out one placeholder per leaf";
  EXPECT_EQ(c.replays, 1);
  Grads want = run_and_grad([&](const at::Tensor& x) { return body(x, f1, f2, f3, f4, last); },
                            chain_input(1), {w});
  expect_bitwise_equal(got, want);
}

struct ChainResult {
  int64_t resident = 0;
  Grads grads;
};

ChainResult run_chain(bool optimized, int64_t T, int64_t H) {
  install_tracking_allocator();
  auto s1 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return at::relu(x * x); },
                                       SaveRegionOptions{!optimized, "save1"});
  auto s2 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x + 0.125; },
                                       SaveRegionOptions{!optimized, "save2"});
  auto s3 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x * 1.5; },
                                       SaveRegionOptions{!optimized, "save3"});
  auto s4 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x + 0.25; },
                                       SaveRegionOptions{true, "save4"});
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return s4(s3(s2(s1(x * 2.0)))); },
                                 CheckpointOptions{});
  auto x = chain_input(3, T, H).requires_grad_(true);
  ChainResult r;
  const int64_t baseline = memory_stats().current_bytes;
  auto out = unit(x);
  r.resident = memory_stats().current_bytes - baseline;
  auto loss = out.sum();
  r.grads.out = loss.detach();
  r.grads.dx = torch::autograd::grad({loss}, {x})[0];
  return r;
}

TEST(SaveChain, OptimizedChainHoldsTwoActivationsLessThanLegacy) {
  const int64_t T = 32, H = 16;
  ChainResult legacy = run_chain(false, T, H);
  ChainResult optimized = run_chain(true, T, H);
  EXPECT_EQ(legacy.resident - optimized.resident, 2 * T * H * 4)
      << "legacy " << legacy.resident << " B, optimized " << optimized.resident << " B";
  expect_bitwise_equal(optimized.grads, legacy.grads);
}

template <typename Body>
void expect_misuse(Body body, const std::string& text) {
  auto s1 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x.exp(); },
                                       SaveRegionOptions{false, "producer"});
  auto s2 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x * 3.0; },
                                       SaveRegionOptions{true, "consumer"});
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return body(x.cos(), s1, s2); },
                                 CheckpointOptions{true, true, "chain"});
  auto x = chain_input(5).requires_grad_(true);
  try {
    unit(x).sum().backward();
    FAIL() << "no error; expected: " << text;
  } catch (const RematError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find(text), std::string::npos) << what;
    EXPECT_NE(what.find("'producer'"), std::string::npos) << what;
    EXPECT_NE(what.find("checkpoint unit 'chain' (standalone unit call"), std::string::npos)
        << what;
  }
}

TEST(SaveChain, MisuseIsAnErrorNamingTheProducerAndTheInvocation) {
  // A RECOMPUTE op saves the output (caught in forward).
  expect_misuse([](const at::Tensor& h, auto& s1, auto& s2) { return s2(s1(h).sin()); },
                "saves the output of SAVE region 'producer'");
  // The unit returns it (caught in forward).
  expect_misuse([](const at::Tensor& h, auto& s1, auto& s2) { return s1(h); },
                "returns (as output) the output of SAVE region 'producer'");
  // A bare op reads it and a RECOMPUTE op saves the result (caught in replay).
  expect_misuse([](const at::Tensor& h, auto& s1, auto& s2) { return s2((s1(h) + 1.0).sin()); },
                "Placeholders from SAVE region(s) 'producer'");
  // Indexing (caught in replay).
  expect_misuse([](const at::Tensor& h, auto& s1,
                   auto& s2) { return s2(s1(h).select(0, 1).unsqueeze(0).sin()); },
                "'producer'");
}

TEST(SaveChain, DefaultSaveOutputKeepsBareConsumersWorking) {
  auto s1 = checkpoint_exclude_wrapper([](const at::Tensor& x) { return x.exp(); });
  auto body = [&](const at::Tensor& x, auto& s) { return (s(x.cos()) + 1.0).sin().select(0, 1); };
  auto plain = [](const at::Tensor& x) { return x.exp(); };
  auto unit = checkpoint_wrapper([&](const at::Tensor& x) { return body(x, s1); });
  Grads got = run_and_grad([&](const at::Tensor& x) { return unit(x); }, chain_input(6), {});
  Grads want =
      run_and_grad([&](const at::Tensor& x) { return body(x, plain); }, chain_input(6), {});
  expect_bitwise_equal(got, want);
}

TEST(SaveChain, ConflictingOrEmptyDeclarationsAreRejected) {
  at::manual_seed(1);
  Remat<Gemm> gemm = Gemm(4, 4);
  gemm = checkpoint_exclude_wrapper(gemm, SaveRegionOptions{false, "gemm"});
  try {
    checkpoint_exclude_wrapper(gemm, SaveRegionOptions{true, "gemm"});
    FAIL() << "no error";
  } catch (const RematError& e) {
    EXPECT_NE(std::string(e.what()).find("is already a SAVE region with save_output = false"),
              std::string::npos)
        << e.what();
  }
  auto root = std::make_shared<torch::nn::Module>();
  root->register_module("gemm", gemm.ptr());
  RematPolicy p;
  p.exclude = {{"", false}};
  try {
    apply_policy(*root, p);
    FAIL() << "no error";
  } catch (const RematError& e) {
    EXPECT_NE(std::string(e.what()).find("an exclude path is empty"), std::string::npos);
  }
}

}  // namespace
}  // namespace pipemat::remat::testing
