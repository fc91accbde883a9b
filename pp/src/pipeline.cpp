#include "pipemat/pp/pipeline.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include "pipemat/comm/tensor.h"
#include "pipemat/remat/invocation.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/rng.h"
#include "split_backward.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;
using Key = std::pair<int, int>;  // (stage, micro-batch)

namespace detail {
void throw_arity(int stage, size_t expected, size_t got) {
  PIPEMAT_THROW(PipelineError, "stage ", stage, ": the module's forward takes ", expected,
                " tensor", expected == 1 ? "" : "s", " but the stage got ", got,
                "; the previous stage (or MicroBatch::inputs on stage 0) must produce exactly "
                "the tensors this forward takes, in order");
}
}  // namespace detail

namespace {

double since_us(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// Note [Stage boundary signature]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What one stage boundary carries: the number of tensors and the dtype of each (-1: undefined).
// Shapes are free: they travel with every message (comm::send_tensors). Both ranks of a
// boundary learn it from its first micro-batch and check every later one, the sender before it
// sends (it still sends, then throws, so the receiver does not wait) and the receiver after it
// receives, so a stage that changes what it returns is an error on both sides.
using Signature = std::vector<int>;

Signature signature_of(const Tensors& ts) {
  Signature s;
  for (const auto& t : ts) s.push_back(t.defined() ? static_cast<int>(t.scalar_type()) : -1);
  return s;
}

std::string describe(const Tensors& ts) {
  std::string out = "[";
  for (size_t i = 0; i < ts.size(); ++i) {
    if (i) out += ", ";
    out += ts[i].defined() ? comm::TensorMeta::of(ts[i]).to_string() : "undefined";
  }
  return out + "] (" + std::to_string(ts.size()) + (ts.size() == 1 ? " tensor)" : " tensors)");
}

std::string describe(const Signature& sig) {
  std::string out = "[";
  for (size_t i = 0; i < sig.size(); ++i) {
    if (i) out += ", ";
    out += sig[i] < 0 ? "undefined" : comm::dtype_name(static_cast<at::ScalarType>(sig[i]));
  }
  return out + "] (" + std::to_string(sig.size()) + (sig.size() == 1 ? " tensor)" : " tensors)");
}

void clear_grads(const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

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

namespace {

// One tensor goes in as at::Tensor, several as std::vector<at::Tensor>.
torch::nn::AnyValue call_any(torch::nn::AnyModule& module, const Tensors& in) {
  return in.size() == 1 ? module.any_forward(in[0]) : module.any_forward(in);
}

Tensors tensors_of(torch::nn::AnyValue value, int stage) {
  if (auto* t = value.try_get<at::Tensor>()) return {*t};
  if (auto* v = value.try_get<Tensors>()) return *v;
  if (auto* t2 = value.try_get<std::tuple<at::Tensor, at::Tensor>>()) {
    return {std::get<0>(*t2), std::get<1>(*t2)};
  }
  if (auto* t3 = value.try_get<std::tuple<at::Tensor, at::Tensor, at::Tensor>>()) {
    return {std::get<0>(*t3), std::get<1>(*t3), std::get<2>(*t3)};
  }
  PIPEMAT_THROW(PipelineError, "stage ", stage, " returned ", value.type_info().name(),
                "; a stage module must return at::Tensor, std::vector<at::Tensor> or a tuple of "
                "2 or 3 tensors");
}

}  // namespace

PipelineStage make_stage(int index, torch::nn::AnyModule module) {
  PIPEMAT_CHECK(!module.is_empty(), ConfigError, "make_stage: the AnyModule of stage ", index,
                " is empty");
  auto shared = std::make_shared<torch::nn::AnyModule>(std::move(module));
  StageForward forward = [shared, index](const Tensors& in) {
    PIPEMAT_CHECK(!in.empty(), PipelineError, "stage ", index, " got no input tensors");
    return tensors_of(call_any(*shared, in), index);
  };
  return make_stage(index, shared->ptr(), std::move(forward));
}

PipelineStage make_stage(int index, std::shared_ptr<torch::nn::Module> module,
                         StageForward forward) {
  PipelineStage s;
  s.index = index;
  s.module = std::move(module);
  s.forward = std::move(forward);
  return s;
}

std::vector<int64_t> balance_by_size(const std::vector<double>& sizes, int stages) {
  const auto n = static_cast<int64_t>(sizes.size());
  PIPEMAT_CHECK(stages >= 1, ConfigError, "balance: stages must be at least 1, got ", stages);
  PIPEMAT_CHECK(n >= stages, ConfigError, "the model has ", n, " layers but the schedule has ",
                stages,
                " stages; every stage needs at least one layer (raise model.layers or lower "
                "schedule.stages / schedule.virtual_stages)");
  double total = 0;
  for (double s : sizes) total += s;
  std::vector<int64_t> bounds{0};
  double running = 0;
  int64_t i = 0;
  for (int s = 0; s < stages - 1; ++s) {
    const double target = total * (s + 1) / stages;
    do {
      running += sizes[i++];
    } while (i < n - (stages - 1 - s) && running + 0.5 * sizes[i] <= target);
    bounds.push_back(i);
  }
  bounds.push_back(n);
  return bounds;
}

std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int stages) {
  std::vector<double> sizes;
  for (const auto& entry : model->children()) {
    double p = 0;
    for (const auto& t : entry->parameters()) p += static_cast<double>(t.numel());
    sizes.push_back(p);
  }
  return balance_by_size(sizes, stages);
}

StageFactory split_sequential(torch::nn::Sequential model, std::vector<int64_t> bounds) {
  const auto n = static_cast<int64_t>(model->size());
  PIPEMAT_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == n, ConfigError,
                "split_sequential: bounds must run from 0 to the Sequential's size ", n, ", got ",
                bounds.size(), " values from ", bounds.empty() ? -1 : bounds.front(), " to ",
                bounds.empty() ? -1 : bounds.back());
  for (size_t i = 1; i < bounds.size(); ++i) {
    PIPEMAT_CHECK(bounds[i] > bounds[i - 1], ConfigError, "split_sequential: stage ", i - 1,
                  " would be empty (bounds ", bounds[i - 1], " and ", bounds[i],
                  "); every stage needs at least one entry");
  }
  return [model, bounds](int stage) {
    PIPEMAT_CHECK(stage >= 0 && stage + 1 < static_cast<int>(bounds.size()), ConfigError,
                  "split_sequential: stage ", stage, " is out of range; the bounds give ",
                  bounds.size() - 1, " stages");
    torch::nn::Sequential part;
    const auto names = model->named_children();
    for (int64_t i = bounds[stage]; i < bounds[stage + 1]; ++i) {
      part->push_back(names[i].key(), *(model->begin() + i));  // shares the module
    }
    auto forward = [impl = part.ptr(), stage](const Tensors& in) -> Tensors {
      PIPEMAT_CHECK(!in.empty(), PipelineError, "stage ", stage, " got no input tensors");
      torch::nn::AnyValue value = call_any(*impl->begin(), in);
      for (auto it = impl->begin() + 1; it != impl->end(); ++it) {
        value = it->any_forward(std::move(value));
      }
      return tensors_of(std::move(value), stage);
    };
    return make_stage(stage, part.ptr(), forward);
  };
}

namespace {

schedule::Schedule plan_of(const PipelineOptions& options) {
  if (!options.actions) return schedule::build_schedule(options.schedule);
  schedule::Schedule plan = *options.actions;
  if (!plan.has_comms()) {
    bool has_r = false;
    for (const auto& rank : plan.actions) {
      for (const auto& a : rank) has_r |= a.type == ActionType::kRecompute;
    }
    if (!has_r) plan = schedule::insert_recompute(plan, options.schedule.recompute);
    plan = schedule::lower_communication(plan);
  }
  schedule::validate_schedule(plan);
  return plan;
}

}  // namespace

int stage_count(const PipelineOptions& options) {
  if (options.actions) return options.actions->stages_count;
  const int v = options.schedule.kind == schedule::ScheduleKind::kZeroBubbleV
                    ? 2
                    : (options.schedule.kind == schedule::ScheduleKind::kInterleaved
                           ? options.schedule.virtual_stages
                           : 1);
  return options.schedule.stages * v;
}

struct Pipeline::Impl {
  struct MicroBatchState {
    Tensors inputs;                            // leaves (stage > 0: some require grad)
    Tensors outputs;                           // until sent
    std::vector<torch::autograd::Edge> roots;  // of outputs requiring grad, or of the loss
    std::vector<size_t> root_outputs;          // which output each root is
    at::Tensor loss;                           // last stage: the scaled loss
    std::shared_ptr<remat::InvocationGroup> group;
    std::unique_ptr<SplitBackward> split;
  };

  comm::Transport& transport;
  PipelineOptions options;
  schedule::Schedule plan;
  int rank = 0;
  int last_stage = 0;
  std::map<int, PipelineStage> stages;
  std::map<int, std::vector<at::Tensor>> stage_params;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t next_step = 0;
  std::map<int, Signature> boundary;  // boundary s -> s + 1, Note [Stage boundary signature]
  at::Generator generator;            // PipelineOptions::seed

  Impl(comm::Transport& t, PipelineOptions o, const StageFactory& build)
      : transport(t), options(std::move(o)) {
    PIPEMAT_CHECK(static_cast<bool>(options.loss), ConfigError,
                  "PipelineOptions::loss is not set; the last stage needs a loss "
                  "(outputs, targets) -> scalar");
    PIPEMAT_CHECK(static_cast<bool>(options.optimizer), ConfigError,
                  "PipelineOptions::optimizer is not set; pass a factory such as [](auto& p) { "
                  "return std::make_unique<torch::optim::SGD>(p, 0.1); }");
    PIPEMAT_CHECK(options.clip_grad_norm >= 0, ConfigError,
                  "PipelineOptions::clip_grad_norm must be >= 0 (0: off), got ",
                  options.clip_grad_norm);
    PIPEMAT_CHECK(static_cast<bool>(build), ConfigError, "Pipeline: the stage factory is empty");
    plan = plan_of(options);
    rank = transport.rank();
    PIPEMAT_CHECK(plan.ranks_count == transport.world_size(), ConfigError, "schedule.stages is ",
                  plan.ranks_count, " but the job has ", transport.world_size(),
                  " ranks; start as many ranks as schedule.stages (e.g. pipemat-run -n ",
                  plan.ranks_count, " ...) or set schedule.stages=", transport.world_size());
    last_stage = plan.stages_count - 1;
    for (const auto& [s, policy] : options.stage_remat) {
      PIPEMAT_CHECK(s >= 0 && s < plan.stages_count, ConfigError,
                    "PipelineOptions::stage_remat names stage ", s, " but the schedule has ",
                    plan.stages_count, " stages (0 to ", plan.stages_count - 1, ")");
    }
    if (options.seed) {
      generator =
          at::make_generator<at::CPUGeneratorImpl>(*options.seed + static_cast<uint64_t>(rank));
    }
    for (int s : plan.stages_of(rank)) {
      PipelineStage stage = build(s);
      PIPEMAT_CHECK(stage.index == s, ConfigError, "the stage factory was asked for stage ", s,
                    " on rank ", rank, " but returned stage ", stage.index);
      PIPEMAT_CHECK(stage.module != nullptr, ConfigError, "stage ", s,
                    " has no module; give the module that owns its parameters (an empty "
                    "torch::nn::Module if it has none)");
      PIPEMAT_CHECK(static_cast<bool>(stage.forward), ConfigError, "stage ", s, " has no forward");
      const auto own = options.stage_remat.find(s);
      remat::RematPolicy policy = own != options.stage_remat.end() ? own->second : options.remat;
      if (!policy.checkpoint.empty() || !policy.exclude.empty()) {
        policy.allow_unmatched = true;  // a stage holds only some of the model's modules
        remat::apply_policy(*stage.module, policy);
      }
      for (const auto& p : stage.module->parameters()) {
        stage_params[s].push_back(p);
        params.push_back(p);
      }
      stages.emplace(s, std::move(stage));
    }
    optimizer = options.optimizer(params);
    PIPEMAT_CHECK(optimizer != nullptr, ConfigError,
                  "PipelineOptions::optimizer returned no optimizer on rank ", rank);
  }

  int tag_of(const Action& a) const { return schedule::message_id(plan, a); }
  // Tags above the schedule's messages: metrics, timelines, clipping norms, losses, evaluation.
  int reserved_tag(int k) const { return 2 * plan.stages_count * plan.micro_batches + k; }
  int metrics_tag() const { return reserved_tag(0); }
  int timeline_tag() const { return reserved_tag(1); }
  int norms_tag() const { return reserved_tag(2); }
  int loss_tag() const { return reserved_tag(3); }
  int eval_tag(int from_stage, int64_t micro_batch, int64_t micro_batches) const {
    const int64_t tag = reserved_tag(4) + from_stage * micro_batches + micro_batch;
    PIPEMAT_CHECK(tag <= comm::kMaxUserTag, ConfigError, "evaluate: ", micro_batches,
                  " micro-batches over ", plan.stages_count,
                  " stages need more message tags "
                  "than the transport has; evaluate fewer micro-batches per call");
    return static_cast<int>(tag);
  }
  int last_rank() const { return plan.rank_of(last_stage); }

  // Note [Stage boundary signature]: learns boundary `b` from its first message; afterwards
  // returns the learned signature when `ts` differs from it (nullptr when it matches).
  const Signature* boundary_mismatch(int b, const Tensors& ts) {
    Signature sig = signature_of(ts);
    auto [it, fresh] = boundary.emplace(b, sig);
    return fresh || it->second == sig ? nullptr : &it->second;
  }

  // The sender's side. Returns the error text ("" if fine).
  std::string check_sent(int stage, int64_t step, int64_t micro_batch, const Tensors& out) {
    const Signature* learned = boundary_mismatch(stage, out);
    if (learned == nullptr) return "";
    return ::pipemat::detail::concat(
        "stage ", stage, " on rank ", rank, " returned ", describe(out), " for micro-batch ",
        micro_batch, " of step ", step, ", but earlier micro-batches on its boundary to stage ",
        stage + 1, " carried ", describe(*learned),
        "; every micro-batch must pass the same number of tensors with the same dtypes (shapes "
        "may change)");
  }

  // The receiver's side: `from_rank` sent `in` over boundary stage - 1 -> stage.
  void check_received(int stage, int from_rank, int64_t step, int64_t micro_batch,
                      const Tensors& in) {
    const Signature* learned = boundary_mismatch(stage - 1, in);
    if (learned == nullptr) return;
    PIPEMAT_THROW(PipelineError, "stage ", stage, " on rank ", rank, " received ", describe(in),
                  " from stage ", stage - 1, " on rank ", from_rank, " for micro-batch ",
                  micro_batch, " of step ", step,
                  ", but earlier micro-batches on this boundary "
                  "carried ",
                  describe(*learned),
                  "; every micro-batch must pass the same number of tensors with the same dtypes "
                  "(shapes may change)");
  }

  at::Tensor scaled_loss(const Tensors& out, const Tensors& targets, int64_t micro_batches,
                         int64_t step, int64_t micro_batch) {
    at::Tensor loss = options.loss(out, targets);
    PIPEMAT_CHECK(loss.defined() && loss.numel() == 1 && at::isFloatingType(loss.scalar_type()),
                  PipelineError, "the loss of micro-batch ", micro_batch, " of step ", step,
                  " on the last stage (rank ", rank, ") must be a floating scalar, got ",
                  loss.defined() ? comm::TensorMeta::of(loss).to_string() : "undefined");
    if (loss.dim() != 0) loss = loss.reshape({});
    return loss / static_cast<double>(micro_batches);
  }

  // Detached copies with the same requires_grad: what goes on the wire, and what a receive of
  // it gives (the next stage's leaves when it sits on this rank).
  static Tensors as_received(const Tensors& out) {
    Tensors in;
    for (const auto& t : out) {
      if (!t.defined()) {
        in.emplace_back();
        continue;
      }
      in.push_back(t.detach().requires_grad_(t.requires_grad()));
    }
    return in;
  }

  // Note [Random streams of a step]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // With PipelineOptions::seed the rank's generator is reseeded before every draw site of a
  // step: the forward of stage s on micro-batch i of step t with forward_seed(seed, t, i, s), the
  // data source's call for (t, i) with kDataStream, the loss with kLossStream; evaluation the
  // same with its step. So what a forward draws depends on (seed, step, micro-batch, stage)
  // only, not on the order the schedule runs the actions, on which rank holds the stage or on
  // the transport, and a single-process loop that reseeds the same way draws the same dropout
  // masks. A checkpoint unit records the generator state at its entry (after the reseed) and
  // its replay rewinds to it, wherever the schedule puts the replay.
  void reseed(int64_t step, int64_t micro_batch, int stream) {
    if (generator.defined()) {
      generator.set_current_seed(forward_seed(*options.seed, step, micro_batch, stream));
    }
  }

  // ---- training step ----------------------------------------------------------------------

  StepMetrics train_step(const DataSource& data) {
    PIPEMAT_CHECK(static_cast<bool>(data), PipelineError, "train_step: the data source is empty");
    std::optional<remat::ThreadGeneratorScope> rng;
    if (generator.defined()) rng.emplace(generator);
    const int64_t step = next_step;
    const int64_t M = plan.micro_batches;
    StepMetrics m;
    m.step = step;
    std::map<Key, MicroBatchState> mbs;
    std::map<Key, comm::TensorListWork> recv_f, recv_b;
    std::map<Key, Tensors> handoff_f, handoff_b, pending_dx;
    std::map<int, MicroBatch> batches;  // drawn once per micro-batch
    std::map<int, double> losses;
    std::vector<comm::TensorListWork> sends;
    clear_grads(params);
    remat::reset_counters();
    if (options.collect_timelines) transport.barrier(transport.timeout());
    remat::reset_peak_bytes();
    const int64_t bytes0 = remat::memory_stats().current_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    double busy_us = 0;

    auto batch = [&](int micro_batch) -> MicroBatch& {
      auto it = batches.find(micro_batch);
      if (it == batches.end()) {
        reseed(step, micro_batch, kDataStream);
        it = batches.emplace(micro_batch, data(step, micro_batch)).first;
      }
      return it->second;
    };
    double a0 = 0;         // start of the current action's compute (after its receive, if any)
    double waited_us = 0;  // how long the current action waited for its input
    double recv_wait_us = 0;
    auto incoming_grads = [&](const Action& a) -> Tensors {
      auto h = handoff_b.find({a.stage, a.micro_batch});
      if (h != handoff_b.end()) {
        Tensors g = std::move(h->second);
        handoff_b.erase(h);
        return g;
      }
      auto r = recv_b.find({a.stage, a.micro_batch});
      PIPEMAT_INTERNAL_ASSERT(r != recv_b.end(), "no gradient source for ",
                              schedule::format_action(a), " on rank ", rank);
      const double w0 = since_us(t0);
      Tensors g = r->second.wait();
      recv_b.erase(r);
      a0 = since_us(t0);
      waited_us = a0 - w0;
      return g;
    };
    // The roots of (s,i) with the gradients that arrived for them (undefined ones skipped).
    auto root_grads = [&](const Action& a, MicroBatchState& mb, const Tensors& grads,
                          std::vector<torch::autograd::Edge>& roots, Tensors& out) {
      if (a.stage == last_stage) {
        if (!mb.roots.empty()) {
          roots = mb.roots;
          out = {at::ones_like(mb.loss)};
        }
        return;
      }
      for (size_t k = 0; k < mb.roots.size(); ++k) {
        const size_t j = mb.root_outputs[k];
        PIPEMAT_CHECK(j < grads.size(), CommError, "stage ", a.stage, " on rank ", rank, " got ",
                      grads.size(), " gradients from stage ", a.stage + 1, " for micro-batch ",
                      a.micro_batch, " but output ", j,
                      " needs one; both ranks must run the same pipemat build");
        if (!grads[j].defined()) continue;
        roots.push_back(mb.roots[k]);
        out.push_back(grads[j]);
      }
    };
    auto deliver_dx = [&](const Action& a, Tensors dx) {
      if (a.stage == 0) return;
      if (plan.is_local_handoff(a.stage - 1, a.stage)) {
        handoff_b[{a.stage - 1, a.micro_batch}] = std::move(dx);
      } else {
        pending_dx[{a.stage, a.micro_batch}] = std::move(dx);
      }
    };
    auto input_grads = [](const MicroBatchState& mb) {
      Tensors dx;
      for (const auto& in : mb.inputs) {
        dx.push_back(in.defined() && in.requires_grad() ? in.grad() : at::Tensor());
      }
      return dx;
    };
    auto state = [&](const Action& a) -> MicroBatchState& {
      auto it = mbs.find({a.stage, a.micro_batch});
      PIPEMAT_INTERNAL_ASSERT(it != mbs.end(), schedule::format_action(a), " on rank ", rank,
                              " before its forward");
      return it->second;
    };

    for (const Action& a : plan.actions[rank]) {
      a0 = since_us(t0);
      waited_us = 0;
      const Key key{a.stage, a.micro_batch};
      switch (a.type) {
        case ActionType::kRecvForward:
          recv_f[key] = comm::recv_tensors(transport, schedule::peer_rank(plan, a), tag_of(a));
          break;
        case ActionType::kRecvBackward:
          recv_b[key] = comm::recv_tensors(transport, schedule::peer_rank(plan, a), tag_of(a));
          break;
        case ActionType::kForward: {
          MicroBatchState mb;
          if (a.stage == 0) {
            for (const auto& t : batch(a.micro_batch).inputs) {
              mb.inputs.push_back(t.defined() ? t.detach() : t);
            }
          } else if (auto h = handoff_f.find(key); h != handoff_f.end()) {
            mb.inputs = std::move(h->second);
            handoff_f.erase(h);
          } else {
            auto r = recv_f.find(key);
            PIPEMAT_INTERNAL_ASSERT(r != recv_f.end(), "no input for ", schedule::format_action(a),
                                    " on rank ", rank);
            const double w0 = since_us(t0);
            mb.inputs = r->second.wait();
            recv_f.erase(r);
            a0 = since_us(t0);
            waited_us = a0 - w0;
            check_received(a.stage, plan.rank_of(a.stage - 1), step, a.micro_batch, mb.inputs);
          }
          Tensors out;
          {
            remat::InvocationScope scope({step, a.stage, a.micro_batch});
            reseed(step, a.micro_batch, a.stage);
            out = stages.at(a.stage).forward(mb.inputs);
            mb.group = scope.group();
          }
          if (a.stage == last_stage) {
            MicroBatch& b = batch(a.micro_batch);
            reseed(step, a.micro_batch, kLossStream);
            at::Tensor loss = scaled_loss(out, b.targets, M, step, a.micro_batch);
            if (loss.requires_grad()) {
              mb.roots.push_back(gradient_edge(loss));
              mb.root_outputs.push_back(0);
            }
            losses[a.micro_batch] = loss.item<double>();
            mb.loss = loss;
            b.targets.clear();
          } else {
            for (size_t j = 0; j < out.size(); ++j) {
              if (out[j].defined() && out[j].requires_grad()) {
                mb.roots.push_back(gradient_edge(out[j]));
                mb.root_outputs.push_back(j);
              }
            }
            const std::string bad = check_sent(a.stage, step, a.micro_batch, out);
            if (plan.is_local_handoff(a.stage, a.stage + 1)) {
              PIPEMAT_CHECK(bad.empty(), PipelineError, bad);
              handoff_f[{a.stage + 1, a.micro_batch}] = as_received(out);
            } else if (!bad.empty()) {
              // Send what the stage returned so that the receiver reports it too, then fail.
              comm::send_tensors(
                  transport, plan.rank_of(a.stage + 1),
                  schedule::message_id(plan, {a.stage, ActionType::kSendForward, a.micro_batch}),
                  as_received(out))
                  .wait();
              PIPEMAT_THROW(PipelineError, bad);
            } else {
              mb.outputs = std::move(out);
            }
          }
          if (a.stage == 0 && a.stage != last_stage) batch(a.micro_batch).inputs.clear();
          mbs.emplace(key, std::move(mb));
          break;
        }
        case ActionType::kSendForward: {
          MicroBatchState& mb = state(a);
          // The graph keeps only the outputs' edges.
          sends.push_back(comm::send_tensors(transport, schedule::peer_rank(plan, a), tag_of(a),
                                             as_received(mb.outputs)));
          mb.outputs.clear();  // freed once the send is done
          break;
        }
        case ActionType::kRecompute:
          state(a).group->pretrigger();
          break;
        case ActionType::kBackward: {
          MicroBatchState& mb = state(a);
          const Tensors grads = a.stage == last_stage ? Tensors{} : incoming_grads(a);
          std::vector<torch::autograd::Edge> roots;
          Tensors gs;
          root_grads(a, mb, grads, roots, gs);
          if (!roots.empty()) {
            remat::PhaseScope phase(remat::Phase::kBackward);
            run_backward(roots, gs);
          }
          deliver_dx(a, input_grads(mb));
          mb.group->release();
          mbs.erase(key);
          break;
        }
        case ActionType::kBackwardInput: {
          MicroBatchState& mb = state(a);
          const Tensors grads = a.stage == last_stage ? Tensors{} : incoming_grads(a);
          mb.group->retain();  // I and W unpack the same replay
          std::vector<torch::autograd::Edge> roots;
          Tensors gs;
          root_grads(a, mb, grads, roots, gs);
          mb.split = std::make_unique<SplitBackward>(roots, mb.inputs, stage_params[a.stage]);
          Tensors dx;
          {
            remat::PhaseScope phase(remat::Phase::kBackwardInput);
            dx = mb.split->run_input(gs);
          }
          deliver_dx(a, std::move(dx));
          break;
        }
        case ActionType::kBackwardWeight: {
          MicroBatchState& mb = state(a);
          {
            remat::PhaseScope phase(remat::Phase::kBackwardWeight);
            mb.split->run_weight();
          }
          mb.group->release();
          mbs.erase(key);
          break;
        }
        case ActionType::kSendBackward: {
          auto it = pending_dx.find(key);
          PIPEMAT_INTERNAL_ASSERT(it != pending_dx.end(), schedule::format_action(a),
                                  " before its I/B");
          sends.push_back(
              comm::send_tensors(transport, schedule::peer_rank(plan, a), tag_of(a), it->second));
          pending_dx.erase(it);
          break;
        }
      }
      if (schedule::is_compute(a.type)) {
        const double a1 = since_us(t0);
        busy_us += a1 - a0;
        recv_wait_us += waited_us;
        m.timeline.push_back({a, a0, a1, waited_us});
      } else if (a.type == ActionType::kSendForward || a.type == ActionType::kSendBackward) {
        m.timeline.push_back({a, a0, a0, 0});  // when the send was issued
      }
    }
    for (auto& w : sends) w.wait();
    if (options.clip_grad_norm > 0) m.grad_norm = clip_global_norm(options.clip_grad_norm);
    if (options.lr_schedule) options.lr_schedule(*optimizer, step);
    optimizer->step();
    m.step_ms = since_us(t0) / 1000.0;
    m.busy_ms = busy_us / 1000.0;
    m.peak_bytes = remat::memory_stats().peak_bytes - bytes0;
    m.max_rank_peak_bytes = m.peak_bytes;
    m.recv_wait_ms = recv_wait_us / 1000.0;
    m.remat = remat::counters();
    for (const auto& [mb, l] : losses) m.loss += l;
    if (options.collect_timelines) exchange_metrics(m);
    m.loss = share_loss(m.loss);
    ++next_step;
    return m;
  }

  StepMetrics train_step(const MicroBatch& batch) {
    return train_step(split_batch(batch, plan.micro_batches, "train_step"));
  }

  // A data source over `batch` split along dim 0 into `parts` micro-batches (the tensors this
  // rank uses: inputs on the first stage's rank, targets on the last's). It holds the chunks.
  DataSource split_batch(const MicroBatch& batch, int64_t parts, const char* call) const {
    PIPEMAT_CHECK(parts >= 1, ConfigError, call, ": micro_batches must be at least 1, got ", parts);
    auto split = [&](const Tensors& ts, const char* what) {
      std::vector<Tensors> out(parts);
      for (size_t j = 0; j < ts.size(); ++j) {
        const at::Tensor& t = ts[j];
        PIPEMAT_CHECK(t.defined() && t.dim() > 0 && t.size(0) % parts == 0, PipelineError, call,
                      ": ", what, "[", j, "] is ",
                      t.defined() ? comm::TensorMeta::of(t).to_string() : "undefined",
                      ", whose dim 0 does not split into ", parts,
                      " micro-batches; give a batch whose dim 0 is a multiple of them");
        auto chunks = t.chunk(parts, 0);
        for (int64_t i = 0; i < parts; ++i) out[i].push_back(chunks[i]);
      }
      return out;
    };
    auto inputs = std::make_shared<std::vector<Tensors>>(
        is_first_stage_rank() ? split(batch.inputs, "inputs") : std::vector<Tensors>(parts));
    auto targets = std::make_shared<std::vector<Tensors>>(
        is_last_stage_rank() ? split(batch.targets, "targets") : std::vector<Tensors>(parts));
    return [inputs, targets](int64_t, int64_t i) {
      return MicroBatch{(*inputs)[i], (*targets)[i]};
    };
  }

  bool is_first_stage_rank() const { return plan.rank_of(0) == rank; }
  bool is_last_stage_rank() const { return last_rank() == rank; }

  // ---- gradient clipping ------------------------------------------------------------------

  // torch::nn::utils::clip_grad_norm_ over all ranks' parameters in stage order: the same
  // per-parameter norms, stacked in the same order and reduced by the same ops on every rank.
  double clip_global_norm(double max_norm) {
    // This rank's norms, per stage: [stage ids (int64), norms of stage a, norms of stage b, ...]
    Tensors mine;
    std::vector<int64_t> ids;
    std::map<int, at::Tensor> by_stage;
    for (const auto& [s, ps] : stage_params) {
      std::vector<at::Tensor> norms;
      for (const auto& p : ps) {
        if (p.grad().defined()) norms.push_back(p.grad().data().norm(2.0));
      }
      at::Tensor t = norms.empty() ? at::empty({0}) : at::stack(norms);
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
        by_stage[static_cast<int>(stage_ids[k])] = got[k + 1];
    }
    for (auto& w : sends) w.wait();
    std::vector<at::Tensor> norms;
    for (const auto& [s, t] : by_stage) {
      for (const auto& n : t.unbind(0)) norms.push_back(n);
    }
    if (norms.empty()) return 0.0;
    at::Tensor total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(2.0);
    at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
    for (const auto& p : params) {
      if (p.grad().defined()) p.grad().data().mul_(coef);
    }
    return total.item<double>();
  }

  // ---- metrics ----------------------------------------------------------------------------

  // The last stage's rank has the loss; every rank returns it.
  double share_loss(double loss) {
    if (plan.ranks_count == 1) return loss;
    if (rank == last_rank()) {
      std::vector<comm::TensorListWork> sends;
      for (int r = 0; r < plan.ranks_count; ++r) {
        if (r != rank) {
          sends.push_back(
              comm::send_tensors(transport, r, loss_tag(), {at::tensor({loss}, at::kDouble)}));
        }
      }
      for (auto& w : sends) w.wait();
      return loss;
    }
    Tensors got = comm::recv_tensors(transport, last_rank(), loss_tag()).wait();
    PIPEMAT_CHECK(got.size() == 1 && got[0].defined() && got[0].numel() == 1 &&
                      got[0].scalar_type() == at::kDouble,
                  CommError, "rank ", rank, ": the last stage's rank ", last_rank(),
                  " sent a malformed loss message");
    return got[0].item<double>();
  }

  // [n, 6] doubles: stage, type, micro-batch, start ms, end ms, wait ms.
  static constexpr int64_t kTimelineColumns = 6;
  static at::Tensor timeline_tensor(const std::vector<ActionTiming>& timeline) {
    auto t = at::zeros({static_cast<int64_t>(timeline.size()), kTimelineColumns}, at::kDouble);
    auto acc = t.accessor<double, 2>();
    for (size_t i = 0; i < timeline.size(); ++i) {
      acc[i][0] = timeline[i].action.stage;
      acc[i][1] = static_cast<double>(timeline[i].action.type);
      acc[i][2] = timeline[i].action.micro_batch;
      acc[i][3] = timeline[i].start_us / 1000.0;
      acc[i][4] = timeline[i].end_us / 1000.0;
      acc[i][5] = timeline[i].wait_us / 1000.0;
    }
    return t;
  }

  // The measured timeline as a SimulationResult, and the simulator's prediction with the
  // measured mean cost per action type.
  void build_measured(StepMetrics& m, const std::vector<at::Tensor>& timelines) const {
    std::map<ActionType, std::pair<double, int>> cost;
    struct Waited {
      int rank;
      Action action;
      double start, wait;
    };
    std::vector<Waited> waits;
    std::map<std::tuple<int, bool, int>, double> sent;  // (stage, backward?, mb) -> issued at
    m.measured = schedule::SimulationResult{};
    m.measured.ranks.resize(plan.ranks_count);
    double makespan = 0, busy = 0;
    for (int r = 0; r < plan.ranks_count; ++r) {
      auto& out = m.measured.ranks[r];
      out.rank = r;
      PIPEMAT_CHECK(timelines[r].dim() == 2 && timelines[r].size(1) == kTimelineColumns &&
                        timelines[r].scalar_type() == at::kDouble,
                    CommError, "rank ", r, " sent a malformed timeline");
      auto acc = timelines[r].accessor<double, 2>();
      for (int64_t i = 0; i < timelines[r].size(0); ++i) {
        schedule::TimedAction ta;
        ta.action.stage = static_cast<int>(acc[i][0]);
        ta.action.type = static_cast<ActionType>(static_cast<int>(acc[i][1]));
        ta.action.micro_batch = static_cast<int>(acc[i][2]);
        ta.position = static_cast<int>(out.actions.size());
        ta.start = acc[i][3];
        ta.end = acc[i][4];
        waits.push_back({r, ta.action, ta.start, acc[i][5]});
        if (!schedule::is_compute(ta.action.type)) {
          sent[{ta.action.stage, ta.action.type == ActionType::kSendBackward,
                ta.action.micro_batch}] = ta.start;
          continue;
        }
        out.busy += ta.end - ta.start;
        if (out.actions.empty()) out.first_start = ta.start;
        out.last_end = ta.end;
        auto& c = cost[ta.action.type];
        c.first += ta.end - ta.start;
        c.second += 1;
        out.actions.push_back(ta);
      }
      makespan = std::max(makespan, out.last_end);
      busy += out.busy;
    }
    m.measured.makespan = makespan;
    m.measured.bubble_ratio = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
    auto mean = [&](ActionType t, double fallback) {
      auto it = cost.find(t);
      return it == cost.end() || it->second.second == 0 ? fallback
                                                        : it->second.first / it->second.second;
    };
    schedule::CostModel model;
    model.forward = mean(ActionType::kForward, 1.0);
    model.backward_input = mean(ActionType::kBackwardInput, model.forward);
    model.backward_weight = mean(ActionType::kBackwardWeight, model.forward);
    if (cost.count(ActionType::kBackward)) model.backward = mean(ActionType::kBackward, 2.0);
    if (cost.count(ActionType::kRecompute)) model.recompute = mean(ActionType::kRecompute, 0.0);
    m.measured_costs = model;
    m.simulated_bubble = schedule::simulate(plan, model).bubble_ratio;
    // Note [Measured message delay]: the input of F(s, i) is sent by SEND_F(s-1, i), that of
    // B / I (s, i) by SEND_B(s+1, i); the simulator already delays a message until its send is
    // issued, so the delay is counted from there.
    // A wait shorter than kArrivedMs found its message there already (the cost of the wait call).
    constexpr double kArrivedMs = 0.05;
    std::vector<double> delays;
    for (const Waited& w : waits) {
      if (w.wait < kArrivedMs) continue;
      const bool backward = w.action.type != ActionType::kForward;
      const int from = backward ? w.action.stage + 1 : w.action.stage - 1;
      auto it = sent.find({from, backward, w.action.micro_batch});
      if (it == sent.end() || plan.rank_of(from) == w.rank) continue;
      delays.push_back(std::max(0.0, w.start - it->second));
    }
    if (!delays.empty()) {
      std::nth_element(delays.begin(), delays.begin() + delays.size() / 2, delays.end());
      m.message_delay_ms = delays[delays.size() / 2];
    }
    schedule::CostModel with_comm = model;
    with_comm.comm = m.message_delay_ms;
    m.simulated_bubble_comm = schedule::simulate(plan, with_comm).bubble_ratio;
  }

  // Every rank sends (busy_ms, step_ms, all nine remat counters, recv_wait_ms, peak_bytes) and
  // its timeline to the last stage's rank, which computes the bubble.
  static constexpr int64_t kMetricScalars = 13;
  void exchange_metrics(StepMetrics& m) {
    const int last = last_rank();
    if (rank != last) {
      const auto& c = m.remat;
      at::Tensor scalars = at::tensor(
          {m.busy_ms, m.step_ms, double(c.unit_calls), double(c.replays), double(c.early_stops),
           double(c.save_calls), double(c.save_skips), double(c.packs), double(c.save_kept),
           double(c.output_leaves), double(c.placeholders), m.recv_wait_ms, double(m.peak_bytes)},
          at::kDouble);
      comm::send_tensors(transport, last, metrics_tag(), {scalars, timeline_tensor(m.timeline)})
          .wait();
      return;
    }
    double busy = m.busy_ms, makespan = m.step_ms;
    std::vector<at::Tensor> timelines(plan.ranks_count);
    for (int r = 0; r < plan.ranks_count; ++r) {
      if (r == rank) continue;
      Tensors got = comm::recv_tensors(transport, r, metrics_tag()).wait();
      PIPEMAT_CHECK(got.size() == 2 && got[0].defined() && got[0].numel() == kMetricScalars &&
                        got[0].scalar_type() == at::kDouble && got[1].defined(),
                    CommError, "rank ", r, " sent malformed step metrics to rank ", rank);
      auto v = [&](int i) { return got[0][i].item<double>(); };
      busy += v(0);
      makespan = std::max(makespan, v(1));
      remat::RematCounters c;
      c.unit_calls = static_cast<int64_t>(v(2));
      c.replays = static_cast<int64_t>(v(3));
      c.early_stops = static_cast<int64_t>(v(4));
      c.save_calls = static_cast<int64_t>(v(5));
      c.save_skips = static_cast<int64_t>(v(6));
      c.packs = static_cast<int64_t>(v(7));
      c.save_kept = static_cast<int64_t>(v(8));
      c.output_leaves = static_cast<int64_t>(v(9));
      c.placeholders = static_cast<int64_t>(v(10));
      m.remat += c;
      m.recv_wait_ms += v(11);
      m.max_rank_peak_bytes = std::max(m.max_rank_peak_bytes, static_cast<int64_t>(v(12)));
      timelines[r] = got[1];
    }
    timelines[rank] = timeline_tensor(m.timeline);
    build_measured(m, timelines);
    m.step_ms = makespan;
    m.bubble = makespan > 0 ? 1.0 - busy / (plan.ranks_count * makespan) : 0.0;
  }

  // ---- evaluation -------------------------------------------------------------------------

  EvalResult evaluate(const DataSource& data, const EvalOptions& eo) {
    PIPEMAT_CHECK(static_cast<bool>(data), PipelineError, "evaluate: the data source is empty");
    std::optional<remat::ThreadGeneratorScope> rng;
    if (generator.defined()) rng.emplace(generator);
    PIPEMAT_CHECK(eo.micro_batches >= 1, ConfigError,
                  "evaluate: micro_batches must be at least 1, got ", eo.micro_batches);
    const int64_t E = eo.micro_batches;
    EvalModeScope eval_mode(stages);
    c10::AutoGradMode no_grad(false);
    EvalResult result;
    std::map<int, Tensors> handoff;  // next stage -> its inputs (this micro-batch)
    std::vector<comm::TensorListWork> sends;
    double loss = 0;
    for (int64_t i = 0; i < E; ++i) {
      MicroBatch b;
      if (is_first_stage_rank() || is_last_stage_rank()) {
        reseed(eo.step, i, kDataStream);
        b = data(eo.step, i);
      }
      for (const auto& [s, stage] : stages) {
        reseed(eo.step, i, s);
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
        }
        Tensors out = stage.forward(in);
        if (s == last_stage) {
          loss += scaled_loss(out, b.targets, E, eo.step, i).item<double>();
          if (eo.keep_outputs) result.outputs.push_back(out);
          continue;
        }
        const std::string bad = check_sent(s, eo.step, i, out);
        if (plan.is_local_handoff(s, s + 1)) {
          PIPEMAT_CHECK(bad.empty(), PipelineError, bad);
          handoff[s + 1] = std::move(out);
        } else {
          sends.push_back(
              comm::send_tensors(transport, plan.rank_of(s + 1), eval_tag(s, i, E), out));
          if (!bad.empty()) {
            sends.back().wait();
            PIPEMAT_THROW(PipelineError, bad);
          }
        }
      }
    }
    for (auto& w : sends) w.wait();
    result.loss = share_loss(loss);
    return result;
  }
};

uint64_t forward_seed(uint64_t seed, int64_t step, int64_t micro_batch, int stream) {
  // splitmix64 over the four values in turn: nearby keys give unrelated seeds.
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(seed);
  h = mix(h ^ static_cast<uint64_t>(step));
  h = mix(h ^ static_cast<uint64_t>(micro_batch));
  return mix(h ^ static_cast<uint64_t>(static_cast<int64_t>(stream)));
}

Pipeline::Pipeline(comm::Transport& transport, PipelineOptions options, const StageFactory& build)
    : impl_(std::make_unique<Impl>(transport, std::move(options), build)) {}
Pipeline::~Pipeline() = default;

StepMetrics Pipeline::train_step(const DataSource& data) { return impl_->train_step(data); }
StepMetrics Pipeline::train_step(const MicroBatch& batch) { return impl_->train_step(batch); }

EvalResult Pipeline::evaluate(const DataSource& data, const EvalOptions& options) {
  return impl_->evaluate(data, options);
}

EvalResult Pipeline::evaluate(const MicroBatch& batch, const EvalOptions& options) {
  return impl_->evaluate(impl_->split_batch(batch, options.micro_batches, "evaluate"), options);
}

int64_t Pipeline::step() const { return impl_->next_step; }
void Pipeline::set_step(int64_t step) {
  PIPEMAT_CHECK(step >= 0, ConfigError, "Pipeline::set_step: step must be >= 0, got ", step);
  impl_->next_step = step;
}
const schedule::Schedule& Pipeline::schedule() const { return impl_->plan; }
int Pipeline::rank() const { return impl_->rank; }
bool Pipeline::is_first_stage_rank() const { return impl_->is_first_stage_rank(); }
bool Pipeline::is_last_stage_rank() const { return impl_->is_last_stage_rank(); }
std::vector<int> Pipeline::stages() const { return impl_->plan.stages_of(impl_->rank); }
const PipelineStage& Pipeline::stage(int index) const {
  auto it = impl_->stages.find(index);
  PIPEMAT_CHECK(it != impl_->stages.end(), ConfigError, "Pipeline::stage: stage ", index,
                " is not on rank ", impl_->rank);
  return it->second;
}
const std::vector<at::Tensor>& Pipeline::parameters() const { return impl_->params; }
torch::optim::Optimizer& Pipeline::optimizer() { return *impl_->optimizer; }
at::Generator Pipeline::generator() const { return impl_->generator; }

}  // namespace pipemat::pp
