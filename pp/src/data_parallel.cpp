// Note [Data x pipeline] (pipemat/pp/pipeline.h): replicas of one pipeline start with equal
// parameters and leave every step with the mean gradient and the mean loss of the global batch.

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"

namespace pipemat::pp {

void Pipeline::Impl::check_same(const Tensors& got, const Tensors& mine, int from, const char* what,
                                int64_t step) const {
  bool same = got.size() == mine.size();
  for (size_t i = 0; same && i < got.size(); ++i) {
    same = got[i].defined() && got[i].scalar_type() == mine[i].scalar_type() &&
           got[i].sizes() == mine[i].sizes();
  }
  PIPEMAT_CHECK(same, PipelineError, "data parallelism: replica ", from, " sent other ", what,
                " than replica ", options.data_group->rank(), " holds on pipeline rank ", rank,
                step >= 0 ? ::pipemat::detail::concat(" in step ", step) : std::string(), " (",
                got.size(), " tensors for ", mine.size(),
                "); every replica must build the same stages");
}

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
    check_same(got, posted.mine, d, what, step);
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
      // A bucket has one dtype (Note [Sharded optimizer]: a slice is one flat tensor).
      while (end < ps.size() &&
             (end == first || (bytes < options.gradient_bucket_bytes &&
                               ps[end].scalar_type() == ps[first].scalar_type()))) {
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
    // Note [Tied weights]: a stage holding a tied copy posts at the step's end.
    if (buckets[mine[k].stage].size() > 1 && !tied_stages.count(mine[k].stage))
      weight_tails[mine[k].stage].push_back(k);
  }
}

Pipeline::Impl::Bucket Pipeline::Impl::post_bucket(int stage, size_t index) {
  if (sharded()) return post_slices(stage, index);
  const auto [first, end] = buckets.at(stage)[index];
  const std::vector<at::Tensor>& ps = stage_params.at(stage);
  // [which gradients this replica produced (int64 0/1), each gradient or zeros]
  std::vector<int64_t> produced;
  Tensors list{at::Tensor()};
  for (size_t i = first; i < end; ++i) {
    const at::Tensor& p = ps[i];
    produced.push_back(p.grad().defined() ? 1 : 0);
    list.push_back(p.grad().defined() ? p.grad().detach() : at::zeros_like(p));
  }
  list[0] = at::tensor(produced, at::kLong);
  return {index, first, end, post_data(kGradientsTag, std::move(list))};
}

Pipeline::Impl::GradientExchange Pipeline::Impl::post_gradients(int stage) {
  GradientExchange x;
  x.stage = stage;
  for (size_t b = 0; b < buckets.at(stage).size(); ++b) x.buckets.push_back(post_bucket(stage, b));
  return x;
}

void Pipeline::Impl::finish_gradients(GradientExchange& x, int64_t step) {
  const int replicas = options.data_group->world_size();
  const std::vector<at::Tensor>& ps = stage_params.at(x.stage);
  for (Bucket& bucket : x.buckets) {
    if (sharded()) {
      finish_slices(x.stage, bucket, step);
      continue;
    }
    // The sent gradients may be written once collect returns.
    const std::vector<Tensors> all = collect_data(bucket.posted, "gradients", step);
    for (size_t k = 0; k < bucket.end - bucket.first; ++k) {
      bool any = false;  // no replica produced it: it stays undefined, as in one pipeline
      for (const Tensors& r : all) any = any || r[0].accessor<int64_t, 1>()[k] != 0;
      if (!any) continue;
      at::Tensor p = ps[bucket.first + k];
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

}  // namespace pipemat::pp
