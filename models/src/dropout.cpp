#include "pipemat/models/dropout.h"

#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

#include "pipemat/core/error.h"

namespace pipemat::models {
namespace {

// murmur3's 32-bit finalizer: every input bit reaches every output bit.
inline uint32_t fmix(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Element i's 32 random bits: two rounds keyed by the two halves of the seed.
inline uint32_t bits(uint32_t i, uint32_t key0, uint32_t key1) {
  return fmix(fmix(i * 0x9E3779B9u ^ key0) + key1);
}

// noise[i] = 0 when bits(i) < threshold, else scale. Blocks of a fixed width so that the
// compiler vectorizes the 32-bit multiplies at -O2, with an AVX2 clone picked at load time
// where the CPU has it (integer arithmetic: every clone computes the same mask).
__attribute__((target_clones("avx2", "default"))) void fill_noise(float* out, int64_t n,
                                                                  uint64_t seed, uint32_t threshold,
                                                                  float scale) {
  constexpr int64_t kBlock = 16;
  const auto key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) {
      const uint32_t b = bits(static_cast<uint32_t>(i + j), key0, key1);
      out[i + j] = b < threshold ? 0.0f : scale;
    }
  }
  for (; i < n; ++i) out[i] = bits(static_cast<uint32_t>(i), key0, key1) < threshold ? 0.0f : scale;
}

}  // namespace

at::Tensor counter_dropout(const at::Tensor& x, double p, bool train) {
  PIPEMAT_CHECK(p >= 0 && p < 1, ConfigError, "dropout: p ", p, " is outside [0, 1)");
  if (!train || p == 0) return x;
  const bool low = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (x.scalar_type() != at::kFloat && !low) return at::dropout(x, p, train);
  PIPEMAT_CHECK(x.numel() <= (int64_t{1} << 32), ConfigError, "dropout: ", x.numel(),
                " elements are more than the 2^32 a mask counts");
  // One draw from the current generator (see the Note in the header).
  const auto seed =
      static_cast<uint64_t>(at::empty({}, x.options().dtype(at::kLong)).random_().item<int64_t>());
  at::Tensor noise = at::empty(x.sizes(), x.options().dtype(at::kFloat).requires_grad(false));
  fill_noise(noise.data_ptr<float>(), noise.numel(), seed, static_cast<uint32_t>(std::ldexp(p, 32)),
             static_cast<float>(1.0 / (1.0 - p)));
  // bf16 / half (under autocast): the same mask, the scale rounded to x's dtype.
  return x * (low ? noise.to(x.scalar_type()) : noise);
}

CounterDropoutImpl::CounterDropoutImpl(double p_) : p(p_) {
  PIPEMAT_CHECK(p >= 0 && p < 1, ConfigError, "dropout: p ", p, " is outside [0, 1)");
}

at::Tensor CounterDropoutImpl::forward(const at::Tensor& x) {
  return counter_dropout(x, p, is_training());
}

}  // namespace pipemat::models
