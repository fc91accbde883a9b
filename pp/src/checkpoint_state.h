#pragma once
// A rank's state by global name (Note [Global names] in pipemat/pp/pipeline.h), as a checkpoint
// of format 4 stores it (Note [Checkpoint layout] in pipemat/pp/checkpoint.h): what a rank
// writes, what it must read, and the optimizer built from what it read. Private to pp.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "pipemat/pp/pipeline.h"
#include "pipemat/pp/tensor_dtype.h"
#include "pipemat/weights/safetensors.h"

namespace pipemat::pp::detail {

// The global name of parameter or buffer `name` of `stage` (PipelineStage::global_name;
// "stage<index>.<name>" without one).
std::string stage_global_name(const PipelineStage& stage, const std::string& name);

// The name of the generator state's tensor (written by pipeline rank 0 of replica 0).
inline constexpr const char* kGeneratorTensor = "pipemat.rng";
// An optimizer other than the five elementwise ones: rank r's own torch archive of its state, a
// U8 tensor under this name, which loads only on the layout that wrote it.
std::string optimizer_blob_name(int rank);

// One tensor (or a piece of one) of a rank's state.
struct NamedTensor {
  std::string name;  // global: "<name>", "<name>:<field>", "<name>:step", kGeneratorTensor
  at::Tensor value;  // elements [begin, end) of the whole tensor (the whole: its shape)
  std::vector<int64_t> shape;  // the whole tensor's
  int64_t begin = 0, end = 0;
  int stage = -1;
  std::string what;  // "stage 1's parameter 'layers.0.w'", for messages
};

// What a load reads into this rank: the stored name, where it goes and what it must be.
struct Wanted {
  std::string name;
  at::Tensor into;  // a parameter or buffer; undefined for optimizer state (kept apart)
  int stage = -1;
  std::string what;
};

// Pipeline's internals for its checkpoints.
struct PipelineAccess {
  // The global name of parameter or buffer `name` of stage `stage` (PipelineStage::global_name;
  // "stage<s>.<name>" without one).
  static std::string global_name(const Pipeline& p, int stage, const std::string& name);
  // Collective over the pipeline (Note [Tied weights]: the copies are checked first, once). What
  // this replica of this rank stores: with `weights` its stages' parameters (a tied weight
  // only on the lowest stage holding it) and buffers, the generator state on rank 0; with
  // `optimizer` the state of its parameters (sharded: of this replica's pieces) as
  // "<name>:<field>" and "<name>:step", ties' copies but the lowest left out. `ties` gets each
  // tie key whose lowest copy is on this rank -> its global name.
  static std::vector<NamedTensor> saved(Pipeline& p, bool weights, bool optimizer,
                                        std::map<std::string, std::string>& ties);
  // What this rank's stages hold by the names a checkpoint stores them under: parameters and
  // buffers (a tied copy under the name `ties` gives its key, where it gives one).
  static std::vector<Wanted> wanted(const Pipeline& p,
                                    const std::map<std::string, std::string>& ties);
  // The optimizer's kind (optimizer_kind), "" when pp cannot store its state by name.
  static std::string optimizer_kind(const Pipeline& p);
  // This rank's parameters with their stored names (as wanted()), in parameters() order.
  static std::vector<std::pair<std::string, at::Tensor>> named_parameters(
      const Pipeline& p, const std::map<std::string, std::string>& ties);
  // An optimizer over all of this rank's parameters (PipelineOptions::optimizer) holding
  // `states`: parameter index in parameters() -> its state.
  static std::unique_ptr<torch::optim::Optimizer> optimizer_with(
      const Pipeline& p,
      std::map<size_t, std::unique_ptr<torch::optim::OptimizerParamState>> states);
  // Note [Sharded optimizer]: the element ranges [begin, end) of each parameter (its index in
  // parameters()) whose optimizer state this replica keeps; empty when it keeps all of every
  // parameter's (unsharded).
  static std::map<size_t, std::vector<std::pair<int64_t, int64_t>>> kept_ranges(const Pipeline& p);
  // Format 3 (checkpoint.cpp): Pipeline::Impl::join_optimizer_shards.
  static std::unique_ptr<torch::optim::Optimizer> join_optimizer_shards(
      const Pipeline& p, std::vector<torch::serialize::InputArchive>& shards,
      const std::string& where);
  // PipelineOptions::seed as text, "" without one; the data degree.
  static std::string seed(const Pipeline& p);
  static int replicas(const Pipeline& p);
};

}  // namespace pipemat::pp::detail
