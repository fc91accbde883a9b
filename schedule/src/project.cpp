#include "pipemat/schedule/project.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/schedule/command.h"

namespace pipemat::schedule {
namespace {

// The per-stage costs of a schedule with `stages_count` model stages.
CostModel stage_costs(const ProjectionOptions& o, int stages_count) {
  const double n = static_cast<double>(o.layers) / stages_count;
  const CostModel& l = o.layer_costs;
  CostModel c = l;
  c.forward = l.forward * n;
  c.backward_input = l.backward_input * n;
  c.backward_weight = l.backward_weight * n;
  c.backward = l.backward_cost() * n;
  c.recompute = l.recompute_cost(o.recompute) * n;
  return c;
}

}  // namespace

double projection_reference_step(const ProjectionOptions& o, int micro_batches) {
  return o.layers * (o.layer_costs.forward + o.layer_costs.backward_cost()) * micro_batches;
}

std::vector<ProjectionPoint> project_scaling(const ProjectionOptions& o) {
  PIPEMAT_CHECK(!o.kinds.empty() && !o.ranks.empty() && !o.micro_batches.empty(), ConfigError,
                "project: give at least one schedule, one stage count and one micro-batch count");
  PIPEMAT_CHECK(o.layers >= 1 && o.layers <= 1 << 20, ConfigError, "project: --layers ", o.layers,
                " is outside [1, 1048576]");
  for (int p : o.ranks)
    PIPEMAT_CHECK(p >= 2 && p <= 4096, ConfigError, "project: --ranks ", p,
                  " is outside [2, 4096]; a projection is of pipelines");
  for (int m : o.micro_batches)
    PIPEMAT_CHECK(m >= 1 && m <= 4096, ConfigError, "project: --micro-batches ", m,
                  " is outside [1, 4096]");
  PIPEMAT_CHECK(o.layer_costs.forward + o.layer_costs.backward_cost() > 0, ConfigError,
                "project: the per-layer costs are all zero; give e.g. --costs F=1,I=1,W=1");
  std::vector<ProjectionPoint> points;
  for (ScheduleKind kind : o.kinds) {
    for (int p : o.ranks) {
      for (int m : o.micro_batches) {
        ProjectionPoint point;
        point.kind = kind;
        point.ranks = p;
        point.micro_batches = m;
        ScheduleOptions so;
        so.kind = kind;
        so.ranks = p;
        so.micro_batches = m;
        so.virtual_stages = kind == ScheduleKind::kInterleaved ? o.virtual_stages : 1;
        so.recompute = o.recompute;
        Schedule s;
        try {
          s = build_schedule(so);
        } catch (const ConfigError& e) {
          point.feasible = false;
          point.why = e.what();
          points.push_back(point);
          continue;
        }
        const SimulationResult sim = simulate(s, stage_costs(o, s.stages_count));
        point.step = sim.makespan;
        point.bubble = sim.bubble_ratio;
        point.speedup = projection_reference_step(o, m) / sim.makespan;
        for (const RankTimeline& rank : sim.ranks)
          point.peak_activations = std::max(point.peak_activations, rank.peak_activations);
        points.push_back(point);
      }
    }
  }
  return points;
}

std::string render_projection_text(const ProjectionOptions& o,
                                   const std::vector<ProjectionPoint>& points) {
  std::ostringstream os;
  os << "projection (eff. = speedup / P; in-flight = peak micro-batches held by a rank): "
     << o.layers << " layers, per layer " << format_costs(o.layer_costs, o.recompute)
     << " (message cost " << o.layer_costs.message_cost() << "), recompute "
     << to_string(o.recompute) << "\n";
  char line[160];
  std::snprintf(line, sizeof(line), "%-12s %5s %5s %12s %8s %8s %6s %9s\n", "schedule", "P", "M",
                "step", "bubble", "speedup", "eff.", "in-flight");
  os << line;
  for (const ProjectionPoint& p : points) {
    if (!p.feasible) {
      std::snprintf(line, sizeof(line), "%-12s %5d %5d  n/a: ", to_string(p.kind), p.ranks,
                    p.micro_batches);
      os << line << p.why << "\n";
      continue;
    }
    std::snprintf(line, sizeof(line), "%-12s %5d %5d %12s %8.3f %7.2fx %6.2f %9d\n",
                  to_string(p.kind), p.ranks, p.micro_batches, format_fixed(p.step, 2).c_str(),
                  p.bubble, p.speedup, p.speedup / p.ranks, p.peak_activations);
    os << line;
  }
  return os.str();
}

std::string render_projection_json(const ProjectionOptions& o,
                                   const std::vector<ProjectionPoint>& points) {
  nlohmann::json rows = nlohmann::json::array();
  for (const ProjectionPoint& p : points) {
    nlohmann::json row = {{"schedule", to_string(p.kind)},
                          {"ranks", p.ranks},
                          {"micro_batches", p.micro_batches},
                          {"feasible", p.feasible}};
    if (p.feasible) {
      row["step"] = p.step;
      row["bubble"] = p.bubble;
      row["speedup"] = p.speedup;
      row["peak_activations"] = p.peak_activations;
    } else {
      row["why"] = p.why;
    }
    rows.push_back(row);
  }
  const nlohmann::json doc = {{"layers", o.layers},
                              {"layer_costs", format_costs(o.layer_costs, o.recompute)},
                              {"message_cost", o.layer_costs.message_cost()},
                              {"recompute", to_string(o.recompute)},
                              {"points", rows}};
  return doc.dump(2) + "\n";
}

std::string render_projection_svg(const ProjectionOptions& o,
                                  const std::vector<ProjectionPoint>& points) {
  // One panel per P: bubble (0 to the largest, rounded up to 0.1) against log2 M.
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  const int panel_w = 330, panel_h = 220, margin_l = 60, margin_t = 50, gap = 40;
  const int columns = std::min<int>(2, static_cast<int>(o.ranks.size()));
  const int rows = (static_cast<int>(o.ranks.size()) + columns - 1) / columns;
  const int width = margin_l + columns * (panel_w + gap) + 120;
  const int height = margin_t + rows * (panel_h + gap + 20) + 10;
  double top = 0.1;
  for (const ProjectionPoint& p : points)
    if (p.feasible) top = std::max(top, std::ceil(p.bubble * 10 - 1e-9) / 10);
  const double m_lo = std::log2(*std::min_element(o.micro_batches.begin(), o.micro_batches.end()));
  const double m_hi = std::log2(*std::max_element(o.micro_batches.begin(), o.micro_batches.end()));
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << margin_l << "\" y=\"22\" font-size=\"15\">Simulated bubble vs "
     << "micro-batches, " << o.layers << " layers, message cost "
     << format_fixed(o.layer_costs.message_cost(), 3) << " per message</text>\n";
  for (size_t pi = 0; pi < o.ranks.size(); ++pi) {
    const int x0 = margin_l + static_cast<int>(pi % columns) * (panel_w + gap);
    const int y0 = margin_t + static_cast<int>(pi / columns) * (panel_h + gap + 20);
    auto x_of = [&](int m) {
      const double f = m_hi > m_lo ? (std::log2(m) - m_lo) / (m_hi - m_lo) : 0.5;
      return x0 + f * panel_w;
    };
    auto y_of = [&](double b) { return y0 + panel_h - b / top * panel_h; };
    os << "<text x=\"" << x0 << "\" y=\"" << y0 - 6 << "\">P = " << o.ranks[pi] << "</text>\n"
       << "<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << panel_w << "\" height=\""
       << panel_h << "\" fill=\"none\" stroke=\"#999\"/>\n";
    for (int t = 0; t <= 4; ++t) {
      const double b = top * t / 4;
      os << "<text x=\"" << x0 - 6 << "\" y=\"" << format_fixed(y_of(b) + 4, 1)
         << "\" text-anchor=\"end\">" << format_fixed(b, 2) << "</text>\n";
    }
    for (int m : o.micro_batches)
      os << "<text x=\"" << format_fixed(x_of(m), 1) << "\" y=\"" << y0 + panel_h + 15
         << "\" text-anchor=\"middle\">" << m << "</text>\n";
    for (size_t ki = 0; ki < o.kinds.size(); ++ki) {
      std::ostringstream line;
      for (const ProjectionPoint& p : points) {
        if (p.kind != o.kinds[ki] || p.ranks != o.ranks[pi] || !p.feasible) continue;
        line << format_fixed(x_of(p.micro_batches), 1) << "," << format_fixed(y_of(p.bubble), 1)
             << " ";
      }
      if (line.str().empty()) continue;
      os << "<polyline fill=\"none\" stroke-width=\"2\" stroke=\"" << kColors[ki % 6]
         << "\" points=\"" << line.str() << "\"/>\n";
    }
  }
  for (size_t ki = 0; ki < o.kinds.size(); ++ki) {
    const int y = margin_t + 10 + static_cast<int>(ki) * 18;
    const int x = margin_l + columns * (panel_w + gap);
    os << "<line x1=\"" << x << "\" y1=\"" << y << "\" x2=\"" << x + 20 << "\" y2=\"" << y
       << "\" stroke-width=\"2\" stroke=\"" << kColors[ki % 6] << "\"/><text x=\"" << x + 26
       << "\" y=\"" << y + 4 << "\">" << to_string(o.kinds[ki]) << "</text>\n";
  }
  os << "<text x=\"" << margin_l << "\" y=\"" << height - 4
     << "\">x: micro-batches per step (log scale); y: bubble ratio</text>\n</svg>\n";
  return os.str();
}

}  // namespace pipemat::schedule

namespace pipemat::schedule {

std::string render_project_command(const ProjectCommandOptions& c) {
  ProjectionOptions o;
  o.kinds.clear();
  for (const std::string& kind : c.schedules) o.kinds.push_back(parse_schedule_kind(kind));
  o.ranks = c.ranks;
  o.micro_batches = c.micro_batches;
  o.virtual_stages = c.virtual_stages;
  o.layers = c.layers;
  o.layer_costs = parse_costs(c.costs);
  o.recompute = parse_recompute_mode(c.recompute);
  const std::optional<OutputFormat> format = parse_output_format(c.format);
  PIPEMAT_CHECK(format.has_value() && *format != OutputFormat::kCsv, ConfigError, "--format '",
                c.format, "' is unknown; expected text, json or svg");
  const std::vector<ProjectionPoint> points = project_scaling(o);
  switch (*format) {
    case OutputFormat::kJson:
      return render_projection_json(o, points);
    case OutputFormat::kSvg:
      return render_projection_svg(o, points);
    case OutputFormat::kText:
    case OutputFormat::kCsv:
      break;
  }
  return render_projection_text(o, points);
}

}  // namespace pipemat::schedule
