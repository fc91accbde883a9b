#include "pipemat/train/loss_curve.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace pipemat::train {
namespace {

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", v);
  return buf;
}

}  // namespace

std::string render_loss_svg(const std::vector<LossPoint>& train,
                            const std::vector<LossPoint>& validation, const std::string& title) {
  constexpr double kWidth = 720, kHeight = 420, kLeft = 60, kRight = 20, kTop = 40, kBottom = 50;
  int64_t max_step = 1;
  double lo = INFINITY, hi = -INFINITY;
  for (const auto* points : {&train, &validation}) {
    for (const LossPoint& p : *points) {
      if (!std::isfinite(p.loss)) continue;
      max_step = std::max(max_step, p.step);
      lo = std::min(lo, p.loss);
      hi = std::max(hi, p.loss);
    }
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  lo = std::floor(std::max(0.0, lo) * 2) / 2;
  hi = std::max(lo + 0.5, std::ceil(hi * 2) / 2);
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto x = [&](int64_t step) { return kLeft + plot_w * static_cast<double>(step) / max_step; };
  auto y = [&](double loss) { return kTop + plot_h * (hi - loss) / (hi - lo); };
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kLeft << "\" y=\"24\" font-size=\"14\">" << escape(title) << "</text>\n";
  // Axes with ticks: five on each.
  for (int i = 0; i <= 5; ++i) {
    const double loss = lo + (hi - lo) * i / 5.0;
    const double yy = y(loss);
    char label[32];
    std::snprintf(label, sizeof(label), "%.2f", loss);
    svg << "<line x1=\"" << kLeft << "\" y1=\"" << num(yy) << "\" x2=\"" << kWidth - kRight
        << "\" y2=\"" << num(yy) << "\" stroke=\"#e5e5e5\"/>\n"
        << "<text x=\"" << kLeft - 6 << "\" y=\"" << num(yy + 4) << "\" text-anchor=\"end\">"
        << label << "</text>\n";
    const auto step = static_cast<int64_t>(std::llround(static_cast<double>(max_step) * i / 5.0));
    svg << "<text x=\"" << num(x(step)) << "\" y=\"" << kHeight - kBottom + 16
        << "\" text-anchor=\"middle\">" << step << "</text>\n";
  }
  svg << "<text x=\"" << kLeft + plot_w / 2 << "\" y=\"" << kHeight - 12
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text x=\"16\" y=\"" << kTop + plot_h / 2 << "\" transform=\"rotate(-90 16 "
      << kTop + plot_h / 2 << ")\" text-anchor=\"middle\">loss (nats)</text>\n";
  auto polyline = [&](const std::vector<LossPoint>& points, const char* color, bool dots) {
    std::string path;
    for (const LossPoint& p : points) {
      if (!std::isfinite(p.loss)) continue;
      path += num(x(p.step)) + "," + num(y(p.loss)) + " ";
      if (dots) {
        svg << "<circle cx=\"" << num(x(p.step)) << "\" cy=\"" << num(y(p.loss))
            << "\" r=\"3\" fill=\"" << color << "\"/>\n";
      }
    }
    if (!path.empty()) {
      svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\""
          << path << "\"/>\n";
    }
  };
  polyline(train, "#1f77b4", false);
  polyline(validation, "#d62728", true);
  const double legend_x = kWidth - kRight - 150;
  svg << "<line x1=\"" << legend_x << "\" y1=\"" << kTop + 10 << "\" x2=\"" << legend_x + 20
      << "\" y2=\"" << kTop + 10 << "\" stroke=\"#1f77b4\" stroke-width=\"2\"/><text x=\""
      << legend_x + 26 << "\" y=\"" << kTop + 14 << "\">train</text>\n";
  if (!validation.empty()) {
    svg << "<line x1=\"" << legend_x << "\" y1=\"" << kTop + 28 << "\" x2=\"" << legend_x + 20
        << "\" y2=\"" << kTop + 28 << "\" stroke=\"#d62728\" stroke-width=\"2\"/><text x=\""
        << legend_x + 26 << "\" y=\"" << kTop + 32 << "\">validation</text>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace pipemat::train
