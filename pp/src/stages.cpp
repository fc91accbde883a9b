// Stages from modules, AnyModules, callables and a split Sequential (the make_stage family of
// pipemat/pp/pipeline.h).

#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/pp/pipeline.h"

namespace pipemat::pp {

namespace detail {
void throw_arity(int stage, size_t expected, size_t got) {
  PIPEMAT_THROW(PipelineError, "stage ", stage, ": the module's forward takes ", expected,
                " tensor", expected == 1 ? "" : "s", " but the stage got ", got,
                "; the previous stage (or MicroBatch::inputs on stage 0) must produce exactly "
                "the tensors this forward takes, in order");
}
}  // namespace detail

namespace {

// One tensor goes in as at::Tensor, several as std::vector<at::Tensor>.
torch::nn::AnyValue call_any(torch::nn::AnyModule& module, const Tensors& in) {
  return in.size() == 1 ? module.any_forward(in[0]) : module.any_forward(in);
}

Tensors tensors_of(torch::nn::AnyValue value, int stage) {
  if (auto* t = value.try_get<at::Tensor>()) return {*t};
  if (auto* v = value.try_get<Tensors>()) return *v;
  if (auto* t2 = value.try_get<std::tuple<at::Tensor, at::Tensor>>()) {
    return {std::get<0>(*t2), std::get<1>(*t2)};
  }
  if (auto* t3 = value.try_get<std::tuple<at::Tensor, at::Tensor, at::Tensor>>()) {
    return {std::get<0>(*t3), std::get<1>(*t3), std::get<2>(*t3)};
  }
  PIPEMAT_THROW(PipelineError, "stage ", stage, " returned ", value.type_info().name(),
                "; a stage module must return at::Tensor, std::vector<at::Tensor> or a tuple of "
                "2 or 3 tensors");
}

}  // namespace

PipelineStage make_stage(int index, torch::nn::AnyModule module) {
  PIPEMAT_CHECK(!module.is_empty(), ConfigError, "make_stage: the AnyModule of stage ", index,
                " is empty");
  auto shared = std::make_shared<torch::nn::AnyModule>(std::move(module));
  StageForward forward = [shared, index](const Tensors& in) {
    PIPEMAT_CHECK(!in.empty(), PipelineError, "stage ", index, " got no input tensors");
    return tensors_of(call_any(*shared, in), index);
  };
  return make_stage(index, shared->ptr(), std::move(forward));
}

PipelineStage make_stage(int index, std::shared_ptr<torch::nn::Module> module,
                         StageForward forward) {
  PipelineStage s;
  s.index = index;
  s.module = std::move(module);
  s.forward = std::move(forward);
  return s;
}

std::vector<int64_t> balance_by_size(const std::vector<double>& sizes, int stages) {
  const auto n = static_cast<int64_t>(sizes.size());
  PIPEMAT_CHECK(stages >= 1, ConfigError, "balance: stages must be at least 1, got ", stages);
  PIPEMAT_CHECK(n >= stages, ConfigError, "the model has ", n, " layers but the schedule has ",
                stages,
                " stages; every stage needs at least one layer (raise model.layers or lower "
                "schedule.ranks / schedule.virtual_stages)");
  double total = 0;
  for (double s : sizes) total += s;
  std::vector<int64_t> bounds{0};
  double running = 0;
  int64_t i = 0;
  for (int s = 0; s < stages - 1; ++s) {
    const double target = total * (s + 1) / stages;
    do {
      running += sizes[i++];
    } while (i < n - (stages - 1 - s) && running + 0.5 * sizes[i] <= target);
    bounds.push_back(i);
  }
  bounds.push_back(n);
  return bounds;
}

std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int stages) {
  std::vector<double> sizes;
  for (const auto& entry : model->children()) {
    double p = 0;
    for (const auto& t : entry->parameters()) p += static_cast<double>(t.numel());
    sizes.push_back(p);
  }
  return balance_by_size(sizes, stages);
}

StageFactory split_sequential(torch::nn::Sequential model, std::vector<int64_t> bounds) {
  const auto n = static_cast<int64_t>(model->size());
  PIPEMAT_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == n, ConfigError,
                "split_sequential: bounds must run from 0 to the Sequential's size ", n, ", got ",
                bounds.size(), " values from ", bounds.empty() ? -1 : bounds.front(), " to ",
                bounds.empty() ? -1 : bounds.back());
  for (size_t i = 1; i < bounds.size(); ++i) {
    PIPEMAT_CHECK(bounds[i] > bounds[i - 1], ConfigError, "split_sequential: stage ", i - 1,
                  " would be empty (bounds ", bounds[i - 1], " and ", bounds[i],
                  "); every stage needs at least one entry");
  }
  return [model, bounds](int stage) {
    PIPEMAT_CHECK(stage >= 0 && stage + 1 < static_cast<int>(bounds.size()), ConfigError,
                  "split_sequential: stage ", stage, " is out of range; the bounds give ",
                  bounds.size() - 1, " stages");
    torch::nn::Sequential part;
    const auto names = model->named_children();
    for (int64_t i = bounds[stage]; i < bounds[stage + 1]; ++i) {
      part->push_back(names[i].key(), *(model->begin() + i));  // shares the module
    }
    auto forward = [impl = part.ptr(), stage](const Tensors& in) -> Tensors {
      PIPEMAT_CHECK(!in.empty(), PipelineError, "stage ", stage, " got no input tensors");
      torch::nn::AnyValue value = call_any(*impl->begin(), in);
      for (auto it = impl->begin() + 1; it != impl->end(); ++it) {
        value = it->any_forward(std::move(value));
      }
      return tensors_of(std::move(value), stage);
    };
    PipelineStage out = make_stage(stage, part.ptr(), forward);
    // Note [Global names]: the entries keep their names, so a name is its path in `model`.
    out.global_name = [](const std::string& name) { return name; };
    return out;
  };
}

}  // namespace pipemat::pp
