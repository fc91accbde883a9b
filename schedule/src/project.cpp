#include "pipemat/schedule/project.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/svg.h"
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

// Note [Projected all-reduce] on one rank's simulated timeline.
struct RankAllReduce {
  double end = 0;     // max(last compute end, last all-reduce end)
  double total = 0;   // all-reduce time
  double hidden = 0;  // of total, what ends before the rank's last compute action ends
};

RankAllReduce overlap_allreduce(const Schedule& s, const RankTimeline& rank, double per_chunk) {
  std::vector<double> final_at;  // per chunk: the end of its last B or W
  for (int stage : s.stages_of(rank.rank)) {
    double at = -1;
    for (const TimedAction& t : rank.actions) {
      const ActionType type = t.action.type;
      if (t.action.stage == stage &&
          (type == ActionType::kBackward || type == ActionType::kBackwardWeight))
        at = std::max(at, t.end);
    }
    if (at >= 0) final_at.push_back(at);
  }
  std::sort(final_at.begin(), final_at.end());
  RankAllReduce r;
  double clock = 0;
  for (double at : final_at) {
    clock = std::max(clock, at) + per_chunk;
    r.total += per_chunk;
  }
  r.end = std::max(rank.last_end, clock);
  r.hidden = std::max(0.0, r.total - (r.end - rank.last_end));
  return r;
}

// One panel per P, x on a log2 scale, one line per series: the layout of both projection charts.
struct ProjectionChart {
  std::string title, caption;  // the line above the panels and the one below them
  std::vector<int> panels;     // P of each panel
  std::vector<int> xs;         // x values, labelled under every panel
  std::vector<std::string> series;
  // [series][panel]: the (x, y) of a line, in the order of xs; empty draws nothing
  std::vector<std::vector<std::vector<std::pair<int, double>>>> lines;
};

std::string render_projection_chart(const ProjectionChart& chart) {
  // y from 0 to the largest value, rounded up to 0.1.
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  const int panel_w = 330, panel_h = 220, margin_l = 60, margin_t = 50, gap = 40;
  const int columns = std::min<int>(2, static_cast<int>(chart.panels.size()));
  const int rows = (static_cast<int>(chart.panels.size()) + columns - 1) / columns;
  const int width = margin_l + columns * (panel_w + gap) + 120;
  const int height = margin_t + rows * (panel_h + gap + 20) + 10;
  double top = 0.1;
  for (const auto& by_panel : chart.lines)
    for (const auto& line : by_panel)
      for (const auto& xy : line) top = std::max(top, std::ceil(xy.second * 10 - 1e-9) / 10);
  const double x_lo = std::log2(*std::min_element(chart.xs.begin(), chart.xs.end()));
  const double x_hi = std::log2(*std::max_element(chart.xs.begin(), chart.xs.end()));
  SvgWriter svg(width, height, {{"font-family", "sans-serif"}, {"font-size", 12}}, "white");
  svg.text({{"x", margin_l}, {"y", 22}, {"font-size", 15}}, chart.title).newline();
  for (size_t pi = 0; pi < chart.panels.size(); ++pi) {
    const int x0 = margin_l + static_cast<int>(pi % columns) * (panel_w + gap);
    const int y0 = margin_t + static_cast<int>(pi / columns) * (panel_h + gap + 20);
    auto x_of = [&](int x) {
      const double f = x_hi > x_lo ? (std::log2(x) - x_lo) / (x_hi - x_lo) : 0.5;
      return x0 + f * panel_w;
    };
    auto y_of = [&](double y) { return y0 + panel_h - y / top * panel_h; };
    svg.text({{"x", x0}, {"y", y0 - 6}}, "P = " + std::to_string(chart.panels[pi])).newline();
    svg.rect({{"x", x0},
              {"y", y0},
              {"width", panel_w},
              {"height", panel_h},
              {"fill", "none"},
              {"stroke", "#999"}})
        .newline();
    for (int t = 0; t <= 4; ++t) {
      const double y = top * t / 4;
      svg.text({{"x", x0 - 6}, {"y", format_fixed(y_of(y) + 4, 1)}, {"text-anchor", "end"}},
               format_fixed(y, 2))
          .newline();
    }
    for (int x : chart.xs) {
      svg.text(
             {{"x", format_fixed(x_of(x), 1)}, {"y", y0 + panel_h + 15}, {"text-anchor", "middle"}},
             std::to_string(x))
          .newline();
    }
    for (size_t si = 0; si < chart.series.size(); ++si) {
      std::vector<std::pair<double, double>> points;
      for (const auto& [x, y] : chart.lines[si][pi]) points.emplace_back(x_of(x), y_of(y));
      if (points.empty()) continue;
      svg.polyline({{"fill", "none"},
                    {"stroke-width", 2},
                    {"stroke", kColors[si % 6]},
                    {"points", svg_points(points)}})
          .newline();
    }
  }
  for (size_t si = 0; si < chart.series.size(); ++si) {
    const int y = margin_t + 10 + static_cast<int>(si) * 18;
    const int x = margin_l + columns * (panel_w + gap);
    svg.line({{"x1", x},
              {"y1", y},
              {"x2", x + 20},
              {"y2", y},
              {"stroke-width", 2},
              {"stroke", kColors[si % 6]}})
        .text({{"x", x + 26}, {"y", y + 4}}, chart.series[si])
        .newline();
  }
  svg.text({{"x", margin_l}, {"y", height - 4}}, chart.caption).newline();
  return svg.finish();
}

// "1e+07" as the cost model's lines print numbers.
std::string projection_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

double projection_reference_step(const ProjectionOptions& o, int micro_batches) {
  return o.layers * (o.layer_costs.forward + o.layer_costs.backward_cost()) * micro_batches;
}

double projection_allreduce_time(const ProjectionOptions& o, int data, int stages_count) {
  if (data <= 1) return 0.0;
  const double bytes = o.grad_bytes * o.layers / stages_count;
  // A ring all-reduce moves 2 (D - 1) / D of the bytes; a reduce-scatter or an all-gather half.
  const double ring = (o.shard_optimizer ? 1.0 : 2.0) * (data - 1) / data * bytes;
  return (o.allreduce_bandwidth > 0 ? ring / o.allreduce_bandwidth : 0.0) + o.allreduce_latency;
}

bool projects_data_parallel(const ProjectionOptions& o) {
  return std::any_of(o.data.begin(), o.data.end(), [](int d) { return d != 1; });
}

namespace {

// ConfigError naming the flag when an option of a projection is out of range.
void check_projection(const ProjectionOptions& o) {
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
  PIPEMAT_CHECK(!o.data.empty(), ConfigError,
                "project: --data is empty; give the data-parallel degrees, e.g. --data 1,2,4");
  for (int d : o.data)
    PIPEMAT_CHECK(d >= 1 && d <= 65536, ConfigError, "project: --data ", d,
                  " is outside [1, 65536]; D is the number of pipeline replicas (1: none)");
  const std::pair<const char*, double> allreduce_flags[] = {
      {"--grad-bytes", o.grad_bytes},
      {"--allreduce-bw", o.allreduce_bandwidth},
      {"--allreduce-latency", o.allreduce_latency},
      {"--state-bytes", o.optimizer_state_bytes}};
  for (const auto& [flag, value] : allreduce_flags)
    PIPEMAT_CHECK(std::isfinite(value) && value >= 0, ConfigError, "project: ", flag, " ", value,
                  " is not a non-negative number");
  PIPEMAT_CHECK(o.grad_bytes == 0 || o.allreduce_bandwidth > 0, ConfigError,
                "project: --grad-bytes ", o.grad_bytes,
                " needs --allreduce-bw, the all-reduce's bytes per time unit (e.g. "
                "--allreduce-bw 1e7 for 10 GB/s in ms)");
}

// The points of one schedule, P and M: one per data degree, infeasible ones with the reason.
void project_point(const ProjectionOptions& o, ScheduleKind kind, int p, int m,
                   std::vector<ProjectionPoint>& points) {
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
    for (int d : o.data) {
      point.data = d;
      points.push_back(point);
    }
    return;
  }
  const SimulationResult sim = simulate(s, stage_costs(o, s.stages_count));
  point.bubble = sim.bubble_ratio;
  for (const RankTimeline& rank : sim.ranks)
    point.peak_activations = std::max(point.peak_activations, rank.peak_activations);
  for (int d : o.data) {
    // Note [Projected all-reduce]: every replica runs this timeline.
    const double per_chunk = projection_allreduce_time(o, d, s.stages_count);
    point.data = d;
    point.step = sim.makespan;
    point.allreduce = 0;
    point.gather = 0;
    double total = 0, hidden = 0;
    for (const RankTimeline& rank : sim.ranks) {
      const RankAllReduce r = overlap_allreduce(s, rank, per_chunk);
      // The all-gather after the rank's compute and reduce-scatters: one per chunk, unhidden.
      const double gather =
          o.shard_optimizer ? per_chunk * static_cast<double>(s.stages_of(rank.rank).size()) : 0;
      point.step = std::max(point.step, r.end + gather);
      point.allreduce = std::max(point.allreduce, r.total);
      point.gather = std::max(point.gather, gather);
      total += r.total;
      hidden += r.hidden;
    }
    point.state_bytes = static_cast<double>(o.layers) / p *
                        (2 * o.grad_bytes + o.optimizer_state_bytes / (o.shard_optimizer ? d : 1));
    point.hidden = total > 0 ? hidden / total : 1.0;
    point.speedup = projection_reference_step(o, d * m) / point.step;
    point.efficiency = point.speedup / (static_cast<double>(d) * p);
    points.push_back(point);
  }
}

}  // namespace

std::vector<ProjectionPoint> project_scaling(const ProjectionOptions& o) {
  check_projection(o);
  std::vector<ProjectionPoint> points;
  for (ScheduleKind kind : o.kinds)
    for (int p : o.ranks)
      for (int m : o.micro_batches) project_point(o, kind, p, m, points);
  return points;
}

std::string render_projection_text(const ProjectionOptions& o,
                                   const std::vector<ProjectionPoint>& points) {
  const bool data = projects_data_parallel(o);
  std::ostringstream os;
  os << "projection (eff. = speedup / " << (data ? "(D x P)" : "P")
     << "; in-flight = peak micro-batches held by a rank): " << o.layers << " layers, per layer "
     << format_costs(o.layer_costs, o.recompute) << " (message cost "
     << o.layer_costs.message_cost() << "), recompute " << to_string(o.recompute) << "\n";
  if (data) {
    os << "data x pipeline: D replicas of M micro-batches each; per layer " << o.grad_bytes
       << " gradient bytes; all-reduce bandwidth " << o.allreduce_bandwidth << ", latency "
       << o.allreduce_latency
       << "; all-reduce = a rank's time per step, one 2 (D - 1) / D x bytes / bandwidth + latency "
          "per chunk after its last B or W; hidden = its share that ends before the rank's last "
          "compute\n";
  }
  // The training state's memory and, sharded, the all-gather (Note [Projected all-reduce]).
  const bool state = data && (o.shard_optimizer || o.optimizer_state_bytes > 0);
  if (state) {
    os << (o.shard_optimizer ? "sharded optimizer: a reduce-scatter, (D - 1) / D x bytes / "
                               "bandwidth + latency, in place of each all-reduce; gather = the "
                               "all-gather of a rank's parameters after its compute, as long, per "
                               "chunk; "
                             : "")
       << "state = the largest rank's parameters, gradients and optimizer state ("
       << o.optimizer_state_bytes << " bytes a layer" << (o.shard_optimizer ? ", / D" : "")
       << "), MiB\n";
  }
  char line[240];
  if (data) {
    std::snprintf(line, sizeof(line), "%-12s %5s %5s %5s %12s %8s %9s %6s %9s %10s %6s\n",
                  "schedule", "P", "M", "D", "step", "bubble", "speedup", "eff.", "in-flight",
                  "all-reduce", "hidden");
  } else {
    std::snprintf(line, sizeof(line), "%-12s %5s %5s %12s %8s %8s %6s %9s\n", "schedule", "P", "M",
                  "step", "bubble", "speedup", "eff.", "in-flight");
  }
  // Each row of a state projection gains the gather and the state, before its newline.
  const auto with_state = [&](const char* row, const std::string& gather,
                              const std::string& bytes) {
    std::string out = row;
    if (!state) return out;
    char more[64];
    std::snprintf(more, sizeof(more), " %8s %10s\n", gather.c_str(), bytes.c_str());
    out.pop_back();
    return out + more;
  };
  os << with_state(line, "gather", "state");
  for (const ProjectionPoint& p : points) {
    if (!p.feasible) {
      if (data) {
        std::snprintf(line, sizeof(line), "%-12s %5d %5d %5d  n/a: ", to_string(p.kind), p.ranks,
                      p.micro_batches, p.data);
      } else {
        std::snprintf(line, sizeof(line), "%-12s %5d %5d  n/a: ", to_string(p.kind), p.ranks,
                      p.micro_batches);
      }
      os << line << p.why << "\n";
      continue;
    }
    if (data) {
      const bool none = p.allreduce <= 0;
      std::snprintf(line, sizeof(line), "%-12s %5d %5d %5d %12s %8.3f %8.2fx %6.2f %9d %10s %6s\n",
                    to_string(p.kind), p.ranks, p.micro_batches, p.data,
                    format_fixed(p.step, 2).c_str(), p.bubble, p.speedup, p.efficiency,
                    p.peak_activations, none ? "-" : format_fixed(p.allreduce, 3).c_str(),
                    none ? "-" : format_fixed(p.hidden, 3).c_str());
      os << with_state(line, p.gather > 0 ? format_fixed(p.gather, 3) : "-",
                       format_fixed(p.state_bytes / (1 << 20), 2));
      continue;
    } else {
      std::snprintf(line, sizeof(line), "%-12s %5d %5d %12s %8.3f %7.2fx %6.2f %9d\n",
                    to_string(p.kind), p.ranks, p.micro_batches, format_fixed(p.step, 2).c_str(),
                    p.bubble, p.speedup, p.speedup / p.ranks, p.peak_activations);
    }
    os << line;
  }
  return os.str();
}

std::string render_projection_json(const ProjectionOptions& o,
                                   const std::vector<ProjectionPoint>& points) {
  const bool data = projects_data_parallel(o);
  nlohmann::json rows = nlohmann::json::array();
  for (const ProjectionPoint& p : points) {
    nlohmann::json row = {{"schedule", to_string(p.kind)},
                          {"ranks", p.ranks},
                          {"micro_batches", p.micro_batches},
                          {"feasible", p.feasible}};
    if (data) row["data"] = p.data;
    if (p.feasible) {
      row["step"] = p.step;
      row["bubble"] = p.bubble;
      row["speedup"] = p.speedup;
      row["peak_activations"] = p.peak_activations;
      if (data) {
        row["efficiency"] = p.efficiency;
        row["allreduce"] = p.allreduce;
        row["hidden"] = p.hidden;
        row["gather"] = p.gather;
        row["state_bytes"] = p.state_bytes;
      }
    } else {
      row["why"] = p.why;
    }
    rows.push_back(row);
  }
  nlohmann::json doc = {{"layers", o.layers},
                        {"layer_costs", format_costs(o.layer_costs, o.recompute)},
                        {"message_cost", o.layer_costs.message_cost()},
                        {"recompute", to_string(o.recompute)},
                        {"points", rows}};
  if (data) {
    doc["grad_bytes"] = o.grad_bytes;
    doc["allreduce_bandwidth"] = o.allreduce_bandwidth;
    doc["allreduce_latency"] = o.allreduce_latency;
    doc["shard_optimizer"] = o.shard_optimizer;
    doc["optimizer_state_bytes"] = o.optimizer_state_bytes;
  }
  return doc.dump(2) + "\n";
}

std::string render_projection_svg(const ProjectionOptions& o,
                                  const std::vector<ProjectionPoint>& points) {
  ProjectionChart chart;
  chart.panels = o.ranks;
  if (!projects_data_parallel(o)) {
    // Bubble against M, one line per schedule.
    chart.title = "Simulated bubble vs micro-batches, " + std::to_string(o.layers) +
                  " layers, message cost " + format_fixed(o.layer_costs.message_cost(), 3) +
                  " per message";
    chart.caption = "x: micro-batches per step (log scale); y: bubble ratio";
    chart.xs = o.micro_batches;
    for (ScheduleKind kind : o.kinds) {
      chart.series.push_back(to_string(kind));
      auto& by_panel = chart.lines.emplace_back(o.ranks.size());
      for (size_t pi = 0; pi < o.ranks.size(); ++pi)
        for (const ProjectionPoint& p : points)
          if (p.kind == kind && p.ranks == o.ranks[pi] && p.feasible)
            by_panel[pi].emplace_back(p.micro_batches, p.bubble);
    }
    return render_projection_chart(chart);
  }
  // Efficiency against D, one line per schedule and M.
  chart.title = "Projected efficiency vs replicas D: " + std::to_string(o.layers) + " layers, " +
                projection_number(o.grad_bytes) + " gradient bytes a layer, all-reduce bw " +
                projection_number(o.allreduce_bandwidth) + ", latency " +
                projection_number(o.allreduce_latency);
  chart.caption = "x: data-parallel replicas D (log scale); y: efficiency = speedup / (D x P)";
  chart.xs = o.data;
  for (ScheduleKind kind : o.kinds) {
    for (int m : o.micro_batches) {
      chart.series.push_back(std::string(to_string(kind)) + ", M=" + std::to_string(m));
      auto& by_panel = chart.lines.emplace_back(o.ranks.size());
      for (size_t pi = 0; pi < o.ranks.size(); ++pi)
        for (const ProjectionPoint& p : points)
          if (p.kind == kind && p.micro_batches == m && p.ranks == o.ranks[pi] && p.feasible)
            by_panel[pi].emplace_back(p.data, p.efficiency);
    }
  }
  return render_projection_chart(chart);
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
  o.data = c.data;
  o.grad_bytes = c.grad_bytes;
  o.allreduce_bandwidth = c.allreduce_bw;
  o.allreduce_latency = c.allreduce_latency;
  o.shard_optimizer = c.shard_optimizer;
  o.optimizer_state_bytes = c.state_bytes;
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
