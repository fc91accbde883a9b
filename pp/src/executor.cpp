// The action executor: one training step runs this rank's action list (F, SEND/RECV, R, B, I,
// W), each action by its method of StepRun (step_actions.cpp), then the step's tail: the
// gradient all-reduce, clipping, the LR schedule and the optimizer step.

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/pp/compute.h"
#include "pipemat/pp/device.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/stats.h"
#include "step_run.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;

StepMetrics Pipeline::Impl::train_step(const DataSource& data) {
  PIPEMAT_CHECK(static_cast<bool>(data), PipelineError, "train_step: the data source is empty");
  check_remat_paths();
  check_ties();
  StepRun run(*this, data);
  for (size_t k = 0; k < plan.actions[rank].size(); ++k) run.dispatch(k);
  StepMetrics m = run.finish();
  ++next_step;
  return m;
}

StepMetrics Pipeline::Impl::train_step(const MicroBatch& batch) {
  return train_step(split_batch(batch, plan.micro_batches, "train_step"));
}

Pipeline::Impl::StepRun::StepRun(Impl& pipe, const DataSource& data)
    : pipe_(pipe), data_(data), actions_(pipe.plan.actions[pipe.rank]), step_(pipe.next_step) {
  if (!pipe_.options.device.is_cpu()) {
    device_.emplace(pipe_.options.device);
    reset_device_peak(pipe_.options.device);
  }
  if (pipe_.generator.defined()) rng_.emplace(pipe_.generator);
  m_.step = step_;
  for (auto p : pipe_.params) p.mutable_grad().reset();
  if (pipe_.sharded()) {  // Note [Sharded optimizer]: the pieces' gradients too
    for (auto p : pipe_.optimized) p.mutable_grad().reset();
  }
  remat::reset_counters();
  if (pipe_.options.collect_timelines) pipe_.transport.barrier();
  remat::reset_peak_bytes();
  bytes0_ = remat::memory_stats().current_bytes;
  t0_ = std::chrono::steady_clock::now();
  m_.clock_start_us = std::chrono::duration<double, std::micro>(t0_.time_since_epoch()).count();
  const std::vector<int> my_stages = pipe_.plan.stages_of(pipe_.rank);
  reads_inputs_ = std::count(my_stages.begin(), my_stages.end(), 0) > 0;
  reads_targets_ = std::count(my_stages.begin(), my_stages.end(), pipe_.last_stage) > 0;
  offset_ = pipe_.micro_batch_offset();
  step_peak_ = bytes0_;
}

// Note [Profiler scopes]
// Every action a rank runs, and the step's tail, runs inside a LibTorch profiler scope (a user
// scope of at::RecordFunction) named as torch.distributed.pipelining names its actions: "PP:F",
// "PP:B", "PP:I", "PP:W", "PP:R", "PP:SEND_F", "PP:RECV_F", "PP:SEND_B", "PP:RECV_B", with the
// stage and the micro-batch as its two inputs (shown with record_shapes); then
// "PP:GRADIENT_EXCHANGE" (the data group's reduce), "PP:CLIP" and "PP:OPTIMIZER". A user who
// profiles a run (torch::autograd::profiler, or Python's torch.profiler around a pipemat
// extension) sees them around the kernels; without an active profiler a scope costs one check of
// a global flag.

void Pipeline::Impl::StepRun::dispatch(size_t k) {
  const Action& a = actions_[k];
  int64_t action_start = 0;
  if (schedule::is_compute(a.type)) {
    step_peak_ = std::max(step_peak_, remat::reset_peak_bytes());
    action_start = remat::memory_stats().current_bytes;
  }
  a0_ = last_end_;  // Note [Step trace]: the rank's events tile its step
  waited_us_ = 0;
  received_ = false;
  io_bytes_ = 0;
  // Note [Profiler scopes]: the action around its kernels in a LibTorch profiler's trace.
  RECORD_USER_SCOPE_WITH_INPUTS(
      std::string("PP:") + schedule::action_type_code(a.type),
      std::vector<c10::IValue>({c10::IValue(int64_t{a.stage}), c10::IValue(a.micro_batch)}));
  switch (a.type) {
    case ActionType::kRecvForward:
      recv_forward(a);
      break;
    case ActionType::kRecvBackward:
      recv_backward(a);
      break;
    case ActionType::kForward:
      forward(a);
      break;
    case ActionType::kSendForward:
      send_forward(a);
      break;
    case ActionType::kRecompute:
      recompute(a);
      break;
    case ActionType::kBackward:
      backward(a);
      break;
    case ActionType::kBackwardInput:
      backward_input(a);
      break;
    case ActionType::kBackwardWeight:
      backward_weight(a, k);
      break;
    case ActionType::kSendBackward:
      send_backward(a);
      break;
  }
  drop_finished_sends();
  if (pipe_.options.data_group != nullptr) {
    const auto f = pipe_.final_backward.find(a.stage);
    // A stage whose weight tail ran posted its buckets there.
    // Note [Tied weights]: a stage holding a tied copy posts at the end, after the sum.
    if (f != pipe_.final_backward.end() && f->second == k && !pipe_.weight_tails.count(a.stage) &&
        !pipe_.tied_stages.count(a.stage))
      post(a.stage);
  }
  record(a, action_start);
}

// A finished send's work holds the tensors it sent; dropping it at once (its error, if any,
// rethrown here) keeps them from piling up until the step's end, one message per micro-batch.
void Pipeline::Impl::StepRun::drop_finished_sends() {
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(),
                              [](const comm::TensorListWork& w) {
                                if (!w.is_completed()) return false;
                                w.wait();
                                return true;
                              }),
               sends_.end());
}

int64_t Pipeline::Impl::StepRun::message_bytes(const Tensors& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return bytes;
}

void Pipeline::Impl::StepRun::record(const Action& a, int64_t action_start) {
  // A receive's post is not an event: its time counts to the next one (Note [Step trace]).
  if (a.type == ActionType::kRecvForward || a.type == ActionType::kRecvBackward) return;
  const double a1 = now_us();
  last_end_ = a1;
  if (schedule::is_compute(a.type)) {
    busy_us_ += a1 - a0_;
    recv_wait_us_ += waited_us_;
    m_.timeline.push_back({a, a0_, a1, waited_us_, action_start - bytes0_,
                           remat::memory_stats().peak_bytes - bytes0_, received_, io_bytes_});
  } else {
    m_.timeline.push_back({a, a0_, a1, 0, 0, 0, false, io_bytes_});
  }
}

// Note [Overlapped gradient all-reduce]: a stage's buckets leave after its final_backward.
void Pipeline::Impl::StepRun::post(int stage) {
  if (first_post_us_ < 0) first_post_us_ = now_us();
  exchanges_.push_back(pipe_.post_gradients(stage));
  for (const auto& p : pipe_.stage_params.at(stage)) {
    posted_bytes_ += p.grad().defined() ? static_cast<int64_t>(p.grad().nbytes()) : 0;
  }
}

void Pipeline::Impl::StepRun::end_allreduce() {
  for (const auto& [s, ps] : pipe_.stage_params) {  // a stage without a backward here: now
    if (!pipe_.final_backward.count(s) || pipe_.tied_stages.count(s)) post(s);
  }
  const double f0 = now_us();
  for (GradientExchange& x : exchanges_) pipe_.finish_gradients(x, step_);
  const double f1 = now_us();
  m_.spans.push_back({StepPart::kGradientExchange, first_post_us_, f1, -1, -1, posted_bytes_});
  span(StepPart::kGradientWait);
  m_.allreduce_start_ms = first_post_us_ / 1000.0;
  m_.allreduce_end_ms = f1 / 1000.0;
  m_.allreduce_ms = m_.allreduce_end_ms - m_.allreduce_start_ms;
  m_.allreduce_wait_ms = (f1 - f0) / 1000.0;
}

StepMetrics Pipeline::Impl::StepRun::finish() {
  for (auto& w : sends_) w.wait();
  span(StepPart::kSendWait);
  const PipelineOptions& options = pipe_.options;
  if (!pipe_.ties.empty()) {
    pipe_.sum_tied_gradients(step_);  // Note [Tied weights]: before the data group's reduce
    span(StepPart::kTiedSum);
  }
  if (options.data_group != nullptr) {
    RECORD_USER_SCOPE("PP:GRADIENT_EXCHANGE");
    end_allreduce();
  }
  // The gradients held now: the parameters' (unsharded) or the pieces' (sharded).
  std::vector<at::Tensor> grads;
  for (const auto& p : pipe_.optimized) grads.push_back(p.grad());
  m_.gradient_bytes = remat::storage_bytes(grads);
  m_.parameter_bytes = pipe_.parameter_bytes;
  if (options.clip_grad_norm > 0) {
    RECORD_USER_SCOPE("PP:CLIP");
    m_.grad_norm = pipe_.clip_global_norm(options.clip_grad_norm, step_);
    span(StepPart::kClip);
  }
  {
    RECORD_USER_SCOPE("PP:OPTIMIZER");
    if (options.lr_schedule) options.lr_schedule(*pipe_.optimizer, step_);
    pipe_.optimizer->step();
    span(StepPart::kOptimizer);
  }
  m_.optimizer_state_bytes = optimizer_state_bytes(*pipe_.optimizer);
  if (pipe_.sharded()) {  // Note [Sharded optimizer]
    const double g0 = now_us();
    pipe_.gather_parameters(step_);
    span(StepPart::kGather);
    m_.gather_ms = (now_us() - g0) / 1000.0;
    for (auto p : pipe_.optimized) p.mutable_grad().reset();  // the slices' gradients are spent
  }
  m_.step_ms = last_end_ / 1000.0;  // the end of its last part (Note [Step trace])
  m_.busy_ms = busy_us_ / 1000.0;
  m_.start_bytes = bytes0_;
  m_.peak_bytes = std::max(step_peak_, remat::memory_stats().peak_bytes) - bytes0_;
  m_.max_rank_peak_bytes = m_.peak_bytes;
  m_.resident_peak_bytes = peak_resident_bytes();
  m_.device_peak_bytes = device_memory(options.device).peak_bytes;
  m_.recv_wait_ms = recv_wait_us_ / 1000.0;
  m_.remat = remat::counters();
  for (const auto& [mb, l] : losses_) m_.loss += l;
  if (options.collect_timelines) pipe_.exchange_metrics(m_);
  m_.loss = pipe_.share_loss(m_.loss);
  if (options.data_group != nullptr) m_.loss = pipe_.average_loss(m_.loss, step_);
  return std::move(m_);
}

}  // namespace pipemat::pp
