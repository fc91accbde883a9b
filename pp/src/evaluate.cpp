// Pipeline::evaluate: forward only, in eval mode and without autograd, micro-batch by
// micro-batch through the stages.

#include <c10/core/GradMode.h>

#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/device.h"
#include "pipemat/remat/rng.h"

namespace pipemat::pp {

namespace {

// Restores the train/eval mode of the stage modules when an evaluation ends (also on errors).
class EvalModeScope {
 public:
  explicit EvalModeScope(std::map<int, PipelineStage>& stages) {
    for (auto& [s, stage] : stages) {
      saved_.emplace_back(stage.module.get(), stage.module->is_training());
      stage.module->eval();
    }
  }
  ~EvalModeScope() {
    for (auto& [m, training] : saved_) m->train(training);
  }
  EvalModeScope(const EvalModeScope&) = delete;
  EvalModeScope& operator=(const EvalModeScope&) = delete;

 private:
  std::vector<std::pair<torch::nn::Module*, bool>> saved_;
};

}  // namespace

EvalResult Pipeline::Impl::evaluate(const DataSource& data, const EvalOptions& eo) {
  PIPEMAT_CHECK(static_cast<bool>(data), PipelineError, "evaluate: the data source is empty");
  const DeviceScope device_scope(options.device);  // a CUDA rank's device is current
  std::optional<remat::ThreadGeneratorScope> rng;
  if (generator.defined()) rng.emplace(generator);
  PIPEMAT_CHECK(eo.micro_batches >= 1, ConfigError,
                "evaluate: micro_batches must be at least 1, got ", eo.micro_batches);
  const int64_t E = eo.micro_batches;
  // Note [Data x pipeline]: replica d evaluates global micro-batches [lo, hi) of the E.
  const int replicas = options.data_group ? options.data_group->world_size() : 1;
  const int replica = options.data_group ? options.data_group->rank() : 0;
  const auto [lo, hi] = eval_share(replica, replicas, E);
  at::Tensor share = at::zeros({E}, at::kDouble);  // the last stage: l_i at i in [lo, hi)
  EvalModeScope eval_mode(stages);
  c10::AutoGradMode no_grad(false);
  EvalResult result;
  std::map<int, Tensors> handoff;  // next stage -> its inputs (this micro-batch)
  std::vector<comm::TensorListWork> sends;
  for (int64_t i = lo; i < hi; ++i) {
    MicroBatch b;
    if (is_first_stage_rank() || is_last_stage_rank()) {
      reseed(eo.step, i, kDataStream);
      b = data(eo.step, i);
      b.inputs = on_device(std::move(b.inputs));
      b.targets = on_device(std::move(b.targets));
    }
    for (const auto& [s, stage] : stages) {
      reseed(eo.step, i, stage_stream(stage));
      Tensors in;
      if (s == 0) {
        in = b.inputs;
      } else if (plan.is_local_handoff(s - 1, s)) {
        in = std::move(handoff.at(s));
        handoff.erase(s);
      } else {
        const int from = plan.rank_of(s - 1);
        in = comm::recv_tensors(transport, from, eval_tag(s - 1, i, E)).wait();
        check_received(s, from, eo.step, i, in);
        in = on_device(std::move(in));
      }
      Tensors out;
      {
        PrecisionRegion precision(options.precision, options.device);
        out = stage.forward(in);
      }
      if (s == last_stage) {
        share[i] = scaled_loss(out, b.targets, E, eo.step, i).item<double>();
        if (eo.keep_outputs) result.outputs.push_back(out);
        continue;
      }
      const std::string bad = check_sent(s, eo.step, i, out);
      if (plan.is_local_handoff(s, s + 1)) {
        PIPEMAT_CHECK(bad.empty(), PipelineError, bad);
        handoff[s + 1] = std::move(out);
      } else {
        sends.push_back(
            comm::send_tensors(transport, plan.rank_of(s + 1), eval_tag(s, i, E), on_host(out)));
        if (!bad.empty()) {
          sends.back().wait();
          PIPEMAT_THROW(PipelineError, bad);
        }
      }
    }
  }
  for (auto& w : sends) w.wait();
  // Summed in micro-batch order, each l_i from the replica that evaluated it.
  if (replicas > 1 && is_last_stage_rank()) share = gather_shares(share, E);
  double loss = 0;
  const auto l = share.accessor<double, 1>();
  for (int64_t i = 0; i < E; ++i) loss += l[i];
  result.loss = share_loss(loss);
  return result;
}

}  // namespace pipemat::pp
