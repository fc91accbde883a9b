// B, I and W of a stage (Note [Split backward]) on LibTorch's autograd engine.

#include "split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "pipemat/core/error.h"

// Note [Autograd internals of pp's backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The public C++ API (torch::autograd::backward / grad) takes tensors and runs whole graphs;
// pp's backward passes need more, and every use of autograd internals in pp is in this file:
//  - torch::autograd::Engine::execute with roots given as edges and explicit `outputs`: B runs
//    from the stage outputs' edges (or the loss's) and accumulates into `.grad`; I requests
//    only the input gradients and keeps the graph; W requests only the parameter gradients,
//    with accumulate_grad off (accumulate_grad() here does what AccumulateGrad would).
//  - torch::autograd::impl::gradient_edge: the edges of outputs, the loss, inputs and params.
//  - Node::add_pre_hook / pre_hooks() with a FunctionPreHook: the captures on W's roots, which
//    ~SplitBackward finds again by their dynamic type and removes.
//  - Node::next_edges(), the mutable edge list: W cuts the edges into the dx chain, which
//    Node::set_next_edge would refuse.
// What differs per version: Edge::function, the owning pointer to a node, is a std::shared_ptr
// in LibTorch 2.11 (a node gives its own through shared_from_this()) and a c10::intrusive_ptr
// from 2.12 on (through getptr()); NodePtr (split_backward.h) and owning_ptr() follow it. The
// other calls above have the same form in 2.11 to 2.15. What they do (that execute with
// `outputs` runs only the nodes on paths to them, that a pre-hook sees the gradients its node
// receives, that cutting edges of a graph no longer executed is safe) is relied on for every
// LibTorch the configure step accepts (2.11 to 2.15, Note [Finding LibTorch] in
// cmake/PipematTorch.cmake); check it before widening that range.
namespace pipemat::pp {

using torch::autograd::Edge;
using torch::autograd::Node;

struct SplitBackward::Capture {
  std::vector<at::Tensor> grads;
  bool seen = false;
};

namespace {

class CaptureHook final : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureHook(std::shared_ptr<SplitBackward::Capture> capture)
      : capture_(std::move(capture)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    capture_->grads = grads;
    capture_->seen = true;
    return grads;
  }

 private:
  std::shared_ptr<SplitBackward::Capture> capture_;
};

// `node` as the owning pointer its parents' edges hold.
NodePtr owning_ptr(Node* node) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12
  return node->getptr();
#else
  return node->shared_from_this();
#endif
}

// Nodes reachable from `roots` (iterative DFS, each node once).
std::vector<Node*> reachable(const std::vector<Edge>& roots) {
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (const auto& e : roots) {
    if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    order.push_back(n);
    for (const auto& e : n->next_edges()) {
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  return order;
}

// Nodes of `nodes` from which one of `targets` is reachable (fixpoint over the edges).
std::unordered_set<Node*> reaching(const std::vector<Node*>& nodes,
                                   const std::unordered_set<Node*>& targets) {
  std::unordered_set<Node*> out(targets.begin(), targets.end());
  bool changed = true;
  while (changed) {
    changed = false;
    for (Node* n : nodes) {
      if (out.count(n)) continue;
      for (const auto& e : n->next_edges()) {
        if (e.function && out.count(e.function.get())) {
          out.insert(n);
          changed = true;
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace

torch::autograd::Edge gradient_edge(const at::Tensor& t) {
  return torch::autograd::impl::gradient_edge(t);
}

void run_backward(const std::vector<Edge>& roots, const std::vector<at::Tensor>& grads) {
  torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

void accumulate_grad(at::Tensor& param, const at::Tensor& grad) {
  if (!grad.defined()) return;
  at::Tensor& g = param.mutable_grad();
  if (!g.defined()) {
    g = grad.detach();
  } else {
    g.add_(grad);
  }
}

SplitBackward::SplitBackward(std::vector<Edge> roots, std::vector<at::Tensor> inputs,
                             std::vector<at::Tensor> params)
    : roots_(std::move(roots)), inputs_(std::move(inputs)), params_(std::move(params)) {
  const auto nodes = reachable(roots_);
  std::unordered_set<Node*> x_targets;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (!inputs_[i].defined() || !inputs_[i].requires_grad()) continue;
    grad_inputs_.push_back(i);
    x_targets.insert(torch::autograd::impl::gradient_edge(inputs_[i]).function.get());
  }
  std::unordered_set<Node*> p_targets;
  for (const auto& p : params_) {
    if (p.requires_grad()) p_targets.insert(torch::autograd::impl::gradient_edge(p).function.get());
  }
  if (x_targets.empty()) return;  // first stage: W does the whole backward from the roots
  const auto x_nodes = reaching(nodes, x_targets);
  const auto p_nodes = reaching(nodes, p_targets);
  dx_chain_.assign(x_nodes.begin(), x_nodes.end());
  std::sort(dx_chain_.begin(), dx_chain_.end());
  for (Node* n : nodes) {
    if (!x_nodes.count(n) || x_targets.count(n)) continue;
    bool boundary = false;
    for (const auto& e : n->next_edges()) {
      Node* v = e.function.get();
      if (v && !x_nodes.count(v) && p_nodes.count(v)) boundary = true;
    }
    if (!boundary) {
      dx_only_.push_back(n);
      continue;
    }
    auto capture = std::make_shared<Capture>();
    n->add_pre_hook(std::make_unique<CaptureHook>(capture));
    boundary_.push_back(owning_ptr(n));
    captures_.push_back(std::move(capture));
  }
}

SplitBackward::~SplitBackward() {
  // Remove our capture hooks (the graph may outlive us).
  for (size_t i = 0; i < boundary_.size(); ++i) {
    auto& hooks = boundary_[i]->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                                 return dynamic_cast<CaptureHook*>(h.get()) != nullptr;
                               }),
                hooks.end());
  }
}

std::vector<at::Tensor> SplitBackward::run_input(const std::vector<at::Tensor>& root_grads) {
  PIPEMAT_INTERNAL_ASSERT(!input_done_, "SplitBackward::run_input called twice");
  input_done_ = true;
  root_grads_ = root_grads;
  std::vector<at::Tensor> dx(inputs_.size());
  if (roots_.empty() || grad_inputs_.empty()) return dx;
  std::vector<Edge> outputs;
  for (size_t i : grad_inputs_) outputs.push_back(torch::autograd::impl::gradient_edge(inputs_[i]));
  auto& engine = torch::autograd::Engine::get_default_engine();
  auto out = engine.execute(roots_, root_grads_, /*keep_graph=*/true, /*create_graph=*/false,
                            /*accumulate_grad=*/false, outputs);
  for (size_t k = 0; k < grad_inputs_.size(); ++k) dx[grad_inputs_[k]] = out.at(k);
  // Note [Split backward]: W restarts from the boundary nodes and never runs the rest of X again,
  // so what only the dx chain needed (GELU's input, attention's q, k, v and output, a norm's
  // statistics without parameters) is released now instead of when W ends: between I and W a
  // stage holds only what its parameter gradients need.
  for (Node* n : dx_only_) n->release_variables();  // alive: roots_ holds the graph until W
  return dx;
}

void SplitBackward::run_weight() { run_weight(0, params_.size(), /*last=*/true); }

void SplitBackward::run_weight(size_t first, size_t end, bool last) {
  PIPEMAT_INTERNAL_ASSERT(input_done_ && !weight_done_ && first <= end && end <= params_.size(),
                          "SplitBackward::run_weight out of order");
  if (!weight_started_) {
    weight_started_ = true;
    find_weight_roots();
  }
  weight_done_ = last;
  std::vector<Edge> outputs;
  std::vector<at::Tensor*> targets;
  for (size_t i = first; i < end; ++i) {
    at::Tensor& p = params_[i];
    if (!p.requires_grad()) continue;
    outputs.push_back(torch::autograd::impl::gradient_edge(p));
    targets.push_back(&p);
  }
  if (!outputs.empty() && !weight_roots_.empty()) {
    auto& engine = torch::autograd::Engine::get_default_engine();
    auto out = engine.execute(weight_roots_, weight_grads_, /*keep_graph=*/!last,
                              /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
    for (size_t i = 0; i < targets.size(); ++i) accumulate_grad(*targets[i], out[i]);
  }
  if (last) {
    weight_roots_.clear();
    weight_grads_.clear();
  }
}

void SplitBackward::find_weight_roots() {
  if (roots_.empty()) return;
  std::vector<Edge>& roots = weight_roots_;
  std::vector<at::Tensor>& grads = weight_grads_;
  if (grad_inputs_.empty()) {
    roots = roots_;
    grads = root_grads_;
  } else {
    for (size_t i = 0; i < boundary_.size(); ++i) {
      if (!captures_[i]->seen) continue;
      Node* u = boundary_[i].get();
      for (size_t e = 0; e < u->num_outputs(); ++e) {
        const Node* next = u->next_edge(e).function.get();
        if (next && std::binary_search(dx_chain_.begin(), dx_chain_.end(), next)) {
          cut_.push_back(u->next_edge(e).function);
          // The dx chain already ran in I. Node::set_next_edge refuses to change a node that
          // already has a parent (it would have to update the topological number); cutting an
          // edge to nothing never needs that, so W writes the edge list directly.
          u->next_edges()[e] = Edge();
        }
      }
      for (size_t k = 0; k < captures_[i]->grads.size(); ++k) {
        if (!captures_[i]->grads[k].defined()) continue;
        roots.emplace_back(boundary_[i], static_cast<uint32_t>(k));
        grads.push_back(captures_[i]->grads[k]);
      }
    }
    captures_.clear();
  }
}

}  // namespace pipemat::pp
