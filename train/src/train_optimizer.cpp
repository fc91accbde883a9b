#include "train_optimizer.h"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "pipemat/core/error.h"
#include "pipemat/train/model_run.h"

namespace pipemat::train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainingOptions& t,
                                                        const std::vector<at::Tensor>& params) {
  switch (t.optimizer) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  }
  PIPEMAT_INTERNAL_ASSERT(false, "training.optimizer ", static_cast<int>(t.optimizer),
                          " is not a value of OptimizerKind");
}

pp::LrSchedule lr_schedule_of(const TrainingOptions& training) {
  if (training.warmup == 0 && training.lr_decay == LrDecay::kNone) return nullptr;
  return [training](torch::optim::Optimizer& optimizer, int64_t step) {
    const double lr = lr_at(training, step);
    for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
  };
}

}  // namespace pipemat::train
