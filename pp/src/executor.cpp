// The action executor: one training step runs this rank's action list (F, SEND/RECV, R, B, I,
// W), then clipping, the LR schedule and the optimizer step.

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/rng.h"
#include "pipemat/remat/stats.h"
#include "split_backward.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;
using Key = std::pair<int, int>;  // (stage, micro-batch)

namespace {

// Note [A bad boundary fails on both sides]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage that returns tensors of another count or dtype than its earlier micro-batches
// (Note [Stage boundary signature]) fails on its rank, and the next stage's rank fails on
// receiving them, each naming both sides. The sender sends the bad message and waits, on a tag
// nobody sends (unsent_tag), until the receiver's transport goes or kReceiverReportWait passes:
// leaving at once made the receiver's report a race, as its next action may be a send to the
// sender (a 1F1B gradient), which fails with "rank 0 has shut down its transport" once the
// sender is gone. The bound keeps a receiver that never reaches the bad micro-batch (it waits
// for something from the failed rank first) from holding the sender for the whole timeout.
constexpr std::chrono::milliseconds kReceiverReportWait{5000};

double since_us(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

void clear_grads(const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

struct MicroBatchState {
  Tensors inputs;                            // leaves (stage > 0: some require grad)
  Tensors outputs;                           // until sent
  std::vector<torch::autograd::Edge> roots;  // of outputs requiring grad, or of the loss
  std::vector<size_t> root_outputs;          // which output each root is
  at::Tensor loss;                           // last stage: the scaled loss
  std::shared_ptr<remat::InvocationGroup> group;
  std::unique_ptr<SplitBackward> split;
};

}  // namespace

StepMetrics Pipeline::Impl::train_step(const DataSource& data) {
  PIPEMAT_CHECK(static_cast<bool>(data), PipelineError, "train_step: the data source is empty");
  std::optional<remat::ThreadGeneratorScope> rng;
  if (generator.defined()) rng.emplace(generator);
  const int64_t step = next_step;
  const int64_t M = plan.micro_batches;
  StepMetrics m;
  m.step = step;
  std::map<Key, MicroBatchState> mbs;
  std::map<Key, comm::TensorListWork> recv_f, recv_b;
  std::map<Key, Tensors> handoff_f, handoff_b, pending_dx;
  std::map<int, MicroBatch> batches;  // drawn once per micro-batch
  std::map<int, double> losses;
  std::vector<comm::TensorListWork> sends;
  clear_grads(params);
  remat::reset_counters();
  if (options.collect_timelines) transport.barrier(transport.timeout());
  remat::reset_peak_bytes();
  const int64_t bytes0 = remat::memory_stats().current_bytes;
  const auto t0 = std::chrono::steady_clock::now();
  double busy_us = 0;

  // Only the first stage reads a micro-batch's inputs and only the last its targets: a rank
  // keeps neither half longer than its stages need it (the inputs go after F of stage 0, the
  // targets after the loss).
  const std::vector<int> my_stages = plan.stages_of(rank);
  const bool reads_inputs = std::count(my_stages.begin(), my_stages.end(), 0) > 0;
  const bool reads_targets = std::count(my_stages.begin(), my_stages.end(), last_stage) > 0;
  const int64_t offset = micro_batch_offset();  // Note [Data x pipeline]
  auto batch = [&](int micro_batch) -> MicroBatch& {
    auto it = batches.find(micro_batch);
    if (it == batches.end()) {
      reseed(step, offset + micro_batch, kDataStream);
      it = batches.emplace(micro_batch, data(step, offset + micro_batch)).first;
      if (!reads_inputs) it->second.inputs.clear();
      if (!reads_targets) it->second.targets.clear();
    }
    return it->second;
  };
  double a0 = 0;         // start of the current action's compute (after its receive, if any)
  double waited_us = 0;  // how long the current action waited for its input
  double recv_wait_us = 0;
  auto incoming_grads = [&](const Action& a) -> Tensors {
    auto h = handoff_b.find({a.stage, a.micro_batch});
    if (h != handoff_b.end()) {
      Tensors g = std::move(h->second);
      handoff_b.erase(h);
      return g;
    }
    auto r = recv_b.find({a.stage, a.micro_batch});
    PIPEMAT_INTERNAL_ASSERT(r != recv_b.end(), "no gradient source for ",
                            schedule::format_action(a), " on rank ", rank);
    const double w0 = since_us(t0);
    Tensors g = r->second.wait();
    recv_b.erase(r);
    a0 = since_us(t0);
    waited_us = a0 - w0;
    return g;
  };
  // The roots of (s,i) with the gradients that arrived for them (undefined ones skipped).
  auto root_grads = [&](const Action& a, MicroBatchState& mb, const Tensors& grads,
                        std::vector<torch::autograd::Edge>& roots, Tensors& out) {
    if (a.stage == last_stage) {
      if (!mb.roots.empty()) {
        roots = mb.roots;
        out = {at::ones_like(mb.loss)};
      }
      return;
    }
    for (size_t k = 0; k < mb.roots.size(); ++k) {
      const size_t j = mb.root_outputs[k];
      PIPEMAT_CHECK(j < grads.size(), CommError, "stage ", a.stage, " on rank ", rank, " got ",
                    grads.size(), " gradients from stage ", a.stage + 1, " for micro-batch ",
                    a.micro_batch, " but output ", j,
                    " needs one; both ranks must run the same pipemat build");
      if (!grads[j].defined()) continue;
      roots.push_back(mb.roots[k]);
      out.push_back(grads[j]);
    }
  };
  auto deliver_dx = [&](const Action& a, Tensors dx) {
    if (a.stage == 0) return;
    if (plan.is_local_handoff(a.stage - 1, a.stage)) {
      handoff_b[{a.stage - 1, a.micro_batch}] = std::move(dx);
    } else {
      pending_dx[{a.stage, a.micro_batch}] = std::move(dx);
    }
  };
  auto input_grads = [](const MicroBatchState& mb) {
    Tensors dx;
    for (const auto& in : mb.inputs) {
      dx.push_back(in.defined() && in.requires_grad() ? in.grad() : at::Tensor());
    }
    return dx;
  };
  auto state = [&](const Action& a) -> MicroBatchState& {
    auto it = mbs.find({a.stage, a.micro_batch});
    PIPEMAT_INTERNAL_ASSERT(it != mbs.end(), schedule::format_action(a), " on rank ", rank,
                            " before its forward");
    return it->second;
  };

  // Note [Overlapped gradient all-reduce]: a stage's buckets leave after its final_backward.
  const std::vector<Action>& my_actions = plan.actions[rank];
  std::vector<GradientExchange> exchanges;
  double first_post_us = -1;
  auto post = [&](int stage) {
    if (first_post_us < 0) first_post_us = since_us(t0);
    exchanges.push_back(post_gradients(stage));
  };
  // Note [Weight tail]: runs the stage's tail of W actions and posts its buckets.
  auto run_weight_tail = [&](int stage) {
    const std::vector<std::pair<size_t, size_t>>& ranges = buckets.at(stage);
    std::vector<SplitBackward*> tail;
    for (size_t p : weight_tails.at(stage)) tail.push_back(state(my_actions[p]).split.get());
    if (first_post_us < 0) first_post_us = since_us(t0);
    GradientExchange x;
    x.stage = stage;
    {
      remat::PhaseScope phase(remat::Phase::kBackwardWeight);
      for (size_t b = 0; b < ranges.size(); ++b) {
        const bool last = b + 1 == ranges.size();
        for (SplitBackward* w : tail) w->run_weight(ranges[b].first, ranges[b].second, last);
        x.buckets.push_back(post_bucket(stage, ranges[b].first, ranges[b].second));
      }
    }
    exchanges.push_back(std::move(x));
    for (size_t p : weight_tails.at(stage)) {
      const Action& w = my_actions[p];
      state(w).group->release();
      mbs.erase({w.stage, w.micro_batch});
    }
  };

  int64_t step_peak = bytes0;  // the peaks of the actions so far (each action restarts it)
  for (size_t k = 0; k < my_actions.size(); ++k) {
    const Action& a = my_actions[k];
    int64_t action_start = 0;
    if (schedule::is_compute(a.type)) {
      step_peak = std::max(step_peak, remat::reset_peak_bytes());
      action_start = remat::memory_stats().current_bytes;
    }
    a0 = since_us(t0);
    waited_us = 0;
    const Key key{a.stage, a.micro_batch};
    switch (a.type) {
      case ActionType::kRecvForward:
        recv_f[key] = comm::recv_tensors(transport, schedule::peer_rank(plan, a), tag_of(a));
        break;
      case ActionType::kRecvBackward:
        recv_b[key] = comm::recv_tensors(transport, schedule::peer_rank(plan, a), tag_of(a));
        break;
      case ActionType::kForward: {
        MicroBatchState mb;
        if (a.stage == 0) {
          for (const auto& t : batch(a.micro_batch).inputs) {
            mb.inputs.push_back(t.defined() ? t.detach() : t);
          }
        } else if (auto h = handoff_f.find(key); h != handoff_f.end()) {
          mb.inputs = std::move(h->second);
          handoff_f.erase(h);
        } else {
          auto r = recv_f.find(key);
          PIPEMAT_INTERNAL_ASSERT(r != recv_f.end(), "no input for ", schedule::format_action(a),
                                  " on rank ", rank);
          const double w0 = since_us(t0);
          mb.inputs = r->second.wait();
          recv_f.erase(r);
          a0 = since_us(t0);
          waited_us = a0 - w0;
          check_received(a.stage, plan.rank_of(a.stage - 1), step, a.micro_batch, mb.inputs);
        }
        Tensors out;
        {
          remat::InvocationScope scope({step, a.stage, a.micro_batch});
          reseed(step, offset + a.micro_batch, a.stage);
          out = stages.at(a.stage).forward(mb.inputs);
          mb.group = scope.group();
        }
        if (a.stage == last_stage) {
          MicroBatch& b = batch(a.micro_batch);
          reseed(step, offset + a.micro_batch, kLossStream);
          at::Tensor loss = scaled_loss(out, b.targets, M, step, a.micro_batch);
          if (loss.requires_grad()) {
            mb.roots.push_back(gradient_edge(loss));
            mb.root_outputs.push_back(0);
          }
          losses[a.micro_batch] = loss.item<double>();
          mb.loss = loss;
          b.targets.clear();
        } else {
          for (size_t j = 0; j < out.size(); ++j) {
            if (out[j].defined() && out[j].requires_grad()) {
              mb.roots.push_back(gradient_edge(out[j]));
              mb.root_outputs.push_back(j);
            }
          }
          const std::string bad = check_sent(a.stage, step, a.micro_batch, out);
          if (plan.is_local_handoff(a.stage, a.stage + 1)) {
            PIPEMAT_CHECK(bad.empty(), PipelineError, bad);
            handoff_f[{a.stage + 1, a.micro_batch}] = as_received(out);
          } else if (!bad.empty()) {
            // Note [A bad boundary fails on both sides]: send what the stage returned, wait for
            // the receiver to fail on it (or kReceiverReportWait), then fail.
            const int receiver = plan.rank_of(a.stage + 1);
            comm::send_tensors(
                transport, receiver,
                schedule::message_id(plan, {a.stage, ActionType::kSendForward, a.micro_batch}),
                as_received(out))
                .wait();
            try {
              transport.recv_any(receiver, unsent_tag())
                  ->wait(std::min(transport.timeout(), kReceiverReportWait));
            } catch (const CommError&) {  // the receiver's transport went, or the wait ended
            }
            PIPEMAT_THROW(PipelineError, bad);
          } else {
            mb.outputs = std::move(out);
          }
        }
        if (a.stage == 0 && a.stage != last_stage) batch(a.micro_batch).inputs.clear();
        mbs.emplace(key, std::move(mb));
        break;
      }
      case ActionType::kSendForward: {
        MicroBatchState& mb = state(a);
        // The graph keeps only the outputs' edges.
        sends.push_back(comm::send_tensors(transport, schedule::peer_rank(plan, a), tag_of(a),
                                           as_received(mb.outputs)));
        mb.outputs.clear();  // freed once the send is done
        break;
      }
      case ActionType::kRecompute:
        state(a).group->pretrigger();
        break;
      case ActionType::kBackward: {
        MicroBatchState& mb = state(a);
        const Tensors grads = a.stage == last_stage ? Tensors{} : incoming_grads(a);
        std::vector<torch::autograd::Edge> roots;
        Tensors gs;
        root_grads(a, mb, grads, roots, gs);
        if (!roots.empty()) {
          remat::PhaseScope phase(remat::Phase::kBackward);
          run_backward(roots, gs);
        }
        deliver_dx(a, input_grads(mb));
        mb.group->release();
        mbs.erase(key);
        break;
      }
      case ActionType::kBackwardInput: {
        MicroBatchState& mb = state(a);
        const Tensors grads = a.stage == last_stage ? Tensors{} : incoming_grads(a);
        mb.group->retain();  // I and W unpack the same replay
        std::vector<torch::autograd::Edge> roots;
        Tensors gs;
        root_grads(a, mb, grads, roots, gs);
        mb.split = std::make_unique<SplitBackward>(roots, mb.inputs, stage_params[a.stage]);
        Tensors dx;
        {
          remat::PhaseScope phase(remat::Phase::kBackwardInput);
          dx = mb.split->run_input(gs);
        }
        deliver_dx(a, std::move(dx));
        break;
      }
      case ActionType::kBackwardWeight: {
        // Note [Weight tail]: the tail runs at its first W; its later ones ran with it.
        if (const auto t = weight_tails.find(a.stage);
            t != weight_tails.end() && k >= t->second.front()) {
          if (k == t->second.front()) run_weight_tail(a.stage);
          break;
        }
        MicroBatchState& mb = state(a);
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
            comm::send_tensors(transport, schedule::peer_rank(plan, a), tag_of(a), it->second));
        pending_dx.erase(it);
        break;
      }
    }
    // A finished send's work holds the tensors it sent; dropping it at once (its error, if any,
    // rethrown here) keeps them from piling up until the step's end, one message per
    // micro-batch.
    sends.erase(std::remove_if(sends.begin(), sends.end(),
                               [](const comm::TensorListWork& w) {
                                 if (!w.is_completed()) return false;
                                 w.wait();
                                 return true;
                               }),
                sends.end());
    if (options.data_group != nullptr) {
      const auto f = final_backward.find(a.stage);
      // A stage whose weight tail ran posted its buckets there.
      if (f != final_backward.end() && f->second == k && !weight_tails.count(a.stage))
        post(a.stage);
    }
    if (schedule::is_compute(a.type)) {
      const double a1 = since_us(t0);
      busy_us += a1 - a0;
      recv_wait_us += waited_us;
      m.timeline.push_back(
          {a, a0, a1, waited_us, action_start - bytes0, remat::memory_stats().peak_bytes - bytes0});
    } else if (a.type == ActionType::kSendForward || a.type == ActionType::kSendBackward) {
      m.timeline.push_back({a, a0, a0, 0});  // when the send was issued
    }
  }
  for (auto& w : sends) w.wait();
  if (options.data_group != nullptr) {
    for (const auto& [s, ps] : stage_params) {  // a stage without a backward here: now
      if (!final_backward.count(s)) post(s);
    }
    const double f0 = since_us(t0);
    for (GradientExchange& x : exchanges) finish_gradients(x, step);
    const double f1 = since_us(t0);
    m.allreduce_start_ms = first_post_us / 1000.0;
    m.allreduce_end_ms = f1 / 1000.0;
    m.allreduce_ms = m.allreduce_end_ms - m.allreduce_start_ms;
    m.allreduce_wait_ms = (f1 - f0) / 1000.0;
  }
  if (options.clip_grad_norm > 0) m.grad_norm = clip_global_norm(options.clip_grad_norm);
  if (options.lr_schedule) options.lr_schedule(*optimizer, step);
  optimizer->step();
  m.step_ms = since_us(t0) / 1000.0;
  m.busy_ms = busy_us / 1000.0;
  m.start_bytes = bytes0;
  m.peak_bytes = std::max(step_peak, remat::memory_stats().peak_bytes) - bytes0;
  m.max_rank_peak_bytes = m.peak_bytes;
  m.resident_peak_bytes = peak_resident_bytes();
  m.recv_wait_ms = recv_wait_us / 1000.0;
  m.remat = remat::counters();
  for (const auto& [mb, l] : losses) m.loss += l;
  if (options.collect_timelines) exchange_metrics(m);
  m.loss = share_loss(m.loss);
  if (options.data_group != nullptr) m.loss = average_loss(m.loss, step);
  ++next_step;
  return m;
}

StepMetrics Pipeline::Impl::train_step(const MicroBatch& batch) {
  return train_step(split_batch(batch, plan.micro_batches, "train_step"));
}

}  // namespace pipemat::pp
