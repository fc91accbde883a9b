#pragma once
// The causal attention of gpt and llama: the fused kernel, in float32 inside a bf16 (or fp16)
// autocast region (Note [Mixed precision] in pp/precision.h).

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

namespace pipemat::models {

// softmax(q k^T / sqrt(d) + causal mask) v by LibTorch's fused kernel, q, k, v [B, heads, T, d]
// with as many heads each. Of reduced-precision q, k, v (autocast's outputs) the kernel runs in
// float32 with autocast off and the result goes back to q's dtype: the softmax keeps float32's
// range, and on these CPUs the fused kernel's bf16 backward is 3-5x its float32 time (11.96
// against 3.37 ms for [8, 4, 128, 32] on one thread of an AMX Xeon; docs/performance.md, GEMM
// kernels), more than the bf16 GEMMs save. The thread's autocast state is back afterwards (also
// when a remat replay that stopped early unwinds through it).
inline at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true);
  }
  const c10::DeviceType type = q.device().type();
  const bool was = at::autocast::is_autocast_enabled(type);
  at::autocast::set_autocast_enabled(type, false);
  struct Restore {
    c10::DeviceType type;
    bool was;
    ~Restore() { at::autocast::set_autocast_enabled(type, was); }
  } restore{type, was};
  return at::scaled_dot_product_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                                          /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true)
      .to(dtype);
}

}  // namespace pipemat::models
