// Per-thread CPU generators (Note [Per-thread CPU generators]): random ops draw from the
// thread's generator, and checkpoint units with dropout replay the forward's masks while other
// threads draw at the same time.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
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

// A unit that drops out, then waits at a gate inside its forward (the first time only: replay
// passes straight through), then drops out again.
struct GatedDropImpl : torch::nn::Module {
  explicit GatedDropImpl(bool draws) : random(draws) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = random ? at::dropout(x, 0.5, true) : x.sin();
    if (gate && !gated) {
      gated = true;
      gate();
    }
    return random ? at::dropout(y, 0.5, true) * x : y * x;
  }
  bool random;
  bool gated = false;
  std::function<void()> gate;
};

struct Latch {
  std::mutex mutex;
  std::condition_variable cv;
  bool open = false;
  void release() {
    std::lock_guard<std::mutex> lock(mutex);
    open = true;
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return open; });
  }
};

// Thread A's unit is inside its forward (it has drawn) while the main thread runs a unit of its
// own; returns A's error ("" when none) and the main thread's.
std::pair<std::string, std::string> overlapping_units(bool random, bool scopes) {
  at::manual_seed(3);
  Latch a_inside, b_done;
  std::string a_error, b_error;
  std::thread a([&] {
    std::optional<ThreadGeneratorScope> scope;
    if (scopes) scope.emplace(11);
    auto impl = std::make_shared<GatedDropImpl>(random);
    impl->gate = [&] {
      a_inside.release();
      b_done.wait();
    };
    torch::nn::ModuleHolder<GatedDropImpl> holder(impl);
    Remat<torch::nn::ModuleHolder<GatedDropImpl>> unit = holder;
    unit = checkpoint_wrapper(unit);
    try {
      run_and_grad([&](const at::Tensor& in) { return unit(in); }, at::ones({16, 8}), {});
    } catch (const RematError& e) {
      a_error = e.what();
    }
  });
  a_inside.wait();
  {
    std::optional<ThreadGeneratorScope> scope;
    if (scopes) scope.emplace(12);
    Remat<torch::nn::ModuleHolder<GatedDropImpl>> unit = std::make_shared<GatedDropImpl>(random);
    unit = checkpoint_wrapper(unit);
    try {
      run_and_grad([&](const at::Tensor& in) { return unit(in); }, at::ones({16, 8}), {});
    } catch (const RematError& e) {
      b_error = e.what();
    }
  }
  b_done.release();
  a.join();
  return {a_error, b_error};
}

// Note [Shared generator detection]: two threads whose units draw from the process-wide
// generator at once is an error naming ThreadGeneratorScope (the unit that closes last reports
// it); with a scope per thread, or without randomness, nothing is reported.
TEST(ThreadGenerators, UnitsDrawingFromTheSharedGeneratorOnTwoThreadsAreAnError) {
  const auto [a_error, b_error] = overlapping_units(/*random=*/true, /*scopes=*/false);
  EXPECT_EQ(b_error, "") << "the unit that closed first saw no conflict yet";
  EXPECT_NE(a_error.find("drew random numbers from LibTorch's process-wide CPU generator while "
                         "checkpoint unit"),
            std::string::npos)
      << a_error;
  EXPECT_NE(a_error.find("pipemat::remat::ThreadGeneratorScope"), std::string::npos) << a_error;
  const auto scoped = overlapping_units(/*random=*/true, /*scopes=*/true);
  EXPECT_EQ(scoped.first, "");
  EXPECT_EQ(scoped.second, "");
  const auto plain = overlapping_units(/*random=*/false, /*scopes=*/false);
  EXPECT_EQ(plain.first, "");
  EXPECT_EQ(plain.second, "");
}

// A unit without randomness leaves the generator alone in replay: a draw of another thread
// during the replay stands (a rewind and restore around the replay would undo it, and the next
// draw would repeat its numbers).
TEST(ThreadGenerators, AUnitThatDrewNothingDoesNotRewindTheGeneratorInReplay) {
  at::manual_seed(5);
  auto impl = std::make_shared<GatedDropImpl>(false);
  torch::nn::ModuleHolder<GatedDropImpl> holder(impl);
  Remat<torch::nn::ModuleHolder<GatedDropImpl>> unit = holder;
  unit = checkpoint_wrapper(unit);
  auto x = at::ones({4, 4}).requires_grad_(true);
  at::Tensor out = unit(x);  // forward: no gate yet
  Latch in_replay, drawn;
  impl->gate = [&] {
    in_replay.release();
    drawn.wait();
  };
  at::Tensor during;
  std::thread other([&] {
    in_replay.wait();
    during = at::randn({3});  // the process-wide generator, while the unit replays
    drawn.release();
  });
  out.sum().backward();  // replays the unit, which waits at the gate
  other.join();
  EXPECT_FALSE(at::equal(at::randn({3}), during)) << "replay undid the other thread's draw";
  EXPECT_TRUE(x.grad().defined());
}

}  // namespace
}  // namespace pipemat::remat::testing
