// Per-thread CPU generators (Note [Per-thread CPU generators]): random ops draw from the
// thread's generator, and checkpoint units with dropout replay the forward's masks while other
// threads draw at the same time.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <thread>
#include <vector>

#include "pipemat/remat/remat.h"
#include "test_modules.h"

namespace pipemat::remat::testing {
namespace {

TEST(ThreadGenerators, RandomOpsDrawFromTheScopesGenerator) {
  auto reference = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor want = at::randn({6}, reference);
  const at::Tensor mask_want = at::empty({64}).bernoulli_(0.5, reference);
  at::manual_seed(1);
  const at::Tensor global_before = at::randn({6});
  at::Tensor got, mask;
  {
    ThreadGeneratorScope scope(5);
    got = at::randn({6});
    mask = at::empty({64}).bernoulli_(0.5);
    {
      ThreadGeneratorScope inner(9);  // nests: the innermost wins
      EXPECT_TRUE(
          at::equal(at::randn({2}), at::randn({2}, at::make_generator<at::CPUGeneratorImpl>(9))));
    }
  }
  EXPECT_TRUE(at::equal(got, want));
  EXPECT_TRUE(at::equal(mask, mask_want));
  // The default generator was not touched by the scopes' draws.
  at::manual_seed(1);
  EXPECT_TRUE(at::equal(at::randn({6}), global_before));
  // Explicit generators are left alone inside a scope.
  ThreadGeneratorScope scope(5);
  EXPECT_TRUE(at::equal(at::randn({6}, at::make_generator<at::CPUGeneratorImpl>(5)), want));
}

// Each thread checkpoints its own dropout unit and compares it with the plain module under the
// same seed, while the other threads do the same.
int differing_steps(int threads, int steps) {
  std::atomic<int> differ{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      auto plain = std::make_shared<DropImpl>();
      Remat<torch::nn::ModuleHolder<DropImpl>> unit = std::make_shared<DropImpl>();
      unit = checkpoint_wrapper(unit);
      unit->save = checkpoint_exclude_wrapper(unit->save);
      const at::Tensor x = at::randn({64, 32}, at::make_generator<at::CPUGeneratorImpl>(t));
      for (int step = 0; step < steps; ++step) {
        const uint64_t seed = 1000 * t + step;
        Grads got, want;
        {
          ThreadGeneratorScope scope(seed);
          got = run_and_grad([&](const at::Tensor& in) { return unit(in); }, x, {});
        }
        {
          ThreadGeneratorScope scope(seed);
          want = run_and_grad([&](const at::Tensor& in) { return plain->forward(in); }, x, {});
        }
        if (!at::equal(got.out, want.out) || !at::equal(got.dx, want.dx)) ++differ;
      }
      EXPECT_EQ(unit->save->calls, steps) << "the SAVE body ran once per step";
      EXPECT_EQ(unit->post->calls, 2 * steps) << "forward and replay";
    });
  }
  for (auto& th : pool) th.join();
  return differ.load();
}

TEST(ThreadGenerators, DropoutInCheckpointUnitsOnConcurrentThreadsEqualsThePlainRun) {
  for (int threads : {2, 4}) {
    EXPECT_EQ(differing_steps(threads, 150), 0) << threads << " threads";
  }
}

}  // namespace
}  // namespace pipemat::remat::testing
