// Note [Non-finite values at load] in pipemat/pp/finite.h.

#include "pipemat/pp/finite.h"

#include <ATen/ATen.h>

#include <cmath>
#include <sstream>

namespace pipemat::pp {
namespace {

std::string list(at::IntArrayRef values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

}  // namespace

std::optional<std::string> non_finite(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point() || t.numel() == 0) {
    return std::nullopt;
  }
  const at::Tensor finite = at::isfinite(t);
  if (finite.all().item<bool>()) return std::nullopt;
  // The first bad element in row-major order: its flat position, then its index.
  const int64_t flat = finite.reshape({-1}).logical_not().nonzero().select(1, 0)[0].item<int64_t>();
  std::vector<int64_t> index(static_cast<size_t>(t.dim()));
  int64_t rest = flat;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    index[static_cast<size_t>(d)] = rest % t.size(d);
    rest /= t.size(d);
  }
  const double value = t.reshape({-1})[flat].to(at::kDouble).item<double>();
  const std::string what = std::isnan(value) ? "NaN" : (value > 0 ? "+Inf" : "-Inf");
  return "holds " + what + " at index " + list(index) + " (shape " + list(t.sizes()) + ")";
}

}  // namespace pipemat::pp
