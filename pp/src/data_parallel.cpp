// Note [Data x pipeline] (pipemat/pp/pipeline.h): replicas of one pipeline start with equal
// parameters and leave every step with the mean gradient and the mean loss of the global batch.

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"

namespace pipemat::pp {
namespace {

// Tags of the data group: only this rank's replicas of its stages talk on it.
constexpr int kParametersTag = 0;
constexpr int kGradientsTag = 1;
constexpr int kLossTag = 2;
constexpr int kEvalTag = 3;
constexpr int kGatherTag = 4;  // Note [Sharded optimizer]
constexpr int kNormsTag = 5;
constexpr int kStateTag = 6;

// What replica `from` sent has the count, dtypes and shapes of this replica's `mine`: the replicas
// run the same stages.
void check_same(const Tensors& got, const Tensors& mine, int from, int me, int rank,
                const char* what, int64_t step) {
  bool same = got.size() == mine.size();
  for (size_t i = 0; same && i < got.size(); ++i) {
    same = got[i].defined() && got[i].scalar_type() == mine[i].scalar_type() &&
           got[i].sizes() == mine[i].sizes();
  }
  PIPEMAT_CHECK(same, PipelineError, "data parallelism: replica ", from, " sent other ", what,
                " than replica ", me, " holds on pipeline rank ", rank,
                step >= 0 ? ::pipemat::detail::concat(" in step ", step) : std::string(), " (",
                got.size(), " tensors for ", mine.size(),
                "); every replica must build the same stages");
}

}  // namespace

Pipeline::Impl::Posted Pipeline::Impl::post_data(int tag, Tensors mine) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  Posted out;
  out.recvs.resize(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    if (d == me) continue;
    out.sends.push_back(comm::send_tensors(group, d, tag, mine));
    out.recvs[static_cast<size_t>(d)] = comm::recv_tensors(group, d, tag);
  }
  out.mine = std::move(mine);
  return out;
}

std::vector<Tensors> Pipeline::Impl::collect_data(Posted& posted, const char* what, int64_t step) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  std::vector<Tensors> all(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    if (d == me) continue;
    Tensors got = posted.recvs[static_cast<size_t>(d)].wait();
    check_same(got, posted.mine, d, me, rank, what, step);
    all[static_cast<size_t>(d)] = std::move(got);
  }
  for (auto& w : posted.sends) w.wait();
  all[static_cast<size_t>(me)] = std::move(posted.mine);
  return all;
}

std::vector<Tensors> Pipeline::Impl::exchange_data(int tag, Tensors mine, const char* what,
                                                   int64_t step) {
  Posted posted = post_data(tag, std::move(mine));
  return collect_data(posted, what, step);
}

void Pipeline::Impl::equalize_parameters() {
  comm::Transport& group = *options.data_group;
  if (group.world_size() == 1) return;
  Tensors mine;
  for (const auto& p : params) mine.push_back(p.detach());
  const std::vector<Tensors> all = exchange_data(kParametersTag, mine, "parameters", /*step=*/-1);
  if (group.rank() == 0) return;
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(all[0][i]);
}

void Pipeline::Impl::plan_buckets() {
  for (const auto& [stage, ps] : stage_params) {
    auto& out = buckets[stage];
    size_t first = 0;
    while (first < ps.size()) {
      size_t end = first;
      int64_t bytes = 0;
      while (end < ps.size() && (end == first || bytes < options.gradient_bucket_bytes)) {
        bytes += ps[end].numel() * static_cast<int64_t>(ps[end].element_size());
        ++end;
      }
      out.emplace_back(first, end);
      first = end;
    }
  }
  // Note [Weight tail]: the run of W actions that ends this rank's list, per stage.
  if (!options.weight_tail) return;
  const std::vector<schedule::Action>& mine = plan.actions[rank];
  size_t start = mine.size();
  while (start > 0 && mine[start - 1].type == schedule::ActionType::kBackwardWeight) --start;
  for (size_t k = start; k < mine.size(); ++k) {
    if (buckets[mine[k].stage].size() > 1) weight_tails[mine[k].stage].push_back(k);
  }
}

Pipeline::Impl::Bucket Pipeline::Impl::post_bucket(int stage, size_t first, size_t end) {
  const std::vector<at::Tensor>& ps = stage_params.at(stage);
  // [which gradients this replica produced (int64 0/1), each gradient or zeros], of the
  // parameters replica `to` owns (all of them unsharded)
  auto list_for = [&](int to) {
    std::vector<int64_t> produced;
    Tensors list{at::Tensor()};
    for (size_t i = first; i < end; ++i) {
      if (to >= 0 && owner_of(stage, i) != to) continue;
      const at::Tensor& p = ps[i];
      produced.push_back(p.grad().defined() ? 1 : 0);
      list.push_back(p.grad().defined() ? p.grad().detach() : at::zeros_like(p));
    }
    list[0] = at::tensor(produced, at::kLong);
    return list;
  };
  if (!sharded()) return {first, end, post_data(kGradientsTag, list_for(-1))};
  // Note [Sharded optimizer]: replica d gets only what it owns, nothing where it owns none.
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  Posted out;
  out.recvs.resize(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    Tensors list = list_for(d);
    if (list.size() == 1) continue;  // d owns none of the bucket
    if (d == me) {
      out.mine = std::move(list);
      for (int from = 0; from < replicas; ++from) {
        if (from != me)
          out.recvs[static_cast<size_t>(from)] = comm::recv_tensors(group, from, kGradientsTag);
      }
    } else {
      out.sends.push_back(comm::send_tensors(group, d, kGradientsTag, std::move(list)));
    }
  }
  return {first, end, std::move(out)};
}

Pipeline::Impl::GradientExchange Pipeline::Impl::post_gradients(int stage) {
  GradientExchange x;
  x.stage = stage;
  for (const auto& [first, end] : buckets.at(stage))
    x.buckets.push_back(post_bucket(stage, first, end));
  return x;
}

void Pipeline::Impl::finish_gradients(GradientExchange& x, int64_t step) {
  const int replicas = options.data_group->world_size();
  const std::vector<at::Tensor>& ps = stage_params.at(x.stage);
  const bool shards = sharded();
  const int me = options.data_group->rank();
  for (Bucket& bucket : x.buckets) {
    // The parameters whose sums this replica makes: all of them, or those it owns.
    std::vector<size_t> summed;
    for (size_t i = bucket.first; i < bucket.end; ++i) {
      if (!shards || owner_of(x.stage, i) == me) {
        summed.push_back(i);
      } else {
        ps[i].mutable_grad().reset();  // Note [Sharded optimizer]: its owner holds it
      }
    }
    if (summed.empty()) {
      for (auto& w : bucket.posted.sends) w.wait();
      continue;
    }
    // The sent gradients may be written once collect returns.
    const std::vector<Tensors> all = collect_data(bucket.posted, "gradients", step);
    std::vector<bool> any(summed.size(), false);
    for (const Tensors& r : all) {
      const auto produced = r[0].accessor<int64_t, 1>();
      for (size_t k = 0; k < any.size(); ++k)
        any[k] = any[k] || produced[static_cast<int64_t>(k)] != 0;
    }
    for (size_t k = 0; k < summed.size(); ++k) {
      const size_t i = summed[k];
      if (!any[k]) continue;  // no replica produced it: it stays undefined, as in one pipeline
      at::Tensor p = ps[i];
      at::Tensor sum = all[0][k + 1].to(p.device()).clone();  // received ones are on the host
      for (int d = 1; d < replicas; ++d)
        sum.add_(all[static_cast<size_t>(d)][k + 1].to(p.device()));
      sum.div_(replicas);
      if (p.grad().defined()) {
        p.mutable_grad().detach().copy_(sum);
      } else {
        p.mutable_grad() = sum;
      }
    }
  }
}

at::Tensor Pipeline::Impl::gather_shares(const at::Tensor& share, int64_t micro_batches) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size();
  const std::vector<Tensors> all =
      exchange_data(kEvalTag, {share}, "evaluation losses", /*step=*/-1);
  at::Tensor out = at::zeros({micro_batches}, at::kDouble);
  for (int d = 0; d < replicas; ++d) {
    const auto [lo, hi] = eval_share(d, replicas, micro_batches);
    if (hi > lo) out.slice(0, lo, hi).copy_(all[static_cast<size_t>(d)][0].slice(0, lo, hi));
  }
  return out;
}

double Pipeline::Impl::average_loss(double loss, int64_t step) {
  comm::Transport& group = *options.data_group;
  if (group.world_size() == 1) return loss;
  const std::vector<Tensors> all =
      exchange_data(kLossTag, {at::tensor({loss}, at::kDouble)}, "a loss", step);
  double total = 0;
  for (const Tensors& r : all) total += r[0].item<double>();
  return total / group.world_size();
}

// Note [Sharded optimizer]: each owner's updated parameters, bucket by bucket, to every other
// replica, which copies them into its own.
void Pipeline::Impl::gather_parameters(int64_t step) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  struct Pending {
    std::vector<at::Tensor> into;  // the parameters it fills, in order
    comm::TensorListWork recv;
    int from = 0;
  };
  std::vector<Pending> pending;
  std::vector<comm::TensorListWork> sends;
  for (const auto& [stage, ranges] : buckets) {
    const std::vector<at::Tensor>& ps = stage_params.at(stage);
    for (const auto& [first, end] : ranges) {
      std::vector<Tensors> by_owner(static_cast<size_t>(replicas));
      for (size_t i = first; i < end; ++i)
        by_owner[static_cast<size_t>(owner_of(stage, i))].push_back(ps[i].detach());
      for (int d = 0; d < replicas; ++d) {
        const Tensors& owned = by_owner[static_cast<size_t>(d)];
        if (owned.empty()) continue;
        if (d == me) {
          for (int to = 0; to < replicas; ++to) {
            if (to != me) sends.push_back(comm::send_tensors(group, to, kGatherTag, owned));
          }
        } else {
          pending.push_back({owned, comm::recv_tensors(group, d, kGatherTag), d});
        }
      }
    }
  }
  c10::NoGradGuard no_grad;
  for (Pending& p : pending) {
    const Tensors got = p.recv.wait();
    check_same(got, p.into, p.from, me, rank, "updated parameters", step);
    for (size_t k = 0; k < got.size(); ++k) p.into[k].copy_(got[k]);
  }
  for (auto& w : sends) w.wait();
}

std::map<int, at::Tensor> Pipeline::Impl::sharded_norms(int64_t step) {
  const int me = options.data_group->rank();
  // [has a gradient here (int64 0/1) per parameter of the rank, its norm or 0], stage order
  std::vector<int64_t> has;
  std::vector<at::Tensor> norms;
  const at::TensorOptions on_device = at::TensorOptions().device(options.device);
  for (const auto& [s, ps] : stage_params) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const bool mine = owner_of(s, i) == me && ps[i].grad().defined();
      has.push_back(mine ? 1 : 0);
      norms.push_back(mine ? ps[i].grad().data().norm(2.0)
                           : at::zeros({}, on_device.dtype(ps[i].scalar_type())));
    }
  }
  std::map<int, at::Tensor> by_stage;
  if (norms.empty()) {
    for (const auto& [s, ps] : stage_params) by_stage[s] = at::empty({0}, on_device);
    return by_stage;
  }
  const std::vector<Tensors> all = exchange_data(
      kNormsTag, {at::tensor(has, at::kLong), at::stack(norms)}, "gradient norms", step);
  int64_t j = 0;
  for (const auto& [s, ps] : stage_params) {
    std::vector<at::Tensor> picked;
    for (size_t i = 0; i < ps.size(); ++i, ++j) {
      const Tensors& from = all[static_cast<size_t>(owner_of(s, i))];
      if (from[0].accessor<int64_t, 1>()[j] != 0) picked.push_back(from[1][j].to(options.device));
    }
    by_stage[s] = picked.empty() ? at::empty({0}, on_device) : at::stack(picked);
  }
  return by_stage;
}

void Pipeline::Impl::move_owned_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to,
                                      int owner) {
  for (const auto& [s, ps] : stage_params) {
    for (size_t i = 0; i < ps.size(); ++i) {
      if (owner_of(s, i) != owner) continue;
      void* key = ps[i].unsafeGetTensorImpl();
      auto it = from.state().find(key);
      if (it != from.state().end()) to.state()[key] = std::move(it->second);
    }
  }
}

namespace {

// `to`'s param groups take `from`'s options (the LR the schedule set, ...), where both have as
// many groups.
void copy_group_options(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  if (from.param_groups().size() != to.param_groups().size()) return;
  for (size_t g = 0; g < from.param_groups().size(); ++g)
    to.param_groups()[g].set_options(from.param_groups()[g].options().clone());
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> Pipeline::Impl::gather_optimizer_state() {
  if (!sharded()) return nullptr;
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  std::unique_ptr<torch::optim::Optimizer> full = options.optimizer(params);
  PIPEMAT_CHECK(full != nullptr, ConfigError,
                "PipelineOptions::optimizer returned no optimizer on rank ", rank);
  copy_group_options(*optimizer, *full);
  if (me != 0) {
    // This replica's state as an optimizer over all of the rank's parameters, serialized.
    std::unique_ptr<torch::optim::Optimizer> mine = options.optimizer(params);
    for (const auto& [key, state] : optimizer->state()) mine->state()[key] = state->clone();
    torch::serialize::OutputArchive archive;
    mine->save(archive);
    std::ostringstream out;
    archive.save_to(out);
    const std::string bytes = out.str();
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    comm::send_tensors(group, 0, kStateTag, {t}).wait();
    return nullptr;
  }
  for (const auto& [key, state] : optimizer->state()) full->state()[key] = state->clone();
  for (int d = 1; d < replicas; ++d) {
    const Tensors got = comm::recv_tensors(group, d, kStateTag).wait();
    PIPEMAT_CHECK(got.size() == 1 && got[0].defined() && got[0].scalar_type() == at::kByte,
                  CommError, "save_checkpoint: replica ", d, " sent no optimizer state to replica ",
                  me, " on pipeline rank ", rank);
    const at::Tensor bytes = got[0].contiguous();
    torch::serialize::InputArchive archive;
    archive.load_from(static_cast<const char*>(bytes.data_ptr()),
                      static_cast<size_t>(bytes.numel()));
    std::unique_ptr<torch::optim::Optimizer> theirs = options.optimizer(params);
    theirs->load(archive);
    move_owned_state(*theirs, *full, d);
  }
  return full;
}

void Pipeline::Impl::load_optimizer_state(torch::serialize::InputArchive& archive) {
  if (!sharded()) {
    optimizer->load(archive);
    return;
  }
  std::unique_ptr<torch::optim::Optimizer> full = options.optimizer(params);
  PIPEMAT_CHECK(full != nullptr, ConfigError,
                "PipelineOptions::optimizer returned no optimizer on rank ", rank);
  full->load(archive);
  optimizer->state().clear();
  move_owned_state(*full, *optimizer, options.data_group->rank());
  copy_group_options(*full, *optimizer);
}

std::vector<int> shard_owners(const std::vector<int64_t>& numels, int replicas) {
  PIPEMAT_CHECK(replicas >= 1, ConfigError, "shard_owners: replicas must be >= 1, got ", replicas);
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  std::vector<int> out;
  int64_t before = 0;
  for (int64_t n : numels) {
    // The replica whose share [d*T/D, (d+1)*T/D) of the T elements holds the middle element:
    // floor((before + n/2) * D / T), in halves to stay exact.
    const int64_t d = total == 0 ? 0 : ((2 * before + n) * replicas) / (2 * total);
    out.push_back(static_cast<int>(std::min<int64_t>(d, replicas - 1)));
    before += n;
  }
  return out;
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  auto add = [&bytes](const at::Tensor& t) {
    if (t.defined()) bytes += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& [key, state] : optimizer.state()) {
    const torch::optim::OptimizerParamState* s = state.get();
    if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      add(a->exp_avg()), add(a->exp_avg_sq()), add(a->max_exp_avg_sq());
    } else if (const auto* b = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      add(b->exp_avg()), add(b->exp_avg_sq()), add(b->max_exp_avg_sq());
    } else if (const auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      add(g->momentum_buffer());
    } else if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      add(r->square_avg()), add(r->momentum_buffer()), add(r->grad_avg());
    } else if (const auto* h = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      add(h->sum());
    }
  }
  return bytes;
}

}  // namespace pipemat::pp
