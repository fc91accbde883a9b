#pragma once
// Note [Counter-based dropout]
// LibTorch 1.13's CPU dropout draws every mask element from the
// generator one at a time (bernoulli_, about 13 ns per element here): in the main job's GPT that
// was about a tenth of each rank's step, since a block's residual dropouts run again in every
// replay. `counter_dropout` draws one 64-bit seed from the current generator (a `random_` op,
// so remat's per-thread generator and a replay's rewound generator apply as to any random op)
// and derives element i's keep bit from a hash of (seed, i) (two rounds of murmur3's 32-bit
// finalizer, vectorized): the same seed gives the same mask, so a replay reproduces the
// forward's masks, and one draw per call keeps the generator's stream as short as a scalar
// op's.
//
// The output is x * noise with noise = 0 or 1 / (1 - p), as at::dropout computes it; float32,
// and bf16 / half (autocast's outputs: the same mask, the scale rounded to that dtype); other
// dtypes use at::dropout; at most 2^32 elements. The keep probability is 1 - p to 2^-32.

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

namespace pipemat::models {

// Identity unless `train` and p > 0; p outside [0, 1) is a ConfigError.
at::Tensor counter_dropout(const at::Tensor& x, double p, bool train);

// The module form, following the module's train/eval mode.
struct CounterDropoutImpl : torch::nn::Cloneable<CounterDropoutImpl> {
  explicit CounterDropoutImpl(double p = 0.5);
  void reset() override {}
  at::Tensor forward(const at::Tensor& x);
  double p;
};
TORCH_MODULE(CounterDropout);

}  // namespace pipemat::models
