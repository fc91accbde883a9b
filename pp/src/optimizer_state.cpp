// The per-parameter state of the elementwise optimizers (optimizer_state.h).

#include "optimizer_state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>

#include "pipemat/core/error.h"

namespace pipemat::pp::detail {

namespace optim = torch::optim;

std::string optimizer_kind(const optim::Optimizer& o) {
  if (dynamic_cast<const optim::AdamW*>(&o) != nullptr) return "AdamW";
  if (dynamic_cast<const optim::Adam*>(&o) != nullptr) return "Adam";
  if (dynamic_cast<const optim::SGD*>(&o) != nullptr) return "SGD";
  if (dynamic_cast<const optim::RMSprop*>(&o) != nullptr) return "RMSprop";
  if (dynamic_cast<const optim::Adagrad*>(&o) != nullptr) return "Adagrad";
  return "";
}

std::vector<at::Tensor> state_tensors(const optim::OptimizerParamState& s) {
  if (const auto* a = dynamic_cast<const optim::AdamWParamState*>(&s))
    return {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  if (const auto* b = dynamic_cast<const optim::AdamParamState*>(&s))
    return {b->exp_avg(), b->exp_avg_sq(), b->max_exp_avg_sq()};
  if (const auto* g = dynamic_cast<const optim::SGDParamState*>(&s)) return {g->momentum_buffer()};
  if (const auto* r = dynamic_cast<const optim::RMSpropParamState*>(&s))
    return {r->square_avg(), r->momentum_buffer(), r->grad_avg()};
  if (const auto* h = dynamic_cast<const optim::AdagradParamState*>(&s)) return {h->sum()};
  return {};
}

void set_state_tensors(optim::OptimizerParamState& s, const std::vector<at::Tensor>& t) {
  if (auto* a = dynamic_cast<optim::AdamWParamState*>(&s)) {
    a->exp_avg(t.at(0)), a->exp_avg_sq(t.at(1)), a->max_exp_avg_sq(t.at(2));
  } else if (auto* b = dynamic_cast<optim::AdamParamState*>(&s)) {
    b->exp_avg(t.at(0)), b->exp_avg_sq(t.at(1)), b->max_exp_avg_sq(t.at(2));
  } else if (auto* g = dynamic_cast<optim::SGDParamState*>(&s)) {
    g->momentum_buffer(t.at(0));
  } else if (auto* r = dynamic_cast<optim::RMSpropParamState*>(&s)) {
    r->square_avg(t.at(0)), r->momentum_buffer(t.at(1)), r->grad_avg(t.at(2));
  } else if (auto* h = dynamic_cast<optim::AdagradParamState*>(&s)) {
    h->sum(t.at(0));
  }
}

const std::vector<std::string>& state_fields(const std::string& kind) {
  static const std::map<std::string, std::vector<std::string>> fields = {
      {"AdamW", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {"Adam", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {"SGD", {"momentum_buffer"}},
      {"RMSprop", {"square_avg", "momentum_buffer", "grad_avg"}},
      {"Adagrad", {"sum"}},
  };
  static const std::vector<std::string> none;
  const auto it = fields.find(kind);
  return it == fields.end() ? none : it->second;
}

std::optional<int64_t> state_step(const optim::OptimizerParamState& s) {
  if (const auto* a = dynamic_cast<const optim::AdamWParamState*>(&s)) return a->step();
  if (const auto* b = dynamic_cast<const optim::AdamParamState*>(&s)) return b->step();
  if (const auto* r = dynamic_cast<const optim::RMSpropParamState*>(&s)) return r->step();
  if (const auto* h = dynamic_cast<const optim::AdagradParamState*>(&s)) return h->step();
  return std::nullopt;
}

namespace {

// A state of type S with its step counter set.
template <typename S>
std::unique_ptr<optim::OptimizerParamState> stepped(int64_t step) {
  auto s = std::make_unique<S>();
  s->step(step);
  return s;
}

}  // namespace

std::unique_ptr<optim::OptimizerParamState> make_state(const std::string& kind, int64_t step,
                                                       const std::vector<at::Tensor>& fields) {
  std::unique_ptr<optim::OptimizerParamState> out =
      kind == "AdamW"     ? stepped<optim::AdamWParamState>(step)
      : kind == "Adam"    ? stepped<optim::AdamParamState>(step)
      : kind == "RMSprop" ? stepped<optim::RMSpropParamState>(step)
      : kind == "Adagrad" ? stepped<optim::AdagradParamState>(step)
      : kind == "SGD"     ? std::make_unique<optim::SGDParamState>()
                          : nullptr;
  PIPEMAT_INTERNAL_ASSERT(out != nullptr, "make_state of an unknown optimizer kind");
  set_state_tensors(*out, fields);
  return out;
}

}  // namespace pipemat::pp::detail
