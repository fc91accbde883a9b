// Note [Data x pipeline] (pipemat/pp/pipeline.h): replicas of one pipeline start with equal
// parameters and leave every step with the mean gradient and the mean loss of the global batch.

#include <ATen/ATen.h>

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

// Every replica's list, in replica order (this rank's own at its index), each checked to have
// this rank's count, dtypes and shapes: the replicas run the same stages.
std::vector<Tensors> exchange(comm::Transport& group, int tag, const Tensors& mine, int rank,
                              const char* what, int64_t step) {
  const int replicas = group.world_size(), me = group.rank();
  std::vector<comm::TensorListWork> sends, recvs(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    if (d == me) continue;
    sends.push_back(comm::send_tensors(group, d, tag, mine));
    recvs[static_cast<size_t>(d)] = comm::recv_tensors(group, d, tag);
  }
  std::vector<Tensors> all(static_cast<size_t>(replicas));
  all[static_cast<size_t>(me)] = mine;
  for (int d = 0; d < replicas; ++d) {
    if (d == me) continue;
    Tensors got = recvs[static_cast<size_t>(d)].wait();
    bool same = got.size() == mine.size();
    for (size_t i = 0; same && i < got.size(); ++i) {
      same = got[i].defined() && got[i].scalar_type() == mine[i].scalar_type() &&
             got[i].sizes() == mine[i].sizes();
    }
    PIPEMAT_CHECK(same, PipelineError, "data parallelism: replica ", d, " sent other ", what,
                  " than replica ", me, " holds on pipeline rank ", rank,
                  step >= 0 ? ::pipemat::detail::concat(" in step ", step) : std::string(), " (",
                  got.size(), " tensors for ", mine.size(),
                  "); every replica must build the same stages");
    all[static_cast<size_t>(d)] = std::move(got);
  }
  for (auto& w : sends) w.wait();
  return all;
}

}  // namespace

void Pipeline::Impl::equalize_parameters() {
  comm::Transport& group = *options.data_group;
  if (group.world_size() == 1) return;
  Tensors mine;
  for (const auto& p : params) mine.push_back(p.detach());
  const std::vector<Tensors> all =
      exchange(group, kParametersTag, mine, rank, "parameters", /*step=*/-1);
  if (group.rank() == 0) return;
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(all[0][i]);
}

Pipeline::Impl::GradientExchange Pipeline::Impl::post_gradients(int stage) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  GradientExchange x;
  x.stage = stage;
  const std::vector<at::Tensor>& ps = stage_params.at(stage);
  // Buckets of whole parameters, in parameter order, each closed once it holds bucket_bytes.
  size_t first = 0;
  while (first < ps.size()) {
    size_t end = first;
    int64_t bytes = 0;
    while (end < ps.size() && (end == first || bytes < options.gradient_bucket_bytes)) {
      bytes += ps[end].numel() * static_cast<int64_t>(ps[end].element_size());
      ++end;
    }
    // [which gradients this replica produced (int64 0/1), each gradient or zeros]
    std::vector<int64_t> produced;
    Tensors mine{at::Tensor()};
    for (size_t i = first; i < end; ++i) {
      const at::Tensor& p = ps[i];
      produced.push_back(p.grad().defined() ? 1 : 0);
      mine.push_back(p.grad().defined() ? p.grad().detach() : at::zeros_like(p));
    }
    mine[0] = at::tensor(produced, at::kLong);
    Bucket bucket;
    bucket.first = first;
    bucket.end = end;
    bucket.recvs.resize(static_cast<size_t>(replicas));
    for (int d = 0; d < replicas; ++d) {
      if (d == me) continue;
      bucket.sends.push_back(comm::send_tensors(group, d, kGradientsTag, mine));
      bucket.recvs[static_cast<size_t>(d)] = comm::recv_tensors(group, d, kGradientsTag);
    }
    bucket.mine = std::move(mine);
    x.buckets.push_back(std::move(bucket));
    first = end;
  }
  return x;
}

void Pipeline::Impl::finish_gradients(GradientExchange& x, int64_t step) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  const std::vector<at::Tensor>& ps = stage_params.at(x.stage);
  for (Bucket& bucket : x.buckets) {
    std::vector<Tensors> all(static_cast<size_t>(replicas));
    for (int d = 0; d < replicas; ++d) {
      if (d == me) continue;
      Tensors got = bucket.recvs[static_cast<size_t>(d)].wait();
      check_same(got, bucket.mine, d, me, rank, "gradients", step);
      all[static_cast<size_t>(d)] = std::move(got);
    }
    for (auto& w : bucket.sends) w.wait();  // the sent gradients may be written now
    all[static_cast<size_t>(me)] = std::move(bucket.mine);
    for (size_t i = bucket.first; i < bucket.end; ++i) {
      const auto k = static_cast<int64_t>(i - bucket.first);
      bool any = false;
      for (const Tensors& r : all) any = any || r[0][k].item<int64_t>() != 0;
      if (!any) continue;  // no replica produced it: it stays undefined, as in one pipeline
      at::Tensor sum = all[0][static_cast<size_t>(k) + 1].clone();
      for (int d = 1; d < replicas; ++d)
        sum.add_(all[static_cast<size_t>(d)][static_cast<size_t>(k) + 1]);
      sum.div_(replicas);
      at::Tensor p = ps[i];
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
      exchange(group, kEvalTag, {share}, rank, "evaluation losses", /*step=*/-1);
  at::Tensor out = at::zeros({micro_batches}, at::kDouble);
  for (int d = 0; d < replicas; ++d) {
    const int64_t lo = d * micro_batches / replicas, hi = (d + 1) * micro_batches / replicas;
    if (hi > lo) out.slice(0, lo, hi).copy_(all[static_cast<size_t>(d)][0].slice(0, lo, hi));
  }
  return out;
}

double Pipeline::Impl::average_loss(double loss, int64_t step) {
  comm::Transport& group = *options.data_group;
  if (group.world_size() == 1) return loss;
  const std::vector<Tensors> all =
      exchange(group, kLossTag, {at::tensor({loss}, at::kDouble)}, rank, "a loss", step);
  double total = 0;
  for (const Tensors& r : all) total += r[0].item<double>();
  return total / group.world_size();
}

}  // namespace pipemat::pp
