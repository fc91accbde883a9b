#pragma once
// Mixed precision of a pipeline (Note [Mixed precision]): the precision setting, the autocast
// region of one stage forward, and the loss's float32 inputs.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

namespace pipemat::pp {

// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// kBFloat16: each stage forward (an F, a forward of evaluate, the reference's chained stage)
// runs in an autocast region of its own, to bf16 on its device's type (CPU or CUDA), opened
// and closed around that one forward, so no cached weight cast outlives it (never an optimizer
// step). Parameters, their gradients, the data-parallel exchange, clipping and the optimizer
// stay float32: autocast casts the float32 weights inside the region, and a cast's backward
// gives the float32 weight its gradient. Stage outputs are what autocast made them (bf16 for a
// GEMM's output): they cross ranks as bf16 and their gradients come back in that dtype. The
// last stage's floating outputs become float32 before the loss (loss_inputs), which is computed
// outside the region. A replay of a checkpoint unit runs under the autocast state its forward
// recorded (Note [Autocast in replay] in remat), so remat stays exact under either precision,
// and a one-process chain that opens the same region per stage equals the pipeline bitwise.
enum class Precision { kFloat32, kBFloat16 };

// "fp32" / "bf16".
const char* to_string(Precision precision);
// The precision named `text` ("fp32", "bf16"), or nothing.
std::optional<Precision> parse_precision(const std::string& text);

// One stage forward's autocast region for `precision` on `device`'s type: nothing for
// kFloat32; for kBFloat16 autocast on to bf16 for that device type, a fresh region (nesting
// counted, the cast cache cleared when it ends at nesting 0), and the thread's previous
// autocast state of that type back afterwards. Not copyable; on the forward's thread.
class PrecisionRegion {
 public:
  PrecisionRegion(Precision precision, c10::Device device);
  ~PrecisionRegion();
  PrecisionRegion(const PrecisionRegion&) = delete;
  PrecisionRegion& operator=(const PrecisionRegion&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType type_ = c10::DeviceType::CPU;
  bool was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::ScalarType::Float;
};

// The last stage's outputs as the loss takes them: under kBFloat16 every floating tensor of a
// lower precision becomes float32 (a differentiable cast); others, and all under kFloat32, as
// they are.
std::vector<at::Tensor> loss_inputs(std::vector<at::Tensor> outputs, Precision precision);

}  // namespace pipemat::pp
