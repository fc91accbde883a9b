#pragma once
// The optimizer and learning-rate schedule of a run (private to train), built from
// TrainingOptions the same way for the pipeline (train.cpp) and the reference
// (train_reference.cpp), so that both step their parameters alike.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "pipemat/pp/pipeline.h"
#include "pipemat/train/options.h"

namespace pipemat::train {

// training.optimizer over `params`: SGD (lr, momentum, weight_decay) or AdamW (lr, weight_decay).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainingOptions& t,
                                                        const std::vector<at::Tensor>& params);

// Sets every parameter group's lr to lr_at(training, step); null when the lr is constant
// (no warmup, no decay).
pp::LrSchedule lr_schedule_of(const TrainingOptions& training);

}  // namespace pipemat::train
