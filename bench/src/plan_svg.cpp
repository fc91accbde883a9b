// render_bench_plan_svg: step time against memory budget (bench_plan.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "pipemat/bench/plan.h"

namespace pipemat::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

double max_peak(const BenchPlanRun& run) {
  double out = 0;
  for (int64_t p : run.peak_bytes) out = std::max(out, static_cast<double>(p));
  return out;
}

}  // namespace

std::string render_bench_plan_svg(const BenchPlanReport& report) {
  constexpr double kWidth = 760, kHeight = 440, kLeft = 70, kRight = 170, kTop = 40, kBottom = 50;
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = 0;
  for (const BenchPlanBudget& b : report.budgets) {
    if (!b.infeasible.empty()) continue;
    x_lo = std::min(x_lo, b.budget / kMiB);
    x_hi = std::max(x_hi, b.budget / kMiB);
    y_lo = std::min({y_lo, b.plan.step_ms, b.plan.predicted_step_ms});
    y_hi = std::max({y_hi, b.plan.step_ms, b.plan.predicted_step_ms});
  }
  for (const BenchPlanRun& u : report.uniform) {
    x_lo = std::min(x_lo, max_peak(u) / kMiB);
    x_hi = std::max(x_hi, max_peak(u) / kMiB);
    y_lo = std::min(y_lo, u.step_ms);
    y_hi = std::max(y_hi, u.step_ms);
  }
  if (!std::isfinite(x_lo)) x_lo = 0, x_hi = 1;
  if (!std::isfinite(y_lo)) y_lo = 0, y_hi = 1;
  x_lo = std::floor(x_lo) - 1;
  x_hi = std::ceil(x_hi) + 1;
  // The step axis spans the values with a margin (not from 0: the differences are a few
  // percent), ticks at a round step giving about 6 of them.
  const double span = std::max(1.0, y_hi - y_lo);
  double y_step = 1;
  for (double s : {1.0, 2.0, 5.0, 10.0, 20.0, 25.0, 50.0, 100.0, 200.0, 500.0, 1000.0}) {
    y_step = s;
    if (span * 1.3 / s <= 7) break;
  }
  y_lo = std::max(0.0, std::floor((y_lo - 0.15 * span) / y_step) * y_step);
  y_hi = std::ceil((y_hi + 0.15 * span) / y_step) * y_step;
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  const auto x = [&](double mib) { return kLeft + plot_w * (mib - x_lo) / (x_hi - x_lo); };
  const auto y = [&](double ms) { return kTop + plot_h * (y_hi - ms) / (y_hi - y_lo); };

  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << kLeft << "\" y=\"22\" font-size=\"14\">step time vs memory budget "
     << "(pipemat bench plan)</text>\n";
  // Axes with ticks: x every MiB step that gives about 8 ticks, y every y_step ms.
  os << "<line x1=\"" << kLeft << "\" y1=\"" << y(y_lo) << "\" x2=\"" << kLeft + plot_w
     << "\" y2=\"" << y(y_lo) << "\" stroke=\"black\"/>\n"
     << "<line x1=\"" << kLeft << "\" y1=\"" << kTop << "\" x2=\"" << kLeft << "\" y2=\"" << y(y_lo)
     << "\" stroke=\"black\"/>\n";
  const double x_step = std::max(1.0, std::round((x_hi - x_lo) / 8));
  for (double v = x_lo; v <= x_hi + 1e-9; v += x_step) {
    os << "<text x=\"" << num(x(v)) << "\" y=\"" << y(y_lo) + 16 << "\" text-anchor=\"middle\">"
       << num(v) << "</text>\n";
  }
  for (double v = y_lo; v <= y_hi + 1e-9; v += y_step) {
    os << "<text x=\"" << kLeft - 6 << "\" y=\"" << num(y(v) + 4) << "\" text-anchor=\"end\">"
       << num(v) << "</text>\n"
       << "<line x1=\"" << kLeft << "\" y1=\"" << num(y(v)) << "\" x2=\"" << kLeft + plot_w
       << "\" y2=\"" << num(y(v)) << "\" stroke=\"#eee\"/>\n";
  }
  os << "<text x=\"" << kLeft + plot_w / 2 << "\" y=\"" << kHeight - 12
     << "\" text-anchor=\"middle\">memory budget per rank (MiB)</text>\n"
     << "<text x=\"16\" y=\"" << kTop + plot_h / 2 << "\" transform=\"rotate(-90 16 "
     << kTop + plot_h / 2 << ")\" text-anchor=\"middle\">step (ms)</text>\n";

  // A uniform policy: its measured step from its measured peak (where it starts to fit) on.
  const char* uniform_colors[] = {"#999999", "#d62728", "#ff7f0e"};
  double legend_y = kTop + 10;
  const auto legend = [&](const std::string& color, const std::string& label, bool dashed) {
    os << "<line x1=\"" << kWidth - kRight + 14 << "\" y1=\"" << legend_y << "\" x2=\""
       << kWidth - kRight + 38 << "\" y2=\"" << legend_y << "\" stroke=\"" << color
       << "\" stroke-width=\"2\"" << (dashed ? " stroke-dasharray=\"5,4\"" : "") << "/>\n"
       << "<text x=\"" << kWidth - kRight + 44 << "\" y=\"" << legend_y + 4 << "\">" << label
       << "</text>\n";
    legend_y += 18;
  };
  for (size_t i = 0; i < report.uniform.size(); ++i) {
    const BenchPlanRun& u = report.uniform[i];
    const std::string color = uniform_colors[i % 3];
    const double from = std::max(x_lo, max_peak(u) / kMiB);
    if (from <= x_hi) {
      os << "<line x1=\"" << num(x(from)) << "\" y1=\"" << num(y(u.step_ms)) << "\" x2=\""
         << num(x(x_hi)) << "\" y2=\"" << num(y(u.step_ms)) << "\" stroke=\"" << color
         << "\" stroke-width=\"2\"/>\n"
         << "<circle cx=\"" << num(x(from)) << "\" cy=\"" << num(y(u.step_ms))
         << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    }
    legend(color, "uniform " + u.policy, false);
  }
  // The plan: measured (solid) and predicted (dashed) per feasible budget.
  for (int predicted = 0; predicted < 2; ++predicted) {
    std::ostringstream points;
    for (const BenchPlanBudget& b : report.budgets) {
      if (!b.infeasible.empty()) continue;
      const double ms = predicted ? b.plan.predicted_step_ms : b.plan.step_ms;
      points << num(x(b.budget / kMiB)) << "," << num(y(ms)) << " ";
      if (!predicted) {
        os << "<circle cx=\"" << num(x(b.budget / kMiB)) << "\" cy=\"" << num(y(ms))
           << "\" r=\"4\" fill=\"#1f77b4\"/>\n";
      }
    }
    os << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\""
       << (predicted ? " stroke-dasharray=\"5,4\"" : "") << " points=\"" << points.str()
       << "\"/>\n";
    legend("#1f77b4", predicted ? "plan, predicted" : "plan, measured", predicted != 0);
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace pipemat::bench
