#pragma once
// The model of a training run split into pipeline stages, and its synthetic data.
//
// A model is `layers` identical layers of one zoo kind (ModelOptions::kind), each mapping
// [tokens, hidden] to [tokens, hidden]. Every rank builds all layers from the same seed (so the
// pipeline and the single-process reference hold bit-identical weights) and keeps the layers of
// its own stages. A stage holds its layers in a Sequential named `layers`, so remat policy paths
// are relative to a stage: "layers.*" (each layer a checkpoint unit), "layers.*.gemm".

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "pipemat/models/model.h"

namespace pipemat::models {

// Builds the layers of the model in order. Deterministic for a seed; serialized process-wide
// (initialization draws from the global generator), so threads-as-ranks get equal weights.
std::vector<torch::nn::AnyModule> build_layers(const ModelOptions& model, uint64_t seed);

// First layer of every stage plus the end: `stages + 1` ascending boundaries. From
// partition.layers_per_stage when given, else balanced by parameter count. ConfigError when
// there are fewer layers than stages or the explicit partition does not fit.
std::vector<int64_t> partition_layers(const std::vector<torch::nn::AnyModule>& layers,
                                      const PartitionOptions& partition, int stages);
// The same for layers of the given sizes (balanced by size when no explicit partition).
std::vector<int64_t> partition_sizes(const std::vector<double>& sizes,
                                     const PartitionOptions& partition, int stages);

// One pipeline stage: a contiguous range of layers.
struct StageImpl : torch::nn::Module {
  explicit StageImpl(const std::vector<torch::nn::AnyModule>& layers);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(Stage);

// The remat policy of `config` for a stage of `model` (paths relative to the stage).
remat::RematPolicy stage_policy(const ModelOptions& model, const RematConfig& config);

// Input and target ([tokens, hidden] each) of micro-batch `micro_batch` of step `step`:
// generated from (seed, step, micro_batch) with a private generator, identical on every rank.
std::pair<at::Tensor, at::Tensor> micro_batch_data(const ModelOptions& model, uint64_t seed,
                                                   int64_t step, int64_t micro_batch);

// Loss of one micro-batch: mean squared error, scaled by 1 / micro_batches so that gradients
// accumulated over the micro-batches of a step are those of the mean loss.
at::Tensor micro_batch_loss(const at::Tensor& output, const at::Tensor& target,
                            int64_t micro_batches);

}  // namespace pipemat::models
