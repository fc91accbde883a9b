#pragma once
// Private to pp: one training step in progress. Pipeline::Impl::train_step (executor.cpp) builds
// a StepRun, dispatches each action of the rank's list to the action's method
// (step_actions.cpp), then runs the step's tail: the gradient all-reduce, clipping, the LR
// schedule, the optimizer step and the metrics.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/pp/device.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/rng.h"
#include "split_backward.h"

namespace pipemat::pp {

class Pipeline::Impl::StepRun {
 public:
  // Starts the step: the rank's generator, cleared gradients and remat counters, the barrier
  // that aligns the ranks' timelines, the step's start time and memory.
  StepRun(Impl& pipe, const DataSource& data);

  // Runs action k of the rank's list, then what every action shares: finished sends dropped,
  // a stage's buckets posted after its final backward, the action's timing and memory.
  void dispatch(size_t k);

  // The step's tail, after the last action: the sends and the gradient all-reduce finished,
  // clipping, the LR schedule and the optimizer step; the step's metrics.
  StepMetrics finish();

 private:
  using Key = std::pair<int, int>;  // (stage, micro-batch)

  struct MicroBatchState {
    Tensors inputs;                            // leaves (stage > 0: some require grad)
    Tensors outputs;                           // until sent
    std::vector<torch::autograd::Edge> roots;  // of outputs requiring grad, or of the loss
    std::vector<size_t> root_outputs;          // which output each root is
    at::Tensor loss;                           // last stage: the scaled loss
    std::shared_ptr<remat::InvocationGroup> group;
    std::unique_ptr<SplitBackward> split;
  };

  // The actions (step_actions.cpp).
  void recv_forward(const schedule::Action& a);
  void recv_backward(const schedule::Action& a);
  void forward(const schedule::Action& a);
  void send_forward(const schedule::Action& a);
  void recompute(const schedule::Action& a);
  void backward(const schedule::Action& a);
  void backward_input(const schedule::Action& a);
  void backward_weight(const schedule::Action& a, size_t k);
  void send_backward(const schedule::Action& a);

  // F's parts: its inputs (the batch's, a local hand-off or a receive), the last stage's loss,
  // the other stages' outputs (a local hand-off or kept until SEND).
  Tensors forward_inputs(const schedule::Action& a);
  void take_loss(const schedule::Action& a, MicroBatchState& mb, const Tensors& out);
  void keep_outputs(const schedule::Action& a, MicroBatchState& mb, Tensors out);
  [[noreturn]] void fail_boundary(const schedule::Action& a, const Tensors& out,
                                  const std::string& bad);
  // A local hand-off of the stage and micro-batch of `a` into `out` (false: none), and the
  // tensors of its posted receive (waited for: the action's wait time).
  static bool take_handoff(std::map<Key, Tensors>& from, const schedule::Action& a, Tensors& out);
  Tensors take_received(std::map<Key, comm::TensorListWork>& from, const schedule::Action& a,
                        const char* missing);
  // B's and I's parts: the gradients that came for the stage's outputs, the roots they go to,
  // the gradients of the stage's inputs and where those go.
  Tensors incoming_grads(const schedule::Action& a);
  void root_grads(const schedule::Action& a, const MicroBatchState& mb, const Tensors& grads,
                  std::vector<torch::autograd::Edge>& roots, Tensors& out) const;
  static Tensors input_grads(const MicroBatchState& mb);
  void deliver_dx(const schedule::Action& a, Tensors dx);
  // Note [Weight tail]: runs the stage's tail of W actions and posts its buckets.
  void run_weight_tail(int stage);

  // Micro-batch `micro_batch`'s data, drawn once.
  MicroBatch& batch(int micro_batch);
  MicroBatchState& state(const schedule::Action& a);
  // Note [Overlapped gradient all-reduce]: posts the stage's buckets.
  void post(int stage);
  void drop_finished_sends();
  void record(const schedule::Action& a, int64_t action_start);
  void end_allreduce();

  // The bytes of a message's tensors (undefined ones count 0).
  static int64_t message_bytes(const Tensors& tensors);
  // Note [Step trace]: a part of the step's tail, from the end of the rank's previous event.
  void span(StepPart part) {
    const double end = now_us();
    m_.spans.push_back({part, last_end_, end});
    last_end_ = end;
  }

  double now_us() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_)
        .count();
  }

  Impl& pipe_;
  const DataSource& data_;
  std::optional<DeviceScope> device_;  // a CUDA rank's device is current during the step
  std::optional<remat::ThreadGeneratorScope> rng_;
  const std::vector<schedule::Action>& actions_;  // this rank's
  const int64_t step_;
  // Only the first stage reads a micro-batch's inputs and only the last its targets: a rank
  // keeps neither half longer than its stages need it (the inputs go after F of stage 0, the
  // targets after the loss).
  bool reads_inputs_ = false;
  bool reads_targets_ = false;
  int64_t offset_ = 0;  // Note [Data x pipeline]
  StepMetrics m_;
  std::map<Key, MicroBatchState> mbs_;
  std::map<Key, comm::TensorListWork> recv_f_, recv_b_;
  std::map<Key, Tensors> handoff_f_, handoff_b_, pending_dx_;
  std::map<int, MicroBatch> batches_;  // drawn once per micro-batch
  std::map<int, double> losses_;
  std::vector<comm::TensorListWork> sends_;
  int64_t bytes0_ = 0;
  std::chrono::steady_clock::time_point t0_;
  double busy_us_ = 0;
  double a0_ = 0;          // start of the current action's compute (after its receive, if any)
  double last_end_ = 0;    // the end of the rank's last event (Note [Step trace])
  double waited_us_ = 0;   // how long the current action waited for its input
  bool received_ = false;  // the current action's input came from another rank
  int64_t io_bytes_ = 0;   // the bytes the current action received or sent
  double recv_wait_us_ = 0;
  std::vector<GradientExchange> exchanges_;
  double first_post_us_ = -1;
  int64_t posted_bytes_ = 0;  // the gradient bytes posted to the data group
  int64_t step_peak_ = 0;     // the peaks of the actions so far (each action restarts it)
};

}  // namespace pipemat::pp
