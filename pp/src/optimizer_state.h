#pragma once
// The per-parameter state of the elementwise optimizers pp knows (torch's AdamW, Adam, SGD,
// RMSprop and Adagrad): its tensors in a fixed order, their names, its step, and a state built
// anew from them. Used by Note [Sharded optimizer] (pieces of a parameter's state) and by
// checkpoints (the state of each parameter by its global name).

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pipemat::pp::detail {

// "AdamW", "Adam", "SGD", "RMSprop" or "Adagrad"; "" for any other optimizer.
std::string optimizer_kind(const torch::optim::Optimizer& optimizer);

// The per-element tensors of an elementwise optimizer's state of one parameter, in a fixed order
// (undefined where unused, as AdamW's max_exp_avg_sq without amsgrad); empty for other types.
std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& state);
// Sets what state_tensors returns, in its order.
void set_state_tensors(torch::optim::OptimizerParamState& state, const std::vector<at::Tensor>& t);
// The names of state_tensors' fields for an optimizer of `kind` (optimizer_kind), in its order:
// AdamW's and Adam's "exp_avg", "exp_avg_sq", "max_exp_avg_sq"; SGD's "momentum_buffer";
// RMSprop's "square_avg", "momentum_buffer", "grad_avg"; Adagrad's "sum".
const std::vector<std::string>& state_fields(const std::string& kind);
// The state's step counter (AdamW, Adam, RMSprop, Adagrad), or nothing (SGD).
std::optional<int64_t> state_step(const torch::optim::OptimizerParamState& state);
// A state of an optimizer of `kind` with the step counter `step` (ignored by SGD) and the
// tensors `fields` in state_fields' order (undefined: unused).
std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const std::string& kind, int64_t step, const std::vector<at::Tensor>& fields);

}  // namespace pipemat::pp::detail
