#pragma once
// Scaling projection: the simulator's step time and bubble for pipelines longer than one machine
// holds, from measured per-layer and per-message costs (`pipemat project`, the projection of
// docs/performance.md).
//
// The model is `layers` equal layers. A schedule of P ranks and V chunks per rank (interleaved:
// options.virtual_stages; zb-v: 2) gives every model stage layers / (P x V) of them, so a stage's
// F, I, W and R cost that many times the per-layer cost (a fraction when P x V does not divide
// the layers: the projection ignores rounding). Every cross-rank message costs
// layer_costs.message_cost() (latency + bytes / bandwidth), whatever the stage count. The
// single-process reference runs every layer's F and B for every micro-batch with no recompute
// and no messages; speedup = reference / step.
//
// Thread safety: pure functions over values.

#include <string>
#include <vector>

#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::schedule {

struct ProjectionOptions {
  std::vector<ScheduleKind> kinds = {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1,
                                     ScheduleKind::kZeroBubbleV};
  std::vector<int> ranks = {4, 8, 16, 32};           // P
  std::vector<int> micro_batches = {8, 16, 32, 64};  // M
  int virtual_stages = 2;                            // V of interleaved
  int layers = 32;
  CostModel
      layer_costs;  // per layer: F, I, W (B = I + W unless set), R; per message: comm, bw, bytes
  RecomputeMode recompute = RecomputeMode::kNone;
};

struct ProjectionPoint {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int ranks = 0, micro_batches = 0;
  bool feasible = true;  // false when the generator refuses this (P, M): `why` says why
  std::string why;
  double step = 0;           // simulated makespan, in the cost unit
  double bubble = 0;         // bubble_ratio
  double speedup = 0;        // reference step / step
  int peak_activations = 0;  // max over ranks
};

// One point per (kind, P, M) in that order. ConfigError for empty lists, P < 2, M < 1, layers
// < 1 or a per-layer cost that is all zero.
std::vector<ProjectionPoint> project_scaling(const ProjectionOptions& options);
double projection_reference_step(const ProjectionOptions& options, int micro_batches);

// A fixed-width table, a JSON array, or an SVG chart (bubble against M, one panel per P, one
// line per schedule).
std::string render_projection_text(const ProjectionOptions& options,
                                   const std::vector<ProjectionPoint>& points);
std::string render_projection_json(const ProjectionOptions& options,
                                   const std::vector<ProjectionPoint>& points);
std::string render_projection_svg(const ProjectionOptions& options,
                                  const std::vector<ProjectionPoint>& points);

// `pipemat project`: the options as the CLI spells them -> the rendered document.
struct ProjectCommandOptions {
  std::vector<std::string> schedules = {"1f1b", "zb-h1", "zb-v"};
  std::vector<int> ranks = {4, 8, 16, 32};
  std::vector<int> micro_batches = {8, 16, 32, 64};
  int virtual_stages = 2;
  int layers = 32;
  std::string costs;               // parse_costs, per layer and per message
  std::string recompute = "none";  // none | lazy | pretrigger
  std::string format = "text";     // an OutputFormat spelling (command.h): text | json | svg
};
std::string render_project_command(const ProjectCommandOptions& options);

}  // namespace pipemat::schedule
