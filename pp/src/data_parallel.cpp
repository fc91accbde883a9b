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

void Pipeline::Impl::average_gradients(int64_t step) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size();
  if (replicas == 1) return;
  // [which gradients this replica produced (bool), each gradient or zeros]
  std::vector<uint8_t> produced;
  Tensors mine{at::Tensor()};
  for (const auto& p : params) {
    produced.push_back(p.grad().defined() ? 1 : 0);
    mine.push_back(p.grad().defined() ? p.grad().detach() : at::zeros_like(p));
  }
  mine[0] = at::tensor(std::vector<int64_t>(produced.begin(), produced.end()), at::kLong);
  const std::vector<Tensors> all = exchange(group, kGradientsTag, mine, rank, "gradients", step);
  std::vector<bool> any(params.size(), false);
  for (const Tensors& r : all) {
    const auto flags = r[0].accessor<int64_t, 1>();
    for (size_t i = 0; i < params.size(); ++i) any[i] = any[i] || flags[static_cast<int64_t>(i)];
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!any[i]) continue;  // no replica produced it: it stays undefined, as in one pipeline
    at::Tensor sum = all[0][i + 1].clone();
    for (int d = 1; d < replicas; ++d) sum.add_(all[static_cast<size_t>(d)][i + 1]);
    sum.div_(replicas);
    at::Tensor p = params[i];
    if (p.grad().defined()) {
      p.mutable_grad().detach().copy_(sum);
    } else {
      p.mutable_grad() = sum;
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
