#pragma once
// LibTorch's scalar types as the safetensors format spells its dtypes (pipemat/weights), for what
// pipemat stores in safetensors files: checkpoints (pipemat/pp/checkpoint.h) and exported
// weights. Defined in src/checkpoint_state.cpp.

#include <c10/core/ScalarType.h>

#include <string>

#include "pipemat/weights/safetensors.h"

namespace pipemat::pp {

// The dtype of a tensor of `type`; PipelineError naming `what` (e.g. "stage 1's parameter 'w'")
// for a type safetensors has no spelling for (complex, the quantized ones).
weights::Dtype safetensors_dtype(at::ScalarType type, const std::string& what);
// The scalar type of a tensor of `dtype`.
at::ScalarType scalar_type_of(weights::Dtype dtype);

}  // namespace pipemat::pp
