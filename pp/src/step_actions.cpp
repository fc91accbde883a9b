// The actions of a training step, one method of StepRun each: RECV and SEND of activations and
// gradients, F (with the loss on the last stage), R, B, and the split backward's I and W.

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/stats.h"
#include "split_backward.h"
#include "step_run.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;

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

}  // namespace

void Pipeline::Impl::StepRun::recv_forward(const Action& a) {
  recv_f_[{a.stage, a.micro_batch}] =
      comm::recv_tensors(pipe_.transport, schedule::peer_rank(pipe_.plan, a), pipe_.tag_of(a));
}

void Pipeline::Impl::StepRun::recv_backward(const Action& a) {
  recv_b_[{a.stage, a.micro_batch}] =
      comm::recv_tensors(pipe_.transport, schedule::peer_rank(pipe_.plan, a), pipe_.tag_of(a));
}

void Pipeline::Impl::StepRun::forward(const Action& a) {
  MicroBatchState mb;
  mb.inputs = forward_inputs(a);
  Tensors out;
  {
    remat::InvocationScope scope({step_, a.stage, a.micro_batch});
    pipe_.reseed(step_, offset_ + a.micro_batch, stage_stream(pipe_.stages.at(a.stage)));
    PrecisionRegion precision(pipe_.options.precision, pipe_.options.device);
    out = pipe_.stages.at(a.stage).forward(mb.inputs);
    mb.group = scope.group();
  }
  if (a.stage == pipe_.last_stage) {
    take_loss(a, mb, out);
  } else {
    keep_outputs(a, mb, std::move(out));
  }
  if (a.stage == 0 && a.stage != pipe_.last_stage) batch(a.micro_batch).inputs.clear();
  mbs_.emplace(Key{a.stage, a.micro_batch}, std::move(mb));
}

Tensors Pipeline::Impl::StepRun::forward_inputs(const Action& a) {
  Tensors inputs;
  if (a.stage == 0) {
    for (const auto& t : batch(a.micro_batch).inputs) {
      inputs.push_back(t.defined() ? t.detach() : t);
    }
    return inputs;
  }
  if (take_handoff(handoff_f_, a, inputs)) return inputs;
  inputs = take_received(recv_f_, a, "no input for ");
  pipe_.check_received(a.stage, pipe_.plan.rank_of(a.stage - 1), step_, a.micro_batch, inputs);
  return pipe_.on_device(std::move(inputs));
}

bool Pipeline::Impl::StepRun::take_handoff(std::map<Key, Tensors>& from, const Action& a,
                                           Tensors& out) {
  auto h = from.find({a.stage, a.micro_batch});
  if (h == from.end()) return false;
  out = std::move(h->second);
  from.erase(h);
  return true;
}

Tensors Pipeline::Impl::StepRun::take_received(std::map<Key, comm::TensorListWork>& from,
                                               const Action& a, const char* missing) {
  auto r = from.find({a.stage, a.micro_batch});
  PIPEMAT_INTERNAL_ASSERT(r != from.end(), missing, schedule::format_action(a), " on rank ",
                          pipe_.rank);
  const double w0 = a0_;  // the action's start: Note [Step trace]
  Tensors got = r->second.wait();
  from.erase(r);
  a0_ = now_us();
  waited_us_ = a0_ - w0;
  received_ = true;
  io_bytes_ = message_bytes(got);
  return got;
}

void Pipeline::Impl::StepRun::take_loss(const Action& a, MicroBatchState& mb, const Tensors& out) {
  const double l0 = now_us();
  MicroBatch& b = batch(a.micro_batch);
  pipe_.reseed(step_, offset_ + a.micro_batch, kLossStream);
  at::Tensor loss =
      pipe_.scaled_loss(out, b.targets, pipe_.plan.micro_batches, step_, a.micro_batch);
  if (loss.requires_grad()) {
    mb.roots.push_back(gradient_edge(loss));
    mb.root_outputs.push_back(0);
  }
  losses_[a.micro_batch] = loss.item<double>();
  mb.loss = loss;
  b.targets.clear();
  m_.spans.push_back({StepPart::kLoss, l0, now_us(), a.stage, a.micro_batch});
}

void Pipeline::Impl::StepRun::keep_outputs(const Action& a, MicroBatchState& mb, Tensors out) {
  for (size_t j = 0; j < out.size(); ++j) {
    if (out[j].defined() && out[j].requires_grad()) {
      mb.roots.push_back(gradient_edge(out[j]));
      mb.root_outputs.push_back(j);
    }
  }
  const std::string bad = pipe_.check_sent(a.stage, step_, a.micro_batch, out);
  if (pipe_.plan.is_local_handoff(a.stage, a.stage + 1)) {
    PIPEMAT_CHECK(bad.empty(), PipelineError, bad);
    handoff_f_[{a.stage + 1, a.micro_batch}] = as_received(out);
  } else if (!bad.empty()) {
    fail_boundary(a, out, bad);
  } else {
    mb.outputs = std::move(out);
  }
}

// Note [A bad boundary fails on both sides]: send what the stage returned, wait for the receiver
// to fail on it (or kReceiverReportWait), then fail.
void Pipeline::Impl::StepRun::fail_boundary(const Action& a, const Tensors& out,
                                            const std::string& bad) {
  const int receiver = pipe_.plan.rank_of(a.stage + 1);
  comm::send_tensors(
      pipe_.transport, receiver,
      schedule::message_id(pipe_.plan, {a.stage, ActionType::kSendForward, a.micro_batch}),
      as_received(out))
      .wait();
  try {
    pipe_.transport.recv_any(receiver, pipe_.unsent_tag())
        ->wait(std::min(pipe_.transport.timeout(), kReceiverReportWait));
  } catch (const CommError&) {  // the receiver's transport went, or the wait ended
  }
  PIPEMAT_THROW(PipelineError, bad);
}

void Pipeline::Impl::StepRun::send_forward(const Action& a) {
  MicroBatchState& mb = state(a);
  io_bytes_ = message_bytes(mb.outputs);
  // The graph keeps only the outputs' edges.
  sends_.push_back(comm::send_tensors(pipe_.transport, schedule::peer_rank(pipe_.plan, a),
                                      pipe_.tag_of(a), pipe_.on_host(as_received(mb.outputs))));
  mb.outputs.clear();  // freed once the send is done
}

void Pipeline::Impl::StepRun::recompute(const Action& a) { state(a).group->pretrigger(); }

void Pipeline::Impl::StepRun::backward(const Action& a) {
  MicroBatchState& mb = state(a);
  const Tensors grads = a.stage == pipe_.last_stage ? Tensors{} : incoming_grads(a);
  std::vector<torch::autograd::Edge> roots;
  Tensors gs;
  root_grads(a, mb, grads, roots, gs);
  if (!roots.empty()) {
    remat::PhaseScope phase(remat::Phase::kBackward);
    run_backward(roots, gs);
  }
  deliver_dx(a, input_grads(mb));
  mb.group->release();
  mbs_.erase({a.stage, a.micro_batch});
}

void Pipeline::Impl::StepRun::backward_input(const Action& a) {
  MicroBatchState& mb = state(a);
  const Tensors grads = a.stage == pipe_.last_stage ? Tensors{} : incoming_grads(a);
  mb.group->retain();  // I and W unpack the same replay
  std::vector<torch::autograd::Edge> roots;
  Tensors gs;
  root_grads(a, mb, grads, roots, gs);
  mb.split = std::make_unique<SplitBackward>(roots, mb.inputs, pipe_.stage_params[a.stage]);
  Tensors dx;
  {
    remat::PhaseScope phase(remat::Phase::kBackwardInput);
    dx = mb.split->run_input(gs);
  }
  deliver_dx(a, std::move(dx));
}

void Pipeline::Impl::StepRun::backward_weight(const Action& a, size_t k) {
  // Note [Weight tail]: the tail runs at its first W; its later ones ran with it.
  if (const auto t = pipe_.weight_tails.find(a.stage);
      t != pipe_.weight_tails.end() && k >= t->second.front()) {
    if (k == t->second.front()) run_weight_tail(a.stage);
    return;
  }
  MicroBatchState& mb = state(a);
  {
    remat::PhaseScope phase(remat::Phase::kBackwardWeight);
    mb.split->run_weight();
  }
  mb.group->release();
  mbs_.erase({a.stage, a.micro_batch});
}

void Pipeline::Impl::StepRun::send_backward(const Action& a) {
  auto it = pending_dx_.find({a.stage, a.micro_batch});
  PIPEMAT_INTERNAL_ASSERT(it != pending_dx_.end(), schedule::format_action(a), " before its I/B");
  io_bytes_ = message_bytes(it->second);
  sends_.push_back(comm::send_tensors(pipe_.transport, schedule::peer_rank(pipe_.plan, a),
                                      pipe_.tag_of(a), pipe_.on_host(it->second)));
  pending_dx_.erase(it);
}

Tensors Pipeline::Impl::StepRun::incoming_grads(const Action& a) {
  Tensors g;
  if (take_handoff(handoff_b_, a, g)) return g;
  return pipe_.on_device(take_received(recv_b_, a, "no gradient source for "));
}

// The roots of (s,i) with the gradients that arrived for them (undefined ones skipped).
void Pipeline::Impl::StepRun::root_grads(const Action& a, const MicroBatchState& mb,
                                         const Tensors& grads,
                                         std::vector<torch::autograd::Edge>& roots,
                                         Tensors& out) const {
  if (a.stage == pipe_.last_stage) {
    if (!mb.roots.empty()) {
      roots = mb.roots;
      out = {at::ones_like(mb.loss)};
    }
    return;
  }
  for (size_t k = 0; k < mb.roots.size(); ++k) {
    const size_t j = mb.root_outputs[k];
    PIPEMAT_CHECK(j < grads.size(), CommError, "stage ", a.stage, " on rank ", pipe_.rank, " got ",
                  grads.size(), " gradients from stage ", a.stage + 1, " for micro-batch ",
                  a.micro_batch, " but output ", j,
                  " needs one; both ranks must run the same pipemat build");
    if (!grads[j].defined()) continue;
    roots.push_back(mb.roots[k]);
    out.push_back(grads[j]);
  }
}

Tensors Pipeline::Impl::StepRun::input_grads(const MicroBatchState& mb) {
  Tensors dx;
  for (const auto& in : mb.inputs) {
    dx.push_back(in.defined() && in.requires_grad() ? in.grad() : at::Tensor());
  }
  return dx;
}

void Pipeline::Impl::StepRun::deliver_dx(const Action& a, Tensors dx) {
  if (a.stage == 0) return;
  if (pipe_.plan.is_local_handoff(a.stage - 1, a.stage)) {
    handoff_b_[{a.stage - 1, a.micro_batch}] = std::move(dx);
  } else {
    pending_dx_[{a.stage, a.micro_batch}] = std::move(dx);
  }
}

void Pipeline::Impl::StepRun::run_weight_tail(int stage) {
  const std::vector<std::pair<size_t, size_t>>& ranges = pipe_.buckets.at(stage);
  std::vector<SplitBackward*> tail;
  for (size_t p : pipe_.weight_tails.at(stage)) tail.push_back(state(actions_[p]).split.get());
  if (first_post_us_ < 0) first_post_us_ = now_us();
  GradientExchange x;
  x.stage = stage;
  {
    remat::PhaseScope phase(remat::Phase::kBackwardWeight);
    for (size_t b = 0; b < ranges.size(); ++b) {
      const bool last = b + 1 == ranges.size();
      for (SplitBackward* w : tail) w->run_weight(ranges[b].first, ranges[b].second, last);
      x.buckets.push_back(pipe_.post_bucket(stage, b));
    }
  }
  exchanges_.push_back(std::move(x));
  for (size_t p : pipe_.weight_tails.at(stage)) {
    const Action& w = actions_[p];
    state(w).group->release();
    mbs_.erase({w.stage, w.micro_batch});
  }
}

MicroBatch& Pipeline::Impl::StepRun::batch(int micro_batch) {
  auto it = batches_.find(micro_batch);
  if (it == batches_.end()) {
    pipe_.reseed(step_, offset_ + micro_batch, kDataStream);
    const double d0 = now_us();
    it = batches_.emplace(micro_batch, data_(step_, offset_ + micro_batch)).first;
    m_.data_ms += (now_us() - d0) / 1000.0;
    if (!reads_inputs_) it->second.inputs.clear();
    if (!reads_targets_) it->second.targets.clear();
    it->second.inputs = pipe_.on_device(std::move(it->second.inputs));
    it->second.targets = pipe_.on_device(std::move(it->second.targets));
  }
  return it->second;
}

Pipeline::Impl::StepRun::MicroBatchState& Pipeline::Impl::StepRun::state(const Action& a) {
  auto it = mbs_.find({a.stage, a.micro_batch});
  PIPEMAT_INTERNAL_ASSERT(it != mbs_.end(), schedule::format_action(a), " on rank ", pipe_.rank,
                          " before its forward");
  return it->second;
}

}  // namespace pipemat::pp
