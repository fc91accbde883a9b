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
// Note [Projected all-reduce]
// Data x pipeline runs D replicas of the P-rank pipeline, each with M micro-batches (D x M in all).
// Every replica's timeline is the simulated one, so the D ranks of a data group reach each point of
// the step together. A rank all-reduces the gradients of each of its chunks (model stages; V of
// them under interleaved and zb-v) over its data group as one message per chunk: it starts when the
// chunk's last B or W (whichever ends later, the action that makes the chunk's gradients final)
// ends, after the rank's earlier all-reduces, in the order the chunks finish. One takes the ring's
// 2 (D - 1) / D x G / allreduce_bandwidth + allreduce_latency for a chunk of G = grad_bytes x its
// layers (0 when D = 1). It runs beside the rank's compute and the pipeline's messages without
// slowing them. A rank ends at max(its last compute's end, its last all-reduce's end); step = the
// latest rank's end.
//   allreduce = one rank's all-reduce time per step, the sum over its chunks (every rank holds
//               the same layers, so the same for every rank);
//   hidden    = the share of that time, summed over the P ranks, that ends before its rank's
//               last compute action (1 when there is nothing to all-reduce); the rest lengthens
//               the rank's step;
//   speedup   = reference for D x M micro-batches / step; efficiency = speedup / (D x P).
//
// With shard_optimizer (Note [Sharded optimizer] of pp) a chunk's exchange is a reduce-scatter,
// (D - 1) / D x G / allreduce_bandwidth + allreduce_latency, placed as above; then, after the
// rank's last compute and last reduce-scatter, the all-gather of its updated parameters, one
// (D - 1) / D x G / allreduce_bandwidth + allreduce_latency per chunk (float32 parameters: as
// many bytes as their gradients), which nothing hides:
//   gather    = one rank's all-gather time per step (0 unsharded).
// Memory of the largest rank's training state, with layers / P of the layers on a rank:
//   state_bytes = layers / P x (2 x grad_bytes + optimizer_state_bytes / (D if sharded, else 1))
// (its parameters and its gradients, whole at the end of the backward, and its share of the
// optimizer state).
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
  // Note [Projected all-reduce]. D = 1 alone projects the pipeline as before.
  std::vector<int> data = {1};       // D, replicas of the pipeline
  double grad_bytes = 0;             // gradient bytes of one layer
  double allreduce_bandwidth = 0;    // bytes per time unit of the ring; required with grad_bytes
  double allreduce_latency = 0;      // time units per all-reduce (per chunk of a rank)
  bool shard_optimizer = false;      // reduce-scatter + all-gather instead of all-reduce
  double optimizer_state_bytes = 0;  // optimizer state of one layer (AdamW, float32: 2 x grad)
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
  // Note [Projected all-reduce]: step and speedup include the all-reduce; bubble is the
  // pipeline's alone.
  int data = 1;            // D
  double allreduce = 0;    // one rank's all-reduce time per step
  double hidden = 1;       // share of the all-reduce time hidden behind the ranks' own compute
  double efficiency = 0;   // speedup / (D x P)
  double gather = 0;       // one rank's all-gather time per step (shard_optimizer)
  double state_bytes = 0;  // the largest rank's parameters, gradients and optimizer state
};

// One point per (kind, P, M, D) in that order. ConfigError for empty lists, P < 2, M < 1,
// D < 1, layers < 1, a per-layer cost that is all zero, a negative all-reduce figure, or
// gradient bytes without an all-reduce bandwidth.
std::vector<ProjectionPoint> project_scaling(const ProjectionOptions& options);
// The single process's step for `micro_batches` micro-batches (D x M for a data x pipeline
// point).
double projection_reference_step(const ProjectionOptions& options, int micro_batches);
// One all-reduce of a chunk's gradients over `data` ranks when the model is split into
// `stages_count` model stages (Note [Projected all-reduce]); with shard_optimizer its
// reduce-scatter, which is also the time of the chunk's all-gather.
double projection_allreduce_time(const ProjectionOptions& options, int data, int stages_count);
// Whether the options project data parallelism (some D > 1): the documents then gain the D,
// all-reduce and hidden columns and the chart plots efficiency against D.
bool projects_data_parallel(const ProjectionOptions& options);

// A fixed-width table, a JSON array, or an SVG chart: bubble against M, one panel per P, one line
// per schedule; with data parallelism efficiency against D, one panel per P, one line per
// schedule and M.
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
  std::vector<int> data = {1};     // --data
  double grad_bytes = 0;           // --grad-bytes, per layer
  double allreduce_bw = 0;         // --allreduce-bw, bytes per time unit
  double allreduce_latency = 0;    // --allreduce-latency, time units
  bool shard_optimizer = false;    // --shard-optimizer
  double state_bytes = 0;          // --state-bytes, per layer
};
std::string render_project_command(const ProjectCommandOptions& options);

}  // namespace pipemat::schedule
