// A rank's state by global name for checkpoints of format 4: checkpoint_state.h.

#include "checkpoint_state.h"

#include <ATen/ATen.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "optimizer_state.h"
#include "pipeline_impl.h"
#include "pipemat/core/error.h"

namespace pipemat::pp::detail {

namespace {

std::string param_what(int stage, const std::string& name) {
  return "stage " + std::to_string(stage) + "'s parameter '" + name + "'";
}

// The optimizer state of one piece of a parameter as named tensors: its fields and its step
// (the step only from the piece that starts the parameter).
void add_state(std::vector<NamedTensor>& out, const std::string& kind,
               const torch::optim::OptimizerParamState& state, const std::string& name,
               const std::vector<int64_t>& shape, int64_t begin, int64_t end, int stage,
               const std::string& what) {
  const std::vector<at::Tensor> fields = state_tensors(state);
  const std::vector<std::string>& names = state_fields(kind);
  for (size_t f = 0; f < fields.size() && f < names.size(); ++f) {
    if (!fields[f].defined()) continue;  // unused (AdamW's max_exp_avg_sq without amsgrad)
    out.push_back({name + ":" + names[f], fields[f].detach(), shape, begin, end, stage,
                   what + "'s " + names[f]});
  }
  const auto step = state_step(state);
  if (step && begin == 0) {
    out.push_back({name + ":step",
                   at::tensor({*step}, at::kLong).reshape({}),
                   {},
                   0,
                   1,
                   stage,
                   what + "'s step"});
  }
}

}  // namespace

std::string stage_global_name(const PipelineStage& stage, const std::string& name) {
  return stage.global_name ? stage.global_name(name)
                           : "stage" + std::to_string(stage.index) + "." + name;
}

std::string optimizer_blob_name(int rank) {
  return "pipemat.optimizer.rank-" + std::to_string(rank);
}

std::string PipelineAccess::global_name(const Pipeline& p, int stage, const std::string& name) {
  return stage_global_name(p.impl_->stages.at(stage), name);
}

std::string PipelineAccess::optimizer_kind(const Pipeline& p) {
  return detail::optimizer_kind(*p.impl_->optimizer);
}

std::string PipelineAccess::seed(const Pipeline& p) {
  const auto& seed = p.impl_->options.seed;
  return seed ? std::to_string(*seed) : "";
}

int PipelineAccess::replicas(const Pipeline& p) {
  const comm::Transport* data = p.impl_->options.data_group;
  return data == nullptr ? 1 : data->world_size();
}

std::vector<NamedTensor> PipelineAccess::saved(Pipeline& p, bool weights, bool optimizer,
                                               std::map<std::string, std::string>& ties) {
  Pipeline::Impl& impl = *p.impl_;
  impl.check_ties();  // collective: every rank calls saved() in its save
  // The lowest copy of each tie: stored, and its name recorded.
  std::set<std::pair<int, std::string>> leaders;
  for (const auto& tie : impl.ties) {
    const auto& first = tie.copies.front();
    leaders.insert({first.stage, first.name});
    if (first.rank == impl.rank) ties[tie.key] = global_name(p, first.stage, first.name);
  }
  const auto stored = [&](int stage, const std::string& name) {
    const PipelineStage& s = impl.stages.at(stage);
    return s.tied.count(name) == 0 || leaders.count({stage, name}) > 0;
  };
  std::vector<NamedTensor> out;
  if (weights) {
    for (const auto& [s, stage] : impl.stages) {
      for (const auto& item : stage.module->named_parameters()) {
        if (!stored(s, item.key())) continue;
        const at::Tensor v = item.value().detach();
        out.push_back({global_name(p, s, item.key()), v, v.sizes().vec(), 0, v.numel(), s,
                       param_what(s, item.key())});
      }
      for (const auto& item : stage.module->named_buffers()) {
        const at::Tensor v = item.value().detach();
        out.push_back({global_name(p, s, item.key()), v, v.sizes().vec(), 0, v.numel(), s,
                       "stage " + std::to_string(s) + "'s buffer '" + item.key() + "'"});
      }
    }
    if (impl.rank == 0 && impl.generator.defined()) {
      const at::Tensor state = impl.generator.get_state();
      out.push_back({kGeneratorTensor, state, state.sizes().vec(), 0, state.numel(), -1,
                     "the generator state"});
    }
  }
  if (!optimizer) return out;
  const std::string kind = detail::optimizer_kind(*impl.optimizer);
  if (kind.empty()) {
    // Another optimizer (never sharded: check_shardable refuses it): its own archive, as this
    // rank's blob, which only this layout can load.
    torch::serialize::OutputArchive archive;
    impl.optimizer->save(archive);
    std::string bytes;
    archive.save_to([&bytes](const void* data, size_t n) -> size_t {
      bytes.append(static_cast<const char*>(data), n);
      return n;
    });
    at::Tensor blob = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
    out.push_back({optimizer_blob_name(impl.rank), blob, blob.sizes().vec(), 0, blob.numel(), -1,
                   "the optimizer's state of rank " + std::to_string(impl.rank)});
    return out;
  }
  const auto& state = impl.optimizer->state();
  for (const auto& [s, ps] : impl.stage_params) {
    const auto named = impl.stages.at(s).module->named_parameters();
    PIPEMAT_INTERNAL_ASSERT(named.size() == ps.size(), "a stage's parameters in two orders");
    if (!impl.sharded()) {
      for (size_t i = 0; i < ps.size(); ++i) {
        const std::string& local = named[i].key();
        if (!stored(s, local)) continue;
        const auto it = state.find(ps[i].unsafeGetTensorImpl());
        if (it == state.end()) continue;  // never stepped
        add_state(out, kind, *it->second, global_name(p, s, local), ps[i].sizes().vec(), 0,
                  ps[i].numel(), s, param_what(s, local));
      }
      continue;
    }
    // Note [Sharded optimizer]: this replica's pieces, each a flat run of its parameter.
    const int me = impl.options.data_group->rank();
    const auto& ranges = impl.buckets.at(s);
    for (size_t b = 0; b < ranges.size(); ++b) {
      const ShardSlice& slice = impl.slices.at(s)[b][static_cast<size_t>(me)];
      for (size_t k = 0; k < slice.pieces.size(); ++k) {
        const ShardPiece& piece = slice.pieces[k];
        const size_t i = ranges[b].first + piece.param;
        const std::string& local = named[i].key();
        if (!stored(s, local)) continue;
        const auto it = state.find(impl.my_pieces.at(s)[b][k].unsafeGetTensorImpl());
        if (it == state.end()) continue;
        add_state(out, kind, *it->second, global_name(p, s, local), ps[i].sizes().vec(),
                  piece.begin, piece.end, s, param_what(s, local));
      }
    }
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> PipelineAccess::named_parameters(
    const Pipeline& p, const std::map<std::string, std::string>& ties) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [s, stage] : p.impl_->stages) {
    for (const auto& item : stage.module->named_parameters()) {
      const auto tie = stage.tied.find(item.key());
      const auto stored = tie == stage.tied.end() ? ties.end() : ties.find(tie->second);
      out.emplace_back(stored != ties.end() ? stored->second : global_name(p, s, item.key()),
                       item.value());
    }
  }
  return out;
}

std::vector<Wanted> PipelineAccess::wanted(const Pipeline& p,
                                           const std::map<std::string, std::string>& ties) {
  std::vector<Wanted> out;
  const auto params = named_parameters(p, ties);
  size_t next = 0;
  for (const auto& [s, stage] : p.impl_->stages) {
    for (const auto& item : stage.module->named_parameters()) {
      out.push_back({params[next++].first, item.value(), s, param_what(s, item.key())});
    }
    for (const auto& item : stage.module->named_buffers()) {
      out.push_back({global_name(p, s, item.key()), item.value(), s,
                     "stage " + std::to_string(s) + "'s buffer '" + item.key() + "'"});
    }
  }
  return out;
}

std::map<size_t, std::vector<std::pair<int64_t, int64_t>>> PipelineAccess::kept_ranges(
    const Pipeline& p) {
  const Pipeline::Impl& impl = *p.impl_;
  std::map<size_t, std::vector<std::pair<int64_t, int64_t>>> out;
  if (!impl.sharded()) return out;
  const int me = impl.options.data_group->rank();
  size_t offset = 0;  // the stage's first parameter in parameters()
  for (const auto& [s, ps] : impl.stage_params) {
    const auto& ranges = impl.buckets.at(s);
    for (size_t b = 0; b < ranges.size(); ++b) {
      for (const ShardPiece& piece : impl.slices.at(s)[b][static_cast<size_t>(me)].pieces) {
        out[offset + ranges[b].first + piece.param].emplace_back(piece.begin, piece.end);
      }
    }
    offset += ps.size();
  }
  for (size_t i = 0; i < impl.params.size(); ++i) out[i];  // none kept: an empty list
  return out;
}

std::unique_ptr<torch::optim::Optimizer> PipelineAccess::join_optimizer_shards(
    const Pipeline& p, std::vector<torch::serialize::InputArchive>& shards,
    const std::string& where) {
  return p.impl_->join_optimizer_shards(shards, where);
}

std::unique_ptr<torch::optim::Optimizer> PipelineAccess::optimizer_with(
    const Pipeline& p,
    std::map<size_t, std::unique_ptr<torch::optim::OptimizerParamState>> states) {
  const Pipeline::Impl& impl = *p.impl_;
  std::unique_ptr<torch::optim::Optimizer> full = impl.options.optimizer(impl.params);
  PIPEMAT_CHECK(full != nullptr, ConfigError,
                "PipelineOptions::optimizer returned no optimizer on rank ", impl.rank);
  for (auto& [i, state] : states) {
    full->state()[impl.params.at(i).unsafeGetTensorImpl()] = std::move(state);
  }
  return full;
}

}  // namespace pipemat::pp::detail

namespace pipemat::pp {

namespace {

// Every dtype a safetensors file spells, with LibTorch's scalar type of it.
constexpr std::pair<weights::Dtype, at::ScalarType> kDtypes[] = {
    {weights::Dtype::kF64, at::kDouble}, {weights::Dtype::kF32, at::kFloat},
    {weights::Dtype::kF16, at::kHalf},   {weights::Dtype::kBF16, at::kBFloat16},
    {weights::Dtype::kI64, at::kLong},   {weights::Dtype::kI32, at::kInt},
    {weights::Dtype::kI16, at::kShort},  {weights::Dtype::kI8, at::kChar},
    {weights::Dtype::kU8, at::kByte},    {weights::Dtype::kBool, at::kBool},
};

}  // namespace

weights::Dtype safetensors_dtype(at::ScalarType type, const std::string& what) {
  for (const auto& [dtype, scalar] : kDtypes) {
    if (scalar == type) return dtype;
  }
  PIPEMAT_THROW(PipelineError, what, " is ", c10::toString(type),
                ", which a safetensors file cannot hold (it holds float, integer and bool "
                "tensors)");
}

at::ScalarType scalar_type_of(weights::Dtype dtype) {
  for (const auto& [d, scalar] : kDtypes) {
    if (d == dtype) return scalar;
  }
  PIPEMAT_INTERNAL_ASSERT(false, "a safetensors dtype without a scalar type");
  return at::kFloat;
}

}  // namespace pipemat::pp
