// The step's loss on every rank, and the step metrics every rank sends to the last stage's
// rank: bubble, remat counters, measured timelines and the simulator's prediction for them.

#include <ATen/ATen.h>

#include <algorithm>
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

// [n, 6] doubles: stage, type, micro-batch, start ms, end ms, wait ms.
constexpr int64_t kTimelineColumns = 6;
at::Tensor timeline_tensor(const std::vector<ActionTiming>& timeline) {
  auto t = at::zeros({static_cast<int64_t>(timeline.size()), kTimelineColumns}, at::kDouble);
  auto acc = t.accessor<double, 2>();
  for (size_t i = 0; i < timeline.size(); ++i) {
    acc[i][0] = timeline[i].action.stage;
    acc[i][1] = static_cast<double>(timeline[i].action.type);
    acc[i][2] = timeline[i].action.micro_batch;
    acc[i][3] = timeline[i].start_us / 1000.0;
    acc[i][4] = timeline[i].end_us / 1000.0;
    acc[i][5] = timeline[i].wait_us / 1000.0;
  }
  return t;
}

// The scalars of exchange_metrics' message.
constexpr int64_t kMetricScalars = 21;

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

// The measured timeline as a SimulationResult, and the simulator's prediction with the
// measured mean cost per action type.
void Pipeline::Impl::build_measured(StepMetrics& m,
                                    const std::vector<at::Tensor>& timelines) const {
  std::map<ActionType, std::pair<double, int>> cost;
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
    PIPEMAT_CHECK(timelines[r].dim() == 2 && timelines[r].size(1) == kTimelineColumns &&
                      timelines[r].scalar_type() == at::kDouble,
                  CommError, "rank ", r, " sent a malformed timeline");
    auto acc = timelines[r].accessor<double, 2>();
    for (int64_t i = 0; i < timelines[r].size(0); ++i) {
      schedule::TimedAction ta;
      ta.action.stage = static_cast<int>(acc[i][0]);
      ta.action.type = static_cast<ActionType>(static_cast<int>(acc[i][1]));
      ta.action.micro_batch = static_cast<int>(acc[i][2]);
      ta.position = static_cast<int>(out.actions.size());
      ta.start = acc[i][3];
      ta.end = acc[i][4];
      waits.push_back({r, ta.action, ta.start, acc[i][5]});
      if (!schedule::is_compute(ta.action.type)) {
        sent[{ta.action.stage, ta.action.type == ActionType::kSendBackward,
              ta.action.micro_batch}] = ta.start;
        continue;
      }
      out.busy += ta.end - ta.start;
      if (out.actions.empty()) out.first_start = ta.start;
      out.last_end = ta.end;
      auto& c = cost[ta.action.type];
      c.first += ta.end - ta.start;
      c.second += 1;
      out.actions.push_back(ta);
    }
    makespan = std::max(makespan, out.last_end);
    busy += out.busy;
  }
  m.measured.makespan = makespan;
  m.measured.bubble_ratio = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
  auto mean = [&](ActionType t, double fallback) {
    auto it = cost.find(t);
    return it == cost.end() || it->second.second == 0 ? fallback
                                                      : it->second.first / it->second.second;
  };
  schedule::CostModel model;
  model.forward = mean(ActionType::kForward, 1.0);
  model.backward_input = mean(ActionType::kBackwardInput, model.forward);
  model.backward_weight = mean(ActionType::kBackwardWeight, model.forward);
  if (cost.count(ActionType::kBackward)) model.backward = mean(ActionType::kBackward, 2.0);
  if (cost.count(ActionType::kRecompute)) model.recompute = mean(ActionType::kRecompute, 0.0);
  m.measured_costs = model;
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
}

// Every rank sends (busy_ms, step_ms, all nine remat counters, recv_wait_ms, peak_bytes,
// start_bytes, resident_peak_bytes, the all-reduce's start and end, device_peak_bytes,
// optimizer_state_bytes, parameter_bytes, gradient_bytes; the byte
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
                                     double(m.gradient_bytes)},
                                    at::kDouble);
    comm::send_tensors(transport, last, metrics_tag(), {scalars, timeline_tensor(m.timeline)})
        .wait();
    return;
  }
  double busy = m.busy_ms, makespan = m.step_ms;
  std::vector<at::Tensor> timelines(plan.ranks_count);
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
    PIPEMAT_CHECK(got.size() == 2 && got[0].defined() && got[0].numel() == kMetricScalars &&
                      got[0].scalar_type() == at::kDouble && got[1].defined(),
                  CommError, "rank ", r, " sent malformed step metrics to rank ", rank);
    auto v = [&](int i) { return got[0][i].item<double>(); };
    busy += v(0);
    makespan = std::max(makespan, v(1));
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
    timelines[r] = got[1];
  }
  timelines[rank] = timeline_tensor(m.timeline);
  build_measured(m, timelines);
  m.step_ms = makespan;
  m.bubble = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
}

}  // namespace pipemat::pp
