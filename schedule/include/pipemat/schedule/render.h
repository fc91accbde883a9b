#pragma once
// Renderers of a simulated schedule: text timeline, torch CSV, JSON and an SVG picture.
//
// All take the schedule and the SimulationResult of simulate(schedule, costs) for the same
// schedule and return the whole document as a string (no I/O). Pure functions.

#include <string>
#include <utility>
#include <vector>

#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::schedule {

struct RenderOptions {
  // Show SEND_*/RECV_* actions in action lists (text, CSV, JSON). The SVG and the text timeline
  // always draw compute actions only.
  bool with_comms = false;
  // Cost model line shown in the text and SVG headers, e.g. format_costs(costs, mode).
  std::string costs_label;
  // SVG: per rank (by rank) a span of the step in the timeline's unit drawn as a bar along the
  // bottom of the rank's row, named `span_label` (e.g. the gradient all-reduce of data
  // parallelism, from its first message to its last sum); empty or start >= end: none.
  std::vector<std::pair<double, double>> rank_spans;
  std::string span_label;
};

// Header, one timeline row per rank (label per action, '.' for idle time), then per rank its
// busy time, peak activations and action list.
std::string render_text(const Schedule& schedule, const SimulationResult& sim,
                        const RenderOptions& options = {});

// torch.distributed.pipelining CSV (export_torch_csv).
std::string render_csv(const Schedule& schedule, const RenderOptions& options = {});

// {"kind": ..., "stages": P*V, "ranks_count": P, "micro_batches": M, "virtual": V,
//  "makespan": ..., "bubble_ratio": ...,
//  "ranks": [{"rank": r, "actions": ["0F0", ...], "busy": ..., "peak_activations": k}, ...]}
// where "stages" is the number of model stages (P ranks x V chunks; the CLI's --ranks is P) and
// bubble_ratio = 1 - sum(busy) / (ranks_count * makespan).
std::string render_json(const Schedule& schedule, const SimulationResult& sim,
                        const RenderOptions& options = {});

// A standalone SVG: one row per rank, a coloured block per compute action (F blue, B green,
// I orange, W yellow, R purple; later chunks of a rank lighter) labelled with its micro-batch,
// idle time left as a light background so bubbles stay visible, a time axis and a legend.
// ConfigError for more than 100000 actions (use JSON or text for such schedules).
std::string render_svg(const Schedule& schedule, const SimulationResult& sim,
                       const RenderOptions& options = {});

}  // namespace pipemat::schedule
