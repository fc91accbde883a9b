#pragma once
// Note [Non-finite values at load]
// A NaN or an infinity in a weight that is loaded is refused where it is loaded, naming the file,
// the tensor and the first index: in a checkpoint a run resumes from (every tensor of a rank or
// shard file: the parameters, the buffers and the optimizer state) or samples and exports (the
// parameters and buffers it reads), in safetensors weights (training.init_from,
// `pipemat generate`, `pipemat export`'s reads), after the conversion to the model's dtype (a
// finite F64 beyond float32's range is an infinity there). Left alone, one would show up steps
// later as a diverged loss blamed on the learning rate, or not at all where the rows it sits in
// are never used, and `generate` would sample from NaN probabilities. training.allow_non_finite:
// true loads such weights (and trains on without the divergence stop). The check is one pass
// (an isfinite reduction) per floating-point tensor; the index is searched only when it fails.

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

namespace pipemat::pp {

// What is wrong with `t`, or nothing when every element is finite (only floating-point tensors
// are checked): "holds NaN at index [3, 17] (shape [64, 128])".
std::optional<std::string> non_finite(const at::Tensor& t);

// The sentence every refusal ends with.
inline constexpr const char* kNonFiniteAdvice =
    "a non-finite weight is refused at load (the file is damaged, or was written by a run that "
    "diverged); training.allow_non_finite: true loads it anyway";

}  // namespace pipemat::pp
