#include <array>
#include <utility>

#include "pipemat/weights/safetensors.h"

namespace pipemat::weights {
namespace {

struct DtypeRow {
  Dtype dtype;
  const char* name;
  int64_t size;
};

constexpr std::array<DtypeRow, 10> kDtypes{{{Dtype::kF64, "F64", 8},
                                            {Dtype::kF32, "F32", 4},
                                            {Dtype::kF16, "F16", 2},
                                            {Dtype::kBF16, "BF16", 2},
                                            {Dtype::kI64, "I64", 8},
                                            {Dtype::kI32, "I32", 4},
                                            {Dtype::kI16, "I16", 2},
                                            {Dtype::kI8, "I8", 1},
                                            {Dtype::kU8, "U8", 1},
                                            {Dtype::kBool, "BOOL", 1}}};

const DtypeRow& row(Dtype dtype) {
  for (const DtypeRow& r : kDtypes) {
    if (r.dtype == dtype) return r;
  }
  PIPEMAT_INTERNAL_ASSERT(false, "dtype ", static_cast<int>(dtype), " has no row");
  return kDtypes[0];
}

}  // namespace

const char* to_string(Dtype dtype) { return row(dtype).name; }

std::optional<Dtype> dtype_from_string(std::string_view text) {
  for (const DtypeRow& r : kDtypes) {
    if (text == r.name) return r.dtype;
  }
  return std::nullopt;
}

int64_t element_size(Dtype dtype) { return row(dtype).size; }

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace pipemat::weights
