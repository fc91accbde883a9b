// Loss scaling (the micro-batch loss divided by the micro-batches) and clipping by the global
// gradient norm over all ranks (pipemat/pp/pipeline.h: Loss scaling, Gradient clipping).

#include <ATen/ATen.h>

#include <map>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"

namespace pipemat::pp {

at::Tensor Pipeline::Impl::scaled_loss(const Tensors& out, const Tensors& targets,
                                       int64_t micro_batches, int64_t step, int64_t micro_batch) {
  at::Tensor loss = options.loss(loss_inputs(out, options.precision), targets);
  PIPEMAT_CHECK(loss.defined() && loss.numel() == 1 && at::isFloatingType(loss.scalar_type()),
                PipelineError, "the loss of micro-batch ", micro_batch, " of step ", step,
                " on the last stage (rank ", rank, ") must be a floating scalar, got ",
                loss.defined() ? comm::TensorMeta::of(loss).to_string() : "undefined");
  if (loss.dim() != 0) loss = loss.reshape({});
  return loss / static_cast<double>(micro_batches);
}

// torch::nn::utils::clip_grad_norm_ over all ranks' parameters in stage order: the same
// per-parameter norms, stacked in the same order and reduced by the same ops on every rank. With
// Note [Sharded optimizer] every replica holds the same norms too, each from the replica holding
// its parameter's first element; the coefficient then scales this replica's pieces' gradients.
double Pipeline::Impl::clip_global_norm(double max_norm, int64_t step) {
  // This rank's norms, per stage: [stage ids (int64), norms of stage a, norms of stage b, ...]
  Tensors mine;
  std::vector<int64_t> ids;
  std::map<int, at::Tensor> by_stage;
  // Note [Sharded optimizer]: each parameter's norm from the replica holding its first element.
  std::map<int, at::Tensor> owned;
  if (sharded()) owned = sharded_norms(step);
  for (const auto& [s, ps] : stage_params) {
    at::Tensor t;
    if (sharded()) {
      t = owned.at(s);
    } else {
      std::vector<at::Tensor> norms;
      for (size_t i = 0; i < ps.size(); ++i) {
        if (ps[i].grad().defined() && !is_tie_follower(s, i))  // Note [Tied weights]
          norms.push_back(ps[i].grad().data().norm(2.0));
      }
      t = norms.empty() ? at::empty({0}, at::TensorOptions().device(options.device))
                        : at::stack(norms);
    }
    ids.push_back(s);
    mine.push_back(t);
    by_stage[s] = t;
  }
  Tensors payload{at::tensor(ids, at::kLong)};
  payload.insert(payload.end(), mine.begin(), mine.end());
  std::vector<comm::TensorListWork> sends, recvs;
  for (int r = 0; r < plan.ranks_count; ++r) {
    if (r == rank) continue;
    sends.push_back(comm::send_tensors(transport, r, norms_tag(), payload));
    recvs.push_back(comm::recv_tensors(transport, r, norms_tag()));
  }
  for (auto& w : recvs) {
    Tensors got = w.wait();
    PIPEMAT_CHECK(!got.empty() && got[0].defined() && got[0].scalar_type() == at::kLong &&
                      got[0].numel() + 1 == static_cast<int64_t>(got.size()),
                  CommError, "gradient clipping on rank ", rank,
                  ": a peer sent a malformed list of gradient norms");
    auto stage_ids = got[0].accessor<int64_t, 1>();
    for (int64_t k = 0; k < got[0].numel(); ++k)
      by_stage[static_cast<int>(stage_ids[k])] = got[k + 1].to(options.device);
  }
  for (auto& w : sends) w.wait();
  std::vector<at::Tensor> norms;
  for (const auto& [s, t] : by_stage) {
    for (const auto& n : t.unbind(0)) norms.push_back(n);
  }
  if (norms.empty()) return 0.0;
  at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2.0);
  at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (const auto& p : optimized) {  // the parameters, or Note [Sharded optimizer]'s pieces
    if (p.grad().defined()) p.grad().data().mul_(coef);
  }
  return total.item<double>();
}

}  // namespace pipemat::pp
