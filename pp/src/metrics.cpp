// The step's loss on every rank, and the step metrics every rank sends to the last stage's
// rank: bubble, remat counters, measured timelines and the simulator's prediction for them.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;

namespace {

// [n, 8] doubles: stage, type, micro-batch, start us, end us, wait us, received (0/1), bytes
// (exact in a double below 2^53).
constexpr int64_t kTimelineColumns = 8;
at::Tensor timeline_tensor(const std::vector<ActionTiming>& timeline) {
  auto t = at::zeros({static_cast<int64_t>(timeline.size()), kTimelineColumns}, at::kDouble);
  auto acc = t.accessor<double, 2>();
  for (size_t i = 0; i < timeline.size(); ++i) {
    const ActionTiming& x = timeline[i];
    acc[i][0] = x.action.stage;
    acc[i][1] = static_cast<double>(x.action.type);
    acc[i][2] = x.action.micro_batch;
    acc[i][3] = x.start_us;
    acc[i][4] = x.end_us;
    acc[i][5] = x.wait_us;
    acc[i][6] = x.received ? 1.0 : 0.0;
    acc[i][7] = static_cast<double>(x.bytes);
  }
  return t;
}

// [n, 6] doubles: part, start us, end us, stage, micro-batch, bytes.
constexpr int64_t kSpanColumns = 6;
at::Tensor spans_tensor(const std::vector<StepSpan>& spans) {
  auto t = at::zeros({static_cast<int64_t>(spans.size()), kSpanColumns}, at::kDouble);
  auto acc = t.accessor<double, 2>();
  for (size_t i = 0; i < spans.size(); ++i) {
    acc[i][0] = static_cast<double>(spans[i].part);
    acc[i][1] = spans[i].start_us;
    acc[i][2] = spans[i].end_us;
    acc[i][3] = spans[i].stage;
    acc[i][4] = spans[i].micro_batch;
    acc[i][5] = static_cast<double>(spans[i].bytes);
  }
  return t;
}

// A peer's timeline and spans back from their tensors; CommError naming the rank when a tensor
// is malformed or names an action type or part that does not exist.
bool whole(double v, double lo, double hi) { return v >= lo && v <= hi && v == std::floor(v); }

std::vector<ActionTiming> timeline_of(const at::Tensor& t, int rank) {
  PIPEMAT_CHECK(t.defined() && t.dim() == 2 && t.size(1) == kTimelineColumns &&
                    t.scalar_type() == at::kDouble,
                CommError, "rank ", rank, " sent a malformed timeline");
  auto acc = t.accessor<double, 2>();
  std::vector<ActionTiming> out(static_cast<size_t>(t.size(0)));
  for (int64_t i = 0; i < t.size(0); ++i) {
    PIPEMAT_CHECK(whole(acc[i][0], 0, 1 << 20) &&
                      whole(acc[i][1], 0, static_cast<double>(ActionType::kRecvBackward)) &&
                      whole(acc[i][2], 0, 1 << 30),
                  CommError, "rank ", rank, " sent a malformed timeline (row ", i, ")");
    ActionTiming& x = out[static_cast<size_t>(i)];
    x.action = {static_cast<int>(acc[i][0]), static_cast<ActionType>(static_cast<int>(acc[i][1])),
                static_cast<int>(acc[i][2])};
    x.start_us = acc[i][3];
    x.end_us = acc[i][4];
    x.wait_us = acc[i][5];
    x.received = acc[i][6] != 0;
    x.bytes = static_cast<int64_t>(acc[i][7]);
  }
  return out;
}

std::vector<StepSpan> spans_of(const at::Tensor& t, int rank) {
  PIPEMAT_CHECK(
      t.defined() && t.dim() == 2 && t.size(1) == kSpanColumns && t.scalar_type() == at::kDouble,
      CommError, "rank ", rank, " sent malformed step spans");
  auto acc = t.accessor<double, 2>();
  std::vector<StepSpan> out(static_cast<size_t>(t.size(0)));
  for (int64_t i = 0; i < t.size(0); ++i) {
    PIPEMAT_CHECK(whole(acc[i][0], 0, static_cast<double>(StepPart::kGather)), CommError, "rank ",
                  rank, " sent malformed step spans (row ", i, ")");
    StepSpan& x = out[static_cast<size_t>(i)];
    x.part = static_cast<StepPart>(static_cast<int>(acc[i][0]));
    x.start_us = acc[i][1];
    x.end_us = acc[i][2];
    x.stage = static_cast<int>(acc[i][3]);
    x.micro_batch = static_cast<int>(acc[i][4]);
    x.bytes = static_cast<int64_t>(acc[i][5]);
  }
  return out;
}

// The scalars of exchange_metrics' message.
constexpr int64_t kMetricScalars = 22;

}  // namespace

// The last stage's rank has the loss; every rank returns it.
double Pipeline::Impl::share_loss(double loss) {
  if (plan.ranks_count == 1) return loss;
  if (rank == last_rank()) {
    std::vector<comm::TensorListWork> sends;
    for (int r = 0; r < plan.ranks_count; ++r) {
      if (r != rank) {
        sends.push_back(
            comm::send_tensors(transport, r, loss_tag(), {at::tensor({loss}, at::kDouble)}));
      }
    }
    for (auto& w : sends) w.wait();
    return loss;
  }
  Tensors got = comm::recv_tensors(transport, last_rank(), loss_tag()).wait();
  PIPEMAT_CHECK(got.size() == 1 && got[0].defined() && got[0].numel() == 1 &&
                    got[0].scalar_type() == at::kDouble,
                CommError, "rank ", rank, ": the last stage's rank ", last_rank(),
                " sent a malformed loss message");
  return got[0].item<double>();
}

// The measured timeline as a SimulationResult, and the simulator's predictions: with the
// measured mean cost per action type (the bubbles), and with each stage's (the trace's).
void Pipeline::Impl::build_measured(StepMetrics& m) const {
  std::map<ActionType, std::pair<double, int>> cost;
  std::map<std::pair<int, ActionType>, std::pair<double, int>> stage_cost;  // (stage, type)
  struct Waited {
    int rank;
    Action action;
    double start, wait;
  };
  std::vector<Waited> waits;
  std::map<std::tuple<int, bool, int>, double> sent;  // (stage, backward?, mb) -> issued at
  m.measured = schedule::SimulationResult{};
  m.measured.ranks.resize(plan.ranks_count);
  double makespan = 0, busy = 0;
  for (int r = 0; r < plan.ranks_count; ++r) {
    auto& out = m.measured.ranks[r];
    out.rank = r;
    for (const ActionTiming& x : m.rank_timelines[static_cast<size_t>(r)]) {
      schedule::TimedAction ta;
      ta.action = x.action;
      ta.position = static_cast<int>(out.actions.size());
      ta.start = x.start_us / 1000.0;
      ta.end = x.end_us / 1000.0;
      waits.push_back({r, ta.action, ta.start, x.wait_us / 1000.0});
      if (!schedule::is_compute(ta.action.type)) {
        sent[{ta.action.stage, ta.action.type == ActionType::kSendBackward,
              ta.action.micro_batch}] = ta.start;
        continue;
      }
      out.busy += ta.end - ta.start;
      if (out.actions.empty()) out.first_start = ta.start;
      out.last_end = ta.end;
      for (auto* c : {&cost[ta.action.type], &stage_cost[{ta.action.stage, ta.action.type}]}) {
        c->first += ta.end - ta.start;
        c->second += 1;
      }
      out.actions.push_back(ta);
    }
    makespan = std::max(makespan, out.last_end);
    busy += out.busy;
  }
  m.measured.makespan = makespan;
  m.measured.bubble_ratio = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
  // The mean of one action type's durations (`sums`' entry for `key`), or `fallback` where
  // none ran.
  auto mean = [](const auto& sums, const auto& key, double fallback) {
    auto it = sums.find(key);
    return it == sums.end() || it->second.second == 0 ? fallback
                                                      : it->second.first / it->second.second;
  };
  schedule::CostModel model;
  model.forward = mean(cost, ActionType::kForward, 1.0);
  model.backward_input = mean(cost, ActionType::kBackwardInput, model.forward);
  model.backward_weight = mean(cost, ActionType::kBackwardWeight, model.forward);
  if (cost.count(ActionType::kBackward)) model.backward = mean(cost, ActionType::kBackward, 2.0);
  if (cost.count(ActionType::kRecompute)) {
    model.recompute = mean(cost, ActionType::kRecompute, 0.0);
  }
  m.measured_costs = model;
  // Each stage's own means, the job's where a stage ran no action of a type (Note [Step trace]:
  // the first stage's I, whose input needs no gradient, and a stage without replays are far
  // from the job's mean).
  m.measured_stage_costs.assign(static_cast<size_t>(plan.stages_count), model);
  for (int s = 0; s < plan.stages_count; ++s) {
    schedule::CostModel& own = m.measured_stage_costs[static_cast<size_t>(s)];
    own.forward = mean(stage_cost, std::pair{s, ActionType::kForward}, model.forward);
    own.backward_input =
        mean(stage_cost, std::pair{s, ActionType::kBackwardInput}, model.backward_input);
    own.backward_weight =
        mean(stage_cost, std::pair{s, ActionType::kBackwardWeight}, model.backward_weight);
    if (model.backward) {
      own.backward = mean(stage_cost, std::pair{s, ActionType::kBackward}, *model.backward);
    }
    if (model.recompute) {
      own.recompute = mean(stage_cost, std::pair{s, ActionType::kRecompute}, *model.recompute);
    }
  }
  m.simulated_bubble = schedule::simulate(plan, model).bubble_ratio;
  // Note [Measured message delay]: the input of F(s, i) is sent by SEND_F(s-1, i), that of
  // B / I (s, i) by SEND_B(s+1, i); the simulator already delays a message until its send is
  // issued, so the delay is counted from there.
  // A wait shorter than kArrivedMs found its message there already (the cost of the wait call).
  constexpr double kArrivedMs = 0.05;
  std::vector<double> delays;
  for (const Waited& w : waits) {
    if (w.wait < kArrivedMs) continue;
    const bool backward = w.action.type != ActionType::kForward;
    const int from = backward ? w.action.stage + 1 : w.action.stage - 1;
    auto it = sent.find({from, backward, w.action.micro_batch});
    if (it == sent.end() || plan.rank_of(from) == w.rank) continue;
    delays.push_back(std::max(0.0, w.start - it->second));
  }
  if (!delays.empty()) {
    std::nth_element(delays.begin(), delays.begin() + delays.size() / 2, delays.end());
    m.message_delay_ms = delays[delays.size() / 2];
  }
  schedule::CostModel with_comm = model;
  with_comm.comm = m.message_delay_ms;
  m.simulated_bubble_comm = schedule::simulate(plan, with_comm).bubble_ratio;
  std::vector<schedule::CostModel> stage_with_comm = m.measured_stage_costs;
  for (schedule::CostModel& c : stage_with_comm) c.comm = m.message_delay_ms;
  m.simulated = schedule::simulate(plan, stage_with_comm);
}

// Every rank sends (busy_ms, step_ms, all nine remat counters, recv_wait_ms, peak_bytes,
// start_bytes, resident_peak_bytes, the all-reduce's start and end, device_peak_bytes,
// optimizer_state_bytes, parameter_bytes, gradient_bytes, clock_start_us; the byte
// counts are exact in a double below 2^53) and its timeline to the last stage's rank, which
// computes the bubble.
void Pipeline::Impl::exchange_metrics(StepMetrics& m) {
  const int last = last_rank();
  if (rank != last) {
    const auto& c = m.remat;
    at::Tensor scalars = at::tensor({m.busy_ms,
                                     m.step_ms,
                                     double(c.unit_calls),
                                     double(c.replays),
                                     double(c.early_stops),
                                     double(c.save_calls),
                                     double(c.save_skips),
                                     double(c.packs),
                                     double(c.save_kept),
                                     double(c.output_leaves),
                                     double(c.placeholders),
                                     m.recv_wait_ms,
                                     double(m.peak_bytes),
                                     double(m.start_bytes),
                                     double(m.resident_peak_bytes),
                                     m.allreduce_start_ms,
                                     m.allreduce_end_ms,
                                     double(m.device_peak_bytes),
                                     double(m.optimizer_state_bytes),
                                     double(m.parameter_bytes),
                                     double(m.gradient_bytes),
                                     m.clock_start_us},
                                    at::kDouble);
    comm::send_tensors(transport, last, metrics_tag(),
                       {scalars, timeline_tensor(m.timeline), spans_tensor(m.spans)})
        .wait();
    return;
  }
  double busy = m.busy_ms, makespan = m.step_ms;
  const auto ranks = static_cast<size_t>(plan.ranks_count);
  m.rank_timelines.assign(ranks, {});
  m.rank_spans.assign(ranks, {});
  m.rank_step_ms.assign(ranks, m.step_ms);
  m.rank_clock_start_us.assign(ranks, m.clock_start_us);
  m.rank_start_bytes.assign(static_cast<size_t>(plan.ranks_count), m.start_bytes);
  m.rank_peak_bytes.assign(static_cast<size_t>(plan.ranks_count), m.peak_bytes);
  m.rank_resident_peak_bytes.assign(static_cast<size_t>(plan.ranks_count), m.resident_peak_bytes);
  m.rank_device_peak_bytes.assign(static_cast<size_t>(plan.ranks_count), m.device_peak_bytes);
  m.rank_optimizer_state_bytes.assign(static_cast<size_t>(plan.ranks_count),
                                      m.optimizer_state_bytes);
  m.rank_parameter_bytes.assign(static_cast<size_t>(plan.ranks_count), m.parameter_bytes);
  m.rank_gradient_bytes.assign(static_cast<size_t>(plan.ranks_count), m.gradient_bytes);
  if (options.data_group != nullptr) {
    m.rank_allreduce_ms.assign(static_cast<size_t>(plan.ranks_count),
                               {m.allreduce_start_ms, m.allreduce_end_ms});
  }
  for (int r = 0; r < plan.ranks_count; ++r) {
    if (r == rank) continue;
    Tensors got = comm::recv_tensors(transport, r, metrics_tag()).wait();
    PIPEMAT_CHECK(got.size() == 3 && got[0].defined() && got[0].numel() == kMetricScalars &&
                      got[0].scalar_type() == at::kDouble && got[1].defined(),
                  CommError, "rank ", r, " sent malformed step metrics to rank ", rank);
    auto v = [&](int i) { return got[0][i].item<double>(); };
    busy += v(0);
    makespan = std::max(makespan, v(1));
    m.rank_step_ms[static_cast<size_t>(r)] = v(1);
    m.rank_clock_start_us[static_cast<size_t>(r)] = v(21);
    remat::RematCounters c;
    c.unit_calls = static_cast<int64_t>(v(2));
    c.replays = static_cast<int64_t>(v(3));
    c.early_stops = static_cast<int64_t>(v(4));
    c.save_calls = static_cast<int64_t>(v(5));
    c.save_skips = static_cast<int64_t>(v(6));
    c.packs = static_cast<int64_t>(v(7));
    c.save_kept = static_cast<int64_t>(v(8));
    c.output_leaves = static_cast<int64_t>(v(9));
    c.placeholders = static_cast<int64_t>(v(10));
    m.remat += c;
    m.recv_wait_ms += v(11);
    m.max_rank_peak_bytes = std::max(m.max_rank_peak_bytes, static_cast<int64_t>(v(12)));
    m.rank_peak_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(12));
    m.rank_start_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(13));
    m.rank_resident_peak_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(14));
    m.rank_device_peak_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(17));
    m.rank_optimizer_state_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(18));
    m.rank_parameter_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(19));
    m.rank_gradient_bytes[static_cast<size_t>(r)] = static_cast<int64_t>(v(20));
    if (options.data_group != nullptr) m.rank_allreduce_ms[static_cast<size_t>(r)] = {v(15), v(16)};
    m.rank_timelines[static_cast<size_t>(r)] = timeline_of(got[1], r);
    m.rank_spans[static_cast<size_t>(r)] = spans_of(got[2], r);
  }
  m.rank_timelines[static_cast<size_t>(rank)] = m.timeline;
  m.rank_spans[static_cast<size_t>(rank)] = m.spans;
  build_measured(m);
  m.step_ms = makespan;
  m.bubble = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
  if (options.trace_replicas && options.data_group != nullptr &&
      options.data_group->world_size() > 1) {
    gather_replica_timelines(m);
  }
}

// The message: [step_ms and clock_start_us of every pipeline rank] (2 x ranks doubles), then
// each pipeline rank's timeline and spans tensors.
void Pipeline::Impl::gather_replica_timelines(StepMetrics& m) {
  comm::Transport& group = *options.data_group;
  const int ranks = plan.ranks_count;
  if (group.rank() != 0) {
    std::vector<double> times;
    Tensors message = {at::Tensor()};
    for (int r = 0; r < ranks; ++r) {
      times.push_back(m.rank_step_ms[static_cast<size_t>(r)]);
      times.push_back(m.rank_clock_start_us[static_cast<size_t>(r)]);
      message.push_back(timeline_tensor(m.rank_timelines[static_cast<size_t>(r)]));
      message.push_back(spans_tensor(m.rank_spans[static_cast<size_t>(r)]));
    }
    message[0] = at::tensor(times, at::kDouble);
    comm::send_tensors(group, 0, kTimelinesTag, message).wait();
    return;
  }
  m.replica_timelines.assign(static_cast<size_t>(group.world_size() - 1), {});
  for (int d = 1; d < group.world_size(); ++d) {
    Tensors got = comm::recv_tensors(group, d, kTimelinesTag).wait();
    PIPEMAT_CHECK(got.size() == static_cast<size_t>(1 + 2 * ranks) && got[0].defined() &&
                      got[0].numel() == 2 * ranks && got[0].scalar_type() == at::kDouble,
                  CommError, "replica ", d,
                  " sent malformed timelines to replica 0 (pipeline rank ", rank, ")");
    PipelineTimelines& out = m.replica_timelines[static_cast<size_t>(d - 1)];
    auto v = got[0].accessor<double, 1>();
    for (int r = 0; r < ranks; ++r) {
      out.step_ms.push_back(v[2 * r]);
      out.clock_start_us.push_back(v[2 * r + 1]);
      out.timelines.push_back(timeline_of(got[static_cast<size_t>(1 + 2 * r)], r));
      out.spans.push_back(spans_of(got[static_cast<size_t>(2 + 2 * r)], r));
    }
  }
}

}  // namespace pipemat::pp
