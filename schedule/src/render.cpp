#include "pipemat/schedule/render.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/svg.h"
#include "pipemat/schedule/torch_csv.h"

namespace pipemat::schedule {
namespace {

constexpr size_t kMaxSvgActions = 100000;

std::string num(double v) {
  if (std::fabs(v - std::round(v)) < 1e-9)
    return std::to_string(static_cast<long long>(std::round(v)));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string ratio(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6f", v);
  return buf;
}

// Times in JSON: an integer when the time is one (as num() prints it), else the double. Ratios:
// rounded to the six decimals ratio() prints.
nlohmann::ordered_json json_time(double v) {
  if (std::fabs(v - std::round(v)) < 1e-9) return static_cast<long long>(std::round(v));
  return v;
}

double json_ratio(double v) { return std::round(v * 1e6) / 1e6; }

std::vector<Action> listed(const Schedule& s, int rank, const RenderOptions& o) {
  return o.with_comms ? s.actions[rank] : s.compute_actions(rank);
}

std::string label(const Schedule& s, const Action& a) {
  if (s.virtual_stages > 1 || s.layout == StageLayout::kCustom) return format_action(a);
  return std::string(action_type_code(a.type)) + std::to_string(a.micro_batch);
}

std::string header(const Schedule& s, const SimulationResult& sim, const RenderOptions& o) {
  std::ostringstream os;
  os << "schedule " << to_string(s.kind) << ": " << s.ranks_count << " ranks, " << s.stages_count
     << " stages (" << to_string(s.layout) << " layout, virtual " << s.virtual_stages << "), "
     << s.micro_batches << " micro-batches, recompute " << to_string(s.recompute) << "\n";
  if (!o.costs_label.empty()) os << "costs " << o.costs_label << "\n";
  os << "makespan " << num(sim.makespan) << ", bubble_ratio " << ratio(sim.bubble_ratio)
     << " (1 - sum(busy) / (ranks * makespan)), span_bubble_ratio " << ratio(span_bubble_ratio(sim))
     << " (worst rank, from its first to its last action)\n";
  return os.str();
}

// Label colour readable on the block colour.
const char* ink(ActionType t) {
  return t == ActionType::kBackwardInput || t == ActionType::kBackwardWeight ? "#111111"
                                                                             : "#ffffff";
}

const char* colour(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return "#4e79a7";
    case ActionType::kBackward:
      return "#59a14f";
    case ActionType::kBackwardInput:
      return "#f28e2b";
    case ActionType::kBackwardWeight:
      return "#edc948";
    case ActionType::kRecompute:
      return "#b07aa1";
    default:
      return "#999999";
  }
}

}  // namespace

std::string render_text(const Schedule& s, const SimulationResult& sim, const RenderOptions& o) {
  std::ostringstream os;
  os << header(s, sim, o);
  size_t width = 1;
  double shortest = 0.0;
  for (const auto& rank : sim.ranks) {
    for (const auto& t : rank.actions) {
      if (!is_compute(t.action.type) || t.end <= t.start) continue;
      width = std::max(width, label(s, t.action).size());
      shortest = shortest == 0.0 ? t.end - t.start : std::min(shortest, t.end - t.start);
    }
  }
  double scale = shortest > 0 ? static_cast<double>(width + 1) / shortest : 1.0;
  // Very uneven costs would make the row thousands of columns wide: cap it (labels then clip).
  constexpr double kMaxColumns = 600.0;
  if (sim.makespan * scale > kMaxColumns) scale = std::max(kMaxColumns / sim.makespan, 1e-6);
  const int columns = static_cast<int>(std::ceil(sim.makespan * scale - 1e-9));
  const std::string prefix_pad(9, ' ');
  // Axis: a tick mark every 5 time units (every unit when the makespan is short).
  const int step = sim.makespan <= 40 ? 1 : (sim.makespan <= 200 ? 5 : 10);
  std::string axis(columns + 1, ' ');
  std::string marks(columns + 1, ' ');
  for (int t = 0; t * scale <= columns + 1e-9; t += step) {
    const int col = static_cast<int>(std::lround(t * scale));
    if (col > columns) break;
    marks[col] = '|';
    const std::string tick = std::to_string(t);
    if (col + tick.size() <= axis.size() && (col == 0 || axis[col - 1] == ' ')) {
      axis.replace(col, tick.size(), tick);
    }
  }
  os << "\n" << prefix_pad << axis << "\n" << prefix_pad << marks << "\n";
  for (const auto& rank : sim.ranks) {
    std::string row(columns, '.');
    for (const auto& t : rank.actions) {
      if (!is_compute(t.action.type)) continue;
      const int a = static_cast<int>(std::lround(t.start * scale));
      const int b = std::min(columns, static_cast<int>(std::lround(t.end * scale)));
      if (b <= a) continue;
      std::fill(row.begin() + a, row.begin() + b, ' ');
      const std::string text = label(s, t.action).substr(0, b - a);
      row.replace(a, text.size(), text);
    }
    char name[16];
    std::snprintf(name, sizeof(name), "rank %-3d ", rank.rank);
    os << name << row << "\n";
  }
  os << "\n";
  for (const auto& rank : sim.ranks) {
    os << "rank " << rank.rank << ": stages "
       << join(
              [&] {
                std::vector<std::string> v;
                for (int st : s.stages_of(rank.rank)) v.push_back(std::to_string(st));
                return v;
              }(),
              ",")
       << ", busy " << num(rank.busy) << ", peak_activations " << rank.peak_activations
       << ", actions: " << join(format_actions(listed(s, rank.rank, o)), " ") << "\n";
  }
  return os.str();
}

std::string render_csv(const Schedule& s, const RenderOptions& o) {
  return export_torch_csv(s, TorchCsvOptions{o.with_comms});
}

std::string render_json(const Schedule& s, const SimulationResult& sim, const RenderOptions& o) {
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (const auto& rank : sim.ranks) {
    ranks.push_back({{"rank", rank.rank},
                     {"actions", format_actions(listed(s, rank.rank, o))},
                     {"busy", json_time(rank.busy)},
                     {"peak_activations", rank.peak_activations}});
  }
  const nlohmann::ordered_json doc = {{"kind", to_string(s.kind)},
                                      {"stages", s.stages_count},
                                      {"ranks_count", s.ranks_count},
                                      {"micro_batches", s.micro_batches},
                                      {"virtual", s.virtual_stages},
                                      {"makespan", json_time(sim.makespan)},
                                      {"bubble_ratio", json_ratio(sim.bubble_ratio)},
                                      {"ranks", ranks}};
  return doc.dump(2) + "\n";
}

namespace {

// The timeline picture's geometry: one row per rank, the time axis below, the legend under it.
struct SvgLayout {
  double makespan = 0;  // the drawn time
  double unit = 0;      // px per time unit
  int left = 70, top = 58, row_h = 30, gap = 8;
  int plot_w = 0, width = 0, axis_y = 0, height = 0;
  int row_y(int rank) const { return top + rank * (row_h + gap); }
};

SvgLayout svg_layout(const Schedule& s, const SimulationResult& sim, const RenderOptions& o) {
  SvgLayout l;
  // The drawn time: the schedule's makespan, and the rank spans where they end later.
  l.makespan = std::max(sim.makespan, 1e-9);
  for (const auto& span : o.rank_spans) l.makespan = std::max(l.makespan, span.second);
  l.unit = std::clamp(1100.0 / l.makespan, 2.0, 48.0);
  l.plot_w = static_cast<int>(std::ceil(l.makespan * l.unit));
  l.width = std::max(l.left + l.plot_w + 20, 780);
  l.axis_y = l.row_y(s.ranks_count);
  l.height = l.axis_y + 70;
  return l;
}

// A rank's row: its name, the idle background, one block per compute action (a tooltip with
// the action and its interval, the micro-batch on it where it fits) and its span, if any.
void svg_rank_row(SvgWriter& svg, const Schedule& s, const RankTimeline& rank,
                  const RenderOptions& o, const SvgLayout& l) {
  const int y = l.row_y(rank.rank);
  svg.text(
         {{"x", l.left - 8}, {"y", y + l.row_h / 2 + 4}, {"font-size", 12}, {"text-anchor", "end"}},
         "rank " + std::to_string(rank.rank))
      .newline();
  // Idle background: whatever no block covers stays this light grey.
  svg.rect({{"x", l.left}, {"y", y}, {"width", l.plot_w}, {"height", l.row_h}, {"fill", "#eeeeee"}})
      .newline();
  const std::vector<int> own = s.stages_of(rank.rank);
  for (const auto& t : rank.actions) {
    if (!is_compute(t.action.type) || t.end <= t.start) continue;
    const int chunk =
        static_cast<int>(std::find(own.begin(), own.end(), t.action.stage) - own.begin());
    const double x = l.left + t.start * l.unit, w = (t.end - t.start) * l.unit;
    const double opacity = chunk == 0 ? 1.0 : std::max(0.35, 1.0 - 0.3 * chunk);
    svg.group(format_action(t.action) + " [" + num(t.start) + ", " + num(t.end) + ")");
    svg.rect({{"x", x},
              {"y", y},
              {"width", w},
              {"height", l.row_h},
              {"fill", colour(t.action.type)},
              {"fill-opacity", opacity},
              {"stroke", "#ffffff"},
              {"stroke-width", 1}});
    if (w >= 9) {
      svg.text({{"x", x + w / 2},
                {"y", y + l.row_h / 2 + 4},
                {"font-size", w >= 16 ? 11 : 8},
                {"text-anchor", "middle"},
                {"fill", ink(t.action.type)}},
               std::to_string(t.action.micro_batch));
    }
    svg.end_group().newline();
  }
  if (static_cast<size_t>(rank.rank) >= o.rank_spans.size()) return;
  const auto [from, to] = o.rank_spans[static_cast<size_t>(rank.rank)];
  if (to <= from) return;
  svg.group(o.span_label + " [" + num(from) + ", " + num(to) + ")")
      .rect({{"x", l.left + from * l.unit},
             {"y", y + l.row_h - 5},
             {"width", (to - from) * l.unit},
             {"height", 5},
             {"fill", "#222222"}})
      .end_group()
      .newline();
}

// The time axis: a tick every step, labelled where the labels do not crowd.
void svg_time_axis(SvgWriter& svg, const SvgLayout& l) {
  const int step = l.makespan <= 40 ? 1 : (l.makespan <= 120 ? 5 : 10);
  svg.line({{"x1", l.left},
            {"y1", l.axis_y},
            {"x2", l.left + l.plot_w},
            {"y2", l.axis_y},
            {"stroke", "#555"}})
      .newline();
  for (int t = 0; t <= l.makespan + 1e-9; t += step) {
    const double x = l.left + t * l.unit;
    svg.line({{"x1", x}, {"y1", l.axis_y}, {"x2", x}, {"y2", l.axis_y + 4}, {"stroke", "#555"}});
    if (t % (step * (l.unit * step < 18 ? 5 : 1)) == 0) {
      svg.text({{"x", x}, {"y", l.axis_y + 16}, {"font-size", 10}, {"text-anchor", "middle"}},
               std::to_string(t));
    }
    svg.newline();
  }
}

void svg_legend(SvgWriter& svg, const Schedule& s, const RenderOptions& o, const SvgLayout& l) {
  const std::pair<const char*, const char*> legend[] = {
      {colour(ActionType::kForward), "F forward"},
      {colour(ActionType::kBackward), "B backward"},
      {colour(ActionType::kBackwardInput), "I input grad"},
      {colour(ActionType::kBackwardWeight), "W weight grad"},
      {colour(ActionType::kRecompute), "R recompute"},
      {"#eeeeee", "idle"}};
  int lx = l.left;
  const int ly = l.axis_y + 32;
  for (const auto& [fill, name] : legend) {
    svg.rect({{"x", lx}, {"y", ly}, {"width", 14}, {"height", 14}, {"fill", fill}})
        .text({{"x", lx + 19}, {"y", ly + 11}, {"font-size", 11}}, name)
        .newline();
    lx += 110;
  }
  lx -= 110;  // the idle entry's
  if (s.virtual_stages > 1) {
    svg.text({{"x", lx + 70}, {"y", ly + 11}, {"font-size", 11}},
             "(lighter = later chunk on the rank)")
        .newline();
  }
  if (std::any_of(o.rank_spans.begin(), o.rank_spans.end(),
                  [](const auto& span) { return span.second > span.first; })) {
    svg.rect({{"x", l.left}, {"y", ly + 24}, {"width", 14}, {"height", 5}, {"fill", "#222222"}})
        .text({{"x", l.left + 19}, {"y", ly + 30}, {"font-size", 11}}, o.span_label)
        .newline();
  }
}

}  // namespace

std::string render_svg(const Schedule& s, const SimulationResult& sim, const RenderOptions& o) {
  size_t blocks = 0;
  for (const auto& rank : sim.ranks) blocks += rank.actions.size();
  PIPEMAT_CHECK(blocks <= kMaxSvgActions, ConfigError,
                "--format svg draws one block per action, and ", blocks, " actions (more than ",
                kMaxSvgActions,
                ") would make a picture nobody can open. Use --format json or text, or fewer "
                "--micro-batches / --ranks.");
  const SvgLayout l = svg_layout(s, sim, o);
  SvgWriter svg(l.width, l.height,
                {{"viewBox", "0 0 " + std::to_string(l.width) + " " + std::to_string(l.height)},
                 {"font-family", "Helvetica, Arial, sans-serif"}},
                "#ffffff");
  svg.text({{"x", l.left}, {"y", 22}, {"font-size", 15}, {"font-weight", "bold"}},
           ::pipemat::detail::concat(to_string(s.kind), ": P=", s.ranks_count,
                                     ", M=", s.micro_batches, ", V=", s.virtual_stages,
                                     ", recompute ", to_string(s.recompute)))
      .newline();
  svg.text({{"x", l.left}, {"y", 42}, {"font-size", 12}, {"fill", "#333"}},
           "makespan " + num(sim.makespan) + ", bubble ratio " + ratio(sim.bubble_ratio) +
               (o.costs_label.empty() ? "" : ", costs " + o.costs_label))
      .newline();
  for (const auto& rank : sim.ranks) svg_rank_row(svg, s, rank, o, l);
  svg_time_axis(svg, l);
  svg_legend(svg, s, o, l);
  return svg.finish();
}

}  // namespace pipemat::schedule
