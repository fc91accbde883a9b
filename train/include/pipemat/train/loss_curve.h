#pragma once
// The loss curve of a training run as an SVG: train loss (every step) and validation loss (each
// evaluation) against the step, on one linear axis.

#include <cstdint>
#include <string>
#include <vector>

namespace pipemat::train {

struct LossPoint {
  int64_t step = 0;  // 1-based: the loss after this many steps
  double loss = 0;
};

// A self-contained SVG document (no scripts, no external references). `title` goes above the
// plot. Non-finite losses are left out.
std::string render_loss_svg(const std::vector<LossPoint>& train,
                            const std::vector<LossPoint>& validation, const std::string& title);

}  // namespace pipemat::train
