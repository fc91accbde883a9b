#pragma once
// Private to pp. The backward passes of a pipeline stage for any LibTorch module: B (fused), and
// the split one, I (gradient w.r.t. the stage input, needed at once by the previous stage) and W
// (parameter gradients, deferrable into bubbles). This header and split_backward.cpp are pp's
// only reach into LibTorch's autograd internals (Note [Autograd internals of pp's backward]);
// the rest of pp includes no torch/csrc header and calls these functions instead.
//
// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Let X be the autograd nodes of the stage graph from which a stage input's gradient
// accumulator is reachable (the dx chain). I runs the engine from the stage outputs with the
// inputs as the only requested outputs and the graph retained: only X runs, and each node of X
// computes only the outputs the dx chain needs (for a GEMM: dX, not dW). Before I, a pre-hook is
// put on every node u of X that has an edge to a node outside X from which a parameter is
// reachable; it captures the gradients u receives. W then cuts u's edges into X (the graph is
// not used again after W; the other nodes of X never run again, so I releases their saved
// tensors as soon as it ends) and runs the engine from those nodes (roots = their inputs, with the
// captured gradients) with the parameters as the requested outputs: u recomputes only its
// parameter-side outputs (dW) and the parameter branches run, never the dx chain again. Nodes
// outside X never lead into X (they would reach the input), so the cut is complete. The parameter
// gradients are accumulated into `.grad` like AccumulateGrad does (first: set, then: add). Each
// parameter gradient is computed once (no double counting) and I + W equals the fused backward
// bitwise for the GEMMs of the zoo. A stage whose inputs do not require grad (the first stage) has
// an empty X: I does nothing and W is the whole backward. Saved tensors are unpacked by both
// passes, so checkpointed stages keep their replay between I and W (remat InvocationGroup::retain /
// pretrigger).

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <vector>

namespace pipemat::pp {

// The owning pointer to an autograd node, as an Edge holds it: std::shared_ptr in LibTorch 2.11,
// c10::intrusive_ptr from 2.12 on.
using NodePtr = decltype(torch::autograd::Edge::function);

class SplitBackward {
 public:
  // `roots`: gradient edges of the stage outputs (or of the loss); `inputs`: the stage inputs
  // (leaves; any may be undefined or not require grad); `params`: the stage's parameters.
  SplitBackward(std::vector<torch::autograd::Edge> roots, std::vector<at::Tensor> inputs,
                std::vector<at::Tensor> params);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  // I: returns the gradient w.r.t. each input (undefined for an input that needs none or that
  // the outputs do not depend on). Call once.
  std::vector<at::Tensor> run_input(const std::vector<at::Tensor>& root_grads);
  // W: accumulates parameter gradients into `.grad`. Call once, after run_input.
  void run_weight();
  // W in parts (Note [Weight tail] in pp/pipeline.h): the gradients of the parameters
  // params[first, end) only, keeping the graph for the next part unless `last`. Parts never
  // overlap; after run_input, in any order, the last one with `last`.
  void run_weight(size_t first, size_t end, bool last);

  struct Capture;  // gradients a W root received during I

 private:
  // W's first part: cuts the boundary nodes' edges into the dx chain and sets weight_roots_.
  void find_weight_roots();

  std::vector<torch::autograd::Edge> roots_;
  std::vector<at::Tensor> root_grads_;
  std::vector<at::Tensor> inputs_;
  std::vector<size_t> grad_inputs_;  // indices of the inputs that require grad
  std::vector<at::Tensor> params_;
  std::vector<NodePtr> boundary_;
  std::vector<const torch::autograd::Node*> dx_chain_;  // X, sorted
  // The nodes of X that W does not restart from (neither boundary nor an input's accumulator):
  // I releases their saved tensors.
  std::vector<torch::autograd::Node*> dx_only_;
  // Nodes W cut off (kept alive: saved leaves hold their accumulators only weakly).
  std::vector<NodePtr> cut_;
  std::vector<std::shared_ptr<Capture>> captures_;
  // W's roots and their gradients, set by its first part.
  std::vector<torch::autograd::Edge> weight_roots_;
  std::vector<at::Tensor> weight_grads_;
  bool input_done_ = false;
  bool weight_started_ = false;
  bool weight_done_ = false;
};

// Accumulates `grad` into `param.grad()` the way AccumulateGrad does: set when undefined, else
// add in place. Undefined `grad` is ignored.
void accumulate_grad(at::Tensor& param, const at::Tensor& grad);

// The edge a gradient for `t` enters the graph through: its grad_fn, or for a leaf its gradient
// accumulator. A backward root of a stage output or of the loss.
torch::autograd::Edge gradient_edge(const at::Tensor& t);

// B: runs the engine from `roots` with `grads` (one per root) and accumulates the gradient of
// every leaf it reaches into `.grad`, as Tensor::backward does; the graph is freed.
void run_backward(const std::vector<torch::autograd::Edge>& roots,
                  const std::vector<at::Tensor>& grads);

}  // namespace pipemat::pp
