#include "pipemat/pp/runtime.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <map>

#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/split_backward.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/policy.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;
using Key = std::pair<int, int>;  // (stage, micro-batch)

namespace {

double since_us(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainingOptions& t,
                                                        std::vector<at::Tensor> params) {
  if (t.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
  }
  PIPEMAT_CHECK(t.optimizer == "adamw", ConfigError, "training.optimizer: '", t.optimizer,
                "' is not allowed; allowed: sgd, adamw");
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
}

void clear_grads(const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

}  // namespace

struct PipelineRuntime::Impl {
  struct MicroBatch {
    at::Tensor input;
    at::Tensor output;  // until sent or handed off
    torch::autograd::Edge root;
    at::Tensor loss;
    std::shared_ptr<remat::InvocationGroup> group;
    std::unique_ptr<SplitBackward> split;
  };

  TrainConfig config;
  comm::Transport& transport;
  schedule::Schedule plan;
  int rank;
  int last_stage;
  std::map<int, Stage> stages;
  std::map<int, std::vector<at::Tensor>> stage_params;
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  comm::TensorMeta activation_meta;

  Impl(const TrainConfig& c, comm::Transport& t) : config(c), transport(t) {
    plan = schedule::build_schedule(config.schedule);
    rank = transport.rank();
    PIPEMAT_CHECK(plan.ranks_count == transport.world_size(), ConfigError, "schedule.stages is ",
                  plan.ranks_count, " but the job has ", transport.world_size(),
                  " ranks; start as many ranks as schedule.stages (e.g. pipemat-run -n ",
                  plan.ranks_count, " ...) or set schedule.stages=", transport.world_size());
    last_stage = plan.stages_count - 1;
    auto layers = build_layers(config.model, config.training.seed);
    auto bounds = partition_layers(layers, config.partition, plan.stages_count);
    const auto policy = stage_policy(config.model, config.remat);
    std::vector<at::Tensor> all_params;
    for (int s : plan.stages_of(rank)) {
      std::vector<torch::nn::AnyModule> mine(layers.begin() + bounds[s],
                                             layers.begin() + bounds[s + 1]);
      Stage stage(mine);
      if (!policy.checkpoint.empty()) remat::apply_policy(*stage, policy);
      for (const auto& item : stage->named_parameters()) {
        // "layers.<local>.<rest>" -> "layers.<global>.<rest>"
        const std::string& key = item.key();
        const auto first = key.find('.'), second = key.find('.', first + 1);
        const int64_t local = std::stoll(key.substr(first + 1, second - first - 1));
        named.emplace_back("layers." + std::to_string(bounds[s] + local) + key.substr(second),
                           item.value());
        stage_params[s].push_back(item.value());
        all_params.push_back(item.value());
      }
      stages.emplace(s, stage);
    }
    optimizer = make_optimizer(config.training, all_params);
    activation_meta.dtype = at::kFloat;
    activation_meta.shape = {config.model.tokens, config.model.hidden};
  }

  int tag_of(const Action& a) const { return schedule::message_id(plan, a); }
  int metrics_tag() const { return 2 * plan.stages_count * plan.micro_batches; }

  StepMetrics run_step(int64_t step) {
    StepMetrics m;
    m.step = step;
    std::map<Key, MicroBatch> mbs;
    std::map<Key, comm::TensorWork> recv_f, recv_b;
    std::map<Key, at::Tensor> handoff_f, handoff_b, pending_dx;
    std::map<int, double> losses;
    std::vector<comm::TensorWork> sends;
    std::vector<at::Tensor> params;
    for (auto& [s, ps] : stage_params) params.insert(params.end(), ps.begin(), ps.end());
    clear_grads(params);
    remat::reset_counters();
    transport.barrier(transport.timeout());
    remat::reset_peak_bytes();
    const int64_t bytes0 = remat::memory_stats().current_bytes;
    auto& engine = torch::autograd::Engine::get_default_engine();
    const auto t0 = std::chrono::steady_clock::now();
    double busy_us = 0;

    double a0 = 0;  // start of the current action's compute (after its receive, if any)
    auto incoming_grad = [&](const Action& a, MicroBatch& mb) {
      if (a.stage == last_stage) return at::ones_like(mb.loss);
      auto h = handoff_b.find({a.stage, a.micro_batch});
      if (h != handoff_b.end()) {
        at::Tensor g = h->second;
        handoff_b.erase(h);
        return g;
      }
      auto r = recv_b.find({a.stage, a.micro_batch});
      PIPEMAT_INTERNAL_ASSERT(r != recv_b.end(), "no gradient source for ",
                              schedule::format_action(a), " on rank ", rank);
      at::Tensor g = r->second.wait();
      recv_b.erase(r);
      a0 = since_us(t0);
      return g;
    };
    auto deliver_dx = [&](const Action& a, const at::Tensor& dx) {
      if (a.stage == 0) return;
      if (plan.is_local_handoff(a.stage - 1, a.stage)) {
        handoff_b[{a.stage - 1, a.micro_batch}] = dx;
      } else {
        pending_dx[{a.stage, a.micro_batch}] = dx;
      }
    };
    auto state = [&](const Action& a) -> MicroBatch& {
      auto it = mbs.find({a.stage, a.micro_batch});
      PIPEMAT_INTERNAL_ASSERT(it != mbs.end(), schedule::format_action(a), " on rank ", rank,
                              " before its forward");
      return it->second;
    };

    for (const Action& a : plan.actions[rank]) {
      // Compute time starts once the action's input is here: waiting for a receive is bubble.
      a0 = since_us(t0);
      const Key key{a.stage, a.micro_batch};
      switch (a.type) {
        case ActionType::kRecvForward:
          recv_f[key] = comm::recv_tensor(transport, schedule::peer_rank(plan, a), tag_of(a),
                                          activation_meta);
          break;
        case ActionType::kRecvBackward:
          recv_b[key] = comm::recv_tensor(transport, schedule::peer_rank(plan, a), tag_of(a),
                                          activation_meta);
          break;
        case ActionType::kForward: {
          at::Tensor in, target;
          if (a.stage == 0 || a.stage == last_stage) {
            std::tie(in, target) =
                micro_batch_data(config.model, config.training.seed, step, a.micro_batch);
          }
          if (a.stage > 0 && handoff_f.count(key)) {
            in = handoff_f[key];
            handoff_f.erase(key);
          } else if (a.stage > 0) {
            in = recv_f.at(key).wait();
            recv_f.erase(key);
            a0 = since_us(t0);
          }
          MicroBatch mb;
          mb.input = in.detach().requires_grad_(a.stage > 0);
          at::Tensor out;
          {
            remat::InvocationScope scope({step, a.stage, a.micro_batch});
            out = stages.at(a.stage)->forward(mb.input);
            mb.group = scope.group();
          }
          if (a.stage == last_stage) {
            mb.loss = micro_batch_loss(out, target, plan.micro_batches);
            mb.root = torch::autograd::impl::gradient_edge(mb.loss);
            losses[a.micro_batch] = mb.loss.item<double>();
          } else {
            mb.root = torch::autograd::impl::gradient_edge(out);
            if (plan.is_local_handoff(a.stage, a.stage + 1)) {
              handoff_f[{a.stage + 1, a.micro_batch}] = out.detach();
            } else {
              mb.output = out;
            }
          }
          mbs.emplace(key, std::move(mb));
          break;
        }
        case ActionType::kSendForward: {
          MicroBatch& mb = state(a);
          sends.push_back(comm::send_tensor(transport, schedule::peer_rank(plan, a), tag_of(a),
                                            mb.output.detach()));
          mb.output = at::Tensor();  // freed once the send is done; the graph keeps its edge
          break;
        }
        case ActionType::kRecompute:
          state(a).group->pretrigger();
          break;
        case ActionType::kBackward: {
          MicroBatch& mb = state(a);
          at::Tensor grad = incoming_grad(a, mb);
          if (mb.root.is_valid()) {  // an output that needs no gradient has no backward
            remat::PhaseScope phase(remat::Phase::kBackward);
            engine.execute({mb.root}, {grad}, /*keep_graph=*/false, /*create_graph=*/false,
                           /*accumulate_grad=*/true);
          }
          if (a.stage > 0) {
            at::Tensor dx = mb.input.grad();
            deliver_dx(a, dx.defined() ? dx : at::zeros_like(mb.input));
          }
          mb.group->release();
          mbs.erase(key);
          break;
        }
        case ActionType::kBackwardInput: {
          MicroBatch& mb = state(a);
          at::Tensor grad = incoming_grad(a, mb);
          mb.group->retain();  // I and W unpack the same replay
          std::vector<torch::autograd::Edge> roots;
          if (mb.root.is_valid()) roots.push_back(mb.root);
          mb.split = std::make_unique<SplitBackward>(roots, mb.input, stage_params[a.stage]);
          at::Tensor dx;
          {
            remat::PhaseScope phase(remat::Phase::kBackwardInput);
            dx = mb.split->run_input(roots.empty() ? std::vector<at::Tensor>{}
                                                   : std::vector<at::Tensor>{grad});
          }
          if (a.stage > 0) deliver_dx(a, dx.defined() ? dx : at::zeros_like(mb.input));
          break;
        }
        case ActionType::kBackwardWeight: {
          MicroBatch& mb = state(a);
          {
            remat::PhaseScope phase(remat::Phase::kBackwardWeight);
            mb.split->run_weight();
          }
          mb.group->release();
          mbs.erase(key);
          break;
        }
        case ActionType::kSendBackward: {
          auto it = pending_dx.find(key);
          PIPEMAT_INTERNAL_ASSERT(it != pending_dx.end(), schedule::format_action(a),
                                  " before its I/B");
          sends.push_back(
              comm::send_tensor(transport, schedule::peer_rank(plan, a), tag_of(a), it->second));
          pending_dx.erase(it);
          break;
        }
      }
      if (schedule::is_compute(a.type)) {
        const double a1 = since_us(t0);
        busy_us += a1 - a0;
        m.timeline.push_back({a, a0, a1});
      }
    }
    for (auto& w : sends) w.wait();
    optimizer->step();
    m.step_ms = since_us(t0) / 1000.0;
    m.busy_ms = busy_us / 1000.0;
    m.peak_bytes = remat::memory_stats().peak_bytes - bytes0;
    m.remat = remat::counters();
    for (const auto& [mb, l] : losses) m.loss += l;
    exchange_metrics(m);
    return m;
  }

  // [n, 5] doubles: stage, type, micro-batch, start ms, end ms.
  static at::Tensor timeline_tensor(const std::vector<ActionTiming>& timeline) {
    auto t = at::zeros({static_cast<int64_t>(timeline.size()), 5}, at::kDouble);
    auto acc = t.accessor<double, 2>();
    for (size_t i = 0; i < timeline.size(); ++i) {
      acc[i][0] = timeline[i].action.stage;
      acc[i][1] = static_cast<double>(timeline[i].action.type);
      acc[i][2] = timeline[i].action.micro_batch;
      acc[i][3] = timeline[i].start_us / 1000.0;
      acc[i][4] = timeline[i].end_us / 1000.0;
    }
    return t;
  }

  // The measured timeline as a SimulationResult, and the simulator's prediction with the
  // measured mean cost per action type.
  void build_measured(StepMetrics& m, const std::vector<at::Tensor>& timelines) const {
    std::map<ActionType, std::pair<double, int>> cost;
    m.measured = schedule::SimulationResult{};
    m.measured.ranks.resize(plan.ranks_count);
    double makespan = 0, busy = 0;
    for (int r = 0; r < plan.ranks_count; ++r) {
      auto& out = m.measured.ranks[r];
      out.rank = r;
      auto acc = timelines[r].accessor<double, 2>();
      for (int64_t i = 0; i < timelines[r].size(0); ++i) {
        schedule::TimedAction ta;
        ta.action.stage = static_cast<int>(acc[i][0]);
        ta.action.type = static_cast<ActionType>(static_cast<int>(acc[i][1]));
        ta.action.micro_batch = static_cast<int>(acc[i][2]);
        ta.position = static_cast<int>(i);
        ta.start = acc[i][3];
        ta.end = acc[i][4];
        out.busy += ta.end - ta.start;
        if (i == 0) out.first_start = ta.start;
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
  }

  // Every rank sends (busy_ms, step_ms) to the last stage's rank, which computes the bubble.
  void exchange_metrics(StepMetrics& m) {
    const int last_rank = plan.rank_of(last_stage);
    if (rank != last_rank) {
      const auto& c = m.remat;
      comm::send_tensor(transport, last_rank, metrics_tag(),
                        at::tensor({m.busy_ms, m.step_ms, double(c.unit_calls), double(c.replays),
                                    double(c.early_stops), double(c.save_calls),
                                    double(c.save_skips), double(c.packs)},
                                   at::kDouble))
          .wait();
      comm::send_tensor(transport, last_rank, metrics_tag() + 1, timeline_tensor(m.timeline))
          .wait();
      return;
    }
    double busy = m.busy_ms, makespan = m.step_ms;
    std::vector<at::Tensor> timelines(plan.ranks_count);
    for (int r = 0; r < plan.ranks_count; ++r) {
      if (r == rank) continue;
      auto t = comm::recv_tensor(transport, r, metrics_tag()).wait();
      auto v = [&](int i) { return t[i].item<double>(); };
      busy += v(0);
      makespan = std::max(makespan, v(1));
      remat::RematCounters c;
      c.unit_calls = static_cast<int64_t>(v(2));
      c.replays = static_cast<int64_t>(v(3));
      c.early_stops = static_cast<int64_t>(v(4));
      c.save_calls = static_cast<int64_t>(v(5));
      c.save_skips = static_cast<int64_t>(v(6));
      c.packs = static_cast<int64_t>(v(7));
      m.remat += c;
      timelines[r] = comm::recv_tensor(transport, r, metrics_tag() + 1).wait();
    }
    timelines[rank] = timeline_tensor(m.timeline);
    build_measured(m, timelines);
    m.step_ms = makespan;
    m.bubble = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
  }
};

PipelineRuntime::PipelineRuntime(const TrainConfig& config, comm::Transport& transport)
    : impl_(std::make_unique<Impl>(config, transport)) {}
PipelineRuntime::~PipelineRuntime() = default;
StepMetrics PipelineRuntime::run_step(int64_t step) { return impl_->run_step(step); }
bool PipelineRuntime::is_last_stage_rank() const {
  return impl_->plan.rank_of(impl_->last_stage) == impl_->rank;
}
const schedule::Schedule& PipelineRuntime::schedule() const { return impl_->plan; }
std::vector<std::pair<std::string, at::Tensor>> PipelineRuntime::named_parameters() const {
  return impl_->named;
}

std::vector<StepMetrics> run_reference(const TrainConfig& config,
                                       std::vector<std::pair<std::string, at::Tensor>>* params) {
  auto layers = build_layers(config.model, config.training.seed);
  Stage model(layers);
  auto optimizer = make_optimizer(config.training, model->parameters());
  std::vector<StepMetrics> out;
  for (int64_t step = 0; step < config.training.steps; ++step) {
    StepMetrics m;
    m.step = step;
    clear_grads(model->parameters());
    remat::reset_peak_bytes();
    const int64_t bytes0 = remat::memory_stats().current_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < config.schedule.micro_batches; ++i) {
      auto [in, target] = micro_batch_data(config.model, config.training.seed, step, i);
      auto loss = micro_batch_loss(model->forward(in), target, config.schedule.micro_batches);
      m.loss += loss.item<double>();
      loss.backward();
    }
    optimizer->step();
    m.step_ms = since_us(t0) / 1000.0;
    m.busy_ms = m.step_ms;
    m.peak_bytes = remat::memory_stats().peak_bytes - bytes0;
    out.push_back(std::move(m));
  }
  if (params) {
    params->clear();
    for (const auto& item : model->named_parameters())
      params->emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace pipemat::pp
