#include "pipemat/train/loss_curve.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "pipemat/core/format.h"
#include "pipemat/core/svg.h"

namespace pipemat::train {
namespace {

constexpr double kWidth = 720, kHeight = 420, kLeft = 60, kRight = 20, kTop = 40, kBottom = 50;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;

std::string num(double v) { return format_fixed(v, 1); }

// Steps from 0 to the last across, losses between half-units around the finite ones up.
struct LossAxes {
  int64_t max_step = 1;
  double lo = INFINITY, hi = -INFINITY;
  double x(int64_t step) const { return kLeft + kPlotW * static_cast<double>(step) / max_step; }
  double y(double loss) const { return kTop + kPlotH * (hi - loss) / (hi - lo); }
};

LossAxes loss_axes(const std::vector<LossPoint>& train, const std::vector<LossPoint>& validation) {
  LossAxes a;
  for (const auto* points : {&train, &validation}) {
    for (const LossPoint& p : *points) {
      if (!std::isfinite(p.loss)) continue;
      a.max_step = std::max(a.max_step, p.step);
      a.lo = std::min(a.lo, p.loss);
      a.hi = std::max(a.hi, p.loss);
    }
  }
  if (!std::isfinite(a.lo)) a.lo = 0, a.hi = 1;
  a.lo = std::floor(std::max(0.0, a.lo) * 2) / 2;
  a.hi = std::max(a.lo + 0.5, std::ceil(a.hi * 2) / 2);
  return a;
}

// Axes with ticks: five on each.
void draw_loss_axes(SvgWriter& svg, const LossAxes& a) {
  for (int i = 0; i <= 5; ++i) {
    const double loss = a.lo + (a.hi - a.lo) * i / 5.0;
    const double y = a.y(loss);
    svg.line({{"x1", kLeft},
              {"y1", num(y)},
              {"x2", kWidth - kRight},
              {"y2", num(y)},
              {"stroke", "#e5e5e5"}})
        .newline();
    svg.text({{"x", kLeft - 6}, {"y", num(y + 4)}, {"text-anchor", "end"}}, format_fixed(loss, 2))
        .newline();
    const auto step = static_cast<int64_t>(std::llround(static_cast<double>(a.max_step) * i / 5.0));
    svg.text({{"x", num(a.x(step))}, {"y", kHeight - kBottom + 16}, {"text-anchor", "middle"}},
             std::to_string(step))
        .newline();
  }
  const double middle = kTop + kPlotH / 2;
  svg.text({{"x", kLeft + kPlotW / 2}, {"y", kHeight - 12}, {"text-anchor", "middle"}}, "step")
      .newline();
  svg.text({{"x", 16},
            {"y", middle},
            {"transform", "rotate(-90 16 " + svg_number(middle) + ")"},
            {"text-anchor", "middle"}},
           "loss (nats)")
      .newline();
}

// The finite losses of `points` as a line, with a dot on each when `dots`.
void draw_loss_curve(SvgWriter& svg, const LossAxes& a, const std::vector<LossPoint>& points,
                     const char* color, bool dots) {
  std::vector<std::pair<double, double>> xy;
  for (const LossPoint& p : points) {
    if (!std::isfinite(p.loss)) continue;
    xy.emplace_back(a.x(p.step), a.y(p.loss));
    if (dots) {
      svg.circle({{"cx", num(xy.back().first)},
                  {"cy", num(xy.back().second)},
                  {"r", 3},
                  {"fill", color}})
          .newline();
    }
  }
  if (xy.empty()) return;
  svg.polyline(
         {{"fill", "none"}, {"stroke", color}, {"stroke-width", 1.5}, {"points", svg_points(xy)}})
      .newline();
}

void draw_legend_entry(SvgWriter& svg, double y, const char* color, const char* label) {
  const double x = kWidth - kRight - 150;
  svg.line(
         {{"x1", x}, {"y1", y}, {"x2", x + 20}, {"y2", y}, {"stroke", color}, {"stroke-width", 2}})
      .text({{"x", x + 26}, {"y", y + 4}}, label)
      .newline();
}

}  // namespace

std::string render_loss_svg(const std::vector<LossPoint>& train,
                            const std::vector<LossPoint>& validation, const std::string& title) {
  const LossAxes axes = loss_axes(train, validation);
  SvgWriter svg(kWidth, kHeight, {{"font-family", "sans-serif"}, {"font-size", 12}}, "white");
  svg.text({{"x", kLeft}, {"y", 24}, {"font-size", 14}}, title).newline();
  draw_loss_axes(svg, axes);
  draw_loss_curve(svg, axes, train, "#1f77b4", false);
  draw_loss_curve(svg, axes, validation, "#d62728", true);
  draw_legend_entry(svg, kTop + 10, "#1f77b4", "train");
  if (!validation.empty()) draw_legend_entry(svg, kTop + 28, "#d62728", "validation");
  return svg.finish();
}

}  // namespace pipemat::train
