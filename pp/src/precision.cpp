// Note [Mixed precision] (pipemat/pp/precision.h).

#include "pipemat/pp/precision.h"

#include <ATen/autocast_mode.h>

namespace pipemat::pp {

const char* to_string(Precision precision) {
  return precision == Precision::kBFloat16 ? "bf16" : "fp32";
}

std::optional<Precision> parse_precision(const std::string& text) {
  if (text == "fp32") return Precision::kFloat32;
  if (text == "bf16") return Precision::kBFloat16;
  return std::nullopt;
}

PrecisionRegion::PrecisionRegion(Precision precision, c10::Device device)
    : active_(precision == Precision::kBFloat16), type_(device.type()) {
  if (!active_) return;
  was_enabled_ = at::autocast::is_autocast_enabled(type_);
  was_dtype_ = at::autocast::get_autocast_dtype(type_);
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::set_autocast_dtype(type_, at::kBFloat16);
  at::autocast::increment_nesting();
}

PrecisionRegion::~PrecisionRegion() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, was_enabled_);
  at::autocast::set_autocast_dtype(type_, was_dtype_);
}

std::vector<at::Tensor> loss_inputs(std::vector<at::Tensor> outputs, Precision precision) {
  if (precision == Precision::kFloat32) return outputs;
  for (auto& t : outputs) {
    if (t.defined() && at::isReducedFloatingType(t.scalar_type())) t = t.to(at::kFloat);
  }
  return outputs;
}

}  // namespace pipemat::pp
