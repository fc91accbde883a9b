// render_bench_plan_svg: step time against memory budget (bench_plan.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/bench/plan.h"
#include "pipemat/core/format.h"
#include "pipemat/core/svg.h"

namespace pipemat::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kWidth = 760, kHeight = 440, kLeft = 70, kRight = 170, kTop = 40, kBottom = 50;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;

std::string num(double v) { return format_fixed(v, 1); }

double max_peak(const BenchPlanRun& run) {
  double out = 0;
  for (int64_t p : run.peak_bytes) out = std::max(out, static_cast<double>(p));
  return out;
}

// The plotted ranges: budgets and peaks in MiB across, steps in ms up (ticks every y_step).
struct PlanAxes {
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = 0, y_step = 1;
  double x(double mib) const { return kLeft + kPlotW * (mib - x_lo) / (x_hi - x_lo); }
  double y(double ms) const { return kTop + kPlotH * (y_hi - ms) / (y_hi - y_lo); }
};

PlanAxes plan_axes(const BenchPlanReport& report) {
  PlanAxes a;
  for (const BenchPlanBudget& b : report.budgets) {
    if (!b.infeasible.empty()) continue;
    a.x_lo = std::min(a.x_lo, b.budget / kMiB);
    a.x_hi = std::max(a.x_hi, b.budget / kMiB);
    a.y_lo = std::min({a.y_lo, b.plan.step_ms, b.plan.predicted_step_ms});
    a.y_hi = std::max({a.y_hi, b.plan.step_ms, b.plan.predicted_step_ms});
  }
  for (const BenchPlanRun& u : report.uniform) {
    a.x_lo = std::min(a.x_lo, max_peak(u) / kMiB);
    a.x_hi = std::max(a.x_hi, max_peak(u) / kMiB);
    a.y_lo = std::min(a.y_lo, u.step_ms);
    a.y_hi = std::max(a.y_hi, u.step_ms);
  }
  if (!std::isfinite(a.x_lo)) a.x_lo = 0, a.x_hi = 1;
  if (!std::isfinite(a.y_lo)) a.y_lo = 0, a.y_hi = 1;
  a.x_lo = std::floor(a.x_lo) - 1;
  a.x_hi = std::ceil(a.x_hi) + 1;
  // The step axis spans the values with a margin (not from 0: the differences are a few
  // percent), ticks at a round step giving about 6 of them.
  const double span = std::max(1.0, a.y_hi - a.y_lo);
  for (double s : {1.0, 2.0, 5.0, 10.0, 20.0, 25.0, 50.0, 100.0, 200.0, 500.0, 1000.0}) {
    a.y_step = s;
    if (span * 1.3 / s <= 7) break;
  }
  a.y_lo = std::max(0.0, std::floor((a.y_lo - 0.15 * span) / a.y_step) * a.y_step);
  a.y_hi = std::ceil((a.y_hi + 0.15 * span) / a.y_step) * a.y_step;
  return a;
}

// Axes with ticks: x every MiB step that gives about 8 ticks, y every y_step ms.
void draw_axes(SvgWriter& svg, const PlanAxes& a) {
  const double bottom = a.y(a.y_lo);
  svg.line({{"x1", kLeft},
            {"y1", bottom},
            {"x2", kLeft + kPlotW},
            {"y2", bottom},
            {"stroke", "black"}})
      .newline();
  svg.line({{"x1", kLeft}, {"y1", kTop}, {"x2", kLeft}, {"y2", bottom}, {"stroke", "black"}})
      .newline();
  const double x_step = std::max(1.0, std::round((a.x_hi - a.x_lo) / 8));
  for (double v = a.x_lo; v <= a.x_hi + 1e-9; v += x_step) {
    svg.text({{"x", num(a.x(v))}, {"y", bottom + 16}, {"text-anchor", "middle"}}, num(v)).newline();
  }
  for (double v = a.y_lo; v <= a.y_hi + 1e-9; v += a.y_step) {
    svg.text({{"x", kLeft - 6}, {"y", num(a.y(v) + 4)}, {"text-anchor", "end"}}, num(v)).newline();
    svg.line({{"x1", kLeft},
              {"y1", num(a.y(v))},
              {"x2", kLeft + kPlotW},
              {"y2", num(a.y(v))},
              {"stroke", "#eee"}})
        .newline();
  }
  const double middle = kTop + kPlotH / 2;
  svg.text({{"x", kLeft + kPlotW / 2}, {"y", kHeight - 12}, {"text-anchor", "middle"}},
           "memory budget per rank (MiB)")
      .newline();
  svg.text({{"x", 16},
            {"y", middle},
            {"transform", "rotate(-90 16 " + svg_number(middle) + ")"},
            {"text-anchor", "middle"}},
           "step (ms)")
      .newline();
}

// The legend on the right, one line per call, downwards.
struct PlanLegend {
  SvgWriter& svg;
  double y = kTop + 10;
  void add(const std::string& color, const std::string& label, bool dashed) {
    SvgWriter::Attrs line = {{"x1", kWidth - kRight + 14},
                             {"y1", y},
                             {"x2", kWidth - kRight + 38},
                             {"y2", y},
                             {"stroke", color},
                             {"stroke-width", 2}};
    if (dashed) line.emplace_back("stroke-dasharray", "5,4");
    svg.line(line).newline();
    svg.text({{"x", kWidth - kRight + 44}, {"y", y + 4}}, label).newline();
    y += 18;
  }
};

// A uniform policy: its measured step from its measured peak (where it starts to fit) on.
void draw_uniform(SvgWriter& svg, PlanLegend& legend, const BenchPlanReport& report,
                  const PlanAxes& a) {
  const char* colors[] = {"#999999", "#d62728", "#ff7f0e"};
  for (size_t i = 0; i < report.uniform.size(); ++i) {
    const BenchPlanRun& u = report.uniform[i];
    const std::string color = colors[i % 3];
    const double from = std::max(a.x_lo, max_peak(u) / kMiB);
    if (from <= a.x_hi) {
      svg.line({{"x1", num(a.x(from))},
                {"y1", num(a.y(u.step_ms))},
                {"x2", num(a.x(a.x_hi))},
                {"y2", num(a.y(u.step_ms))},
                {"stroke", color},
                {"stroke-width", 2}})
          .newline();
      svg.circle({{"cx", num(a.x(from))}, {"cy", num(a.y(u.step_ms))}, {"r", 3}, {"fill", color}})
          .newline();
    }
    legend.add(color, "uniform " + u.policy, false);
  }
}

// The plan: measured (solid) and predicted (dashed) per feasible budget.
void draw_plan(SvgWriter& svg, PlanLegend& legend, const BenchPlanReport& report,
               const PlanAxes& a) {
  for (int predicted = 0; predicted < 2; ++predicted) {
    std::vector<std::pair<double, double>> points;
    for (const BenchPlanBudget& b : report.budgets) {
      if (!b.infeasible.empty()) continue;
      const double ms = predicted ? b.plan.predicted_step_ms : b.plan.step_ms;
      points.emplace_back(a.x(b.budget / kMiB), a.y(ms));
      if (!predicted) {
        svg.circle({{"cx", num(points.back().first)},
                    {"cy", num(points.back().second)},
                    {"r", 4},
                    {"fill", "#1f77b4"}})
            .newline();
      }
    }
    SvgWriter::Attrs line = {{"fill", "none"}, {"stroke", "#1f77b4"}, {"stroke-width", 2}};
    if (predicted) line.emplace_back("stroke-dasharray", "5,4");
    line.emplace_back("points", svg_points(points));
    svg.polyline(line).newline();
    legend.add("#1f77b4", predicted ? "plan, predicted" : "plan, measured", predicted != 0);
  }
}

}  // namespace

std::string render_bench_plan_svg(const BenchPlanReport& report) {
  const PlanAxes axes = plan_axes(report);
  SvgWriter svg(kWidth, kHeight, {{"font-family", "sans-serif"}, {"font-size", 12}}, "white");
  svg.text({{"x", kLeft}, {"y", 22}, {"font-size", 14}},
           "step time vs memory budget (pipemat bench plan)")
      .newline();
  draw_axes(svg, axes);
  PlanLegend legend{svg};
  draw_uniform(svg, legend, report, axes);
  draw_plan(svg, legend, report, axes);
  return svg.finish();
}

}  // namespace pipemat::bench
