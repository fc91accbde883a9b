// Pipeline setup: the plan, the checks of the options and of the stages the factory builds, the
// rank's generator and random streams, and the public member functions (which forward to Impl).

#include "pipemat/pp/pipeline.h"

#include <ATen/CPUGeneratorImpl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/device_lane.h"
#include "pipemat/comm/work.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/device.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/policy.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::pp {

using schedule::ActionType;

schedule::Schedule executed_schedule(const PipelineOptions& options) {
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

namespace {

// ConfigError for the first pattern of `policy` that matches none of `paths` (those of every
// stage the policy applies to), naming `what` and the nearest path.
void check_matched(const remat::RematPolicy& policy, const std::vector<std::string>& paths,
                   const std::string& what, const std::string& stages) {
  const auto unmatched = remat::unmatched_patterns(policy, paths);
  if (unmatched.empty()) return;
  const remat::UnmatchedPattern& u = unmatched.front();
  PIPEMAT_THROW(
      ConfigError, what, ": ", u.list, "[", u.index, "] '", u.pattern, "' matches no module on ",
      stages, " (paths are relative to each stage's module)",
      u.nearest.empty() ? std::string() : "; the nearest module path is '" + u.nearest + "'",
      ". Fix the pattern or remove it; a misspelt pattern would silently change what "
      "is recomputed");
}

}  // namespace

std::vector<std::string> lines_of_all_ranks(comm::Transport& transport, int tag,
                                            const std::vector<std::string>& paths) {
  if (transport.world_size() == 1) return paths;
  // A leading newline: never an empty message; split() gives empty fields, skipped below.
  auto mine = std::make_shared<std::string>("\n" + join(paths, "\n"));
  std::vector<comm::WorkPtr> sends;
  for (int peer = 0; peer < transport.world_size(); ++peer) {
    if (peer != transport.rank())
      sends.push_back(transport.send(peer, tag, {{mine->data(), mine->size()}}, mine));
  }
  std::vector<std::string> all;
  for (int peer = 0; peer < transport.world_size(); ++peer) {
    if (peer == transport.rank()) {
      all.insert(all.end(), paths.begin(), paths.end());
      continue;
    }
    comm::WorkPtr work = transport.recv_any(peer, tag);
    work->wait();
    const comm::Buffer buffer = work->buffer();
    const std::string text(reinterpret_cast<const char*>(buffer.data()), buffer.size());
    for (std::string& path : split(text, '\n')) {
      if (!path.empty()) all.push_back(std::move(path));
    }
  }
  for (const auto& work : sends) work->wait();
  return all;
}

int stage_count(const PipelineOptions& options) {
  if (options.actions) return options.actions->stages_count;
  const int v = options.schedule.kind == schedule::ScheduleKind::kZeroBubbleV
                    ? 2
                    : (options.schedule.kind == schedule::ScheduleKind::kInterleaved
                           ? options.schedule.virtual_stages
                           : 1);
  return options.schedule.ranks * v;
}

Pipeline::Impl::Impl(comm::Transport& t, PipelineOptions o, const StageFactory& build)
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
  plan = executed_schedule(options);
  rank = transport.rank();
  PIPEMAT_CHECK(plan.ranks_count == transport.world_size(), ConfigError, "schedule.ranks is ",
                plan.ranks_count, " but the job has ", transport.world_size(),
                " ranks; start as many ranks as schedule.ranks (e.g. pipemat-run -n ",
                plan.ranks_count, " ...) or set schedule.ranks=", transport.world_size());
  last_stage = plan.stages_count - 1;
  for (size_t k = 0; k < plan.actions[rank].size(); ++k) {
    const schedule::Action& a = plan.actions[rank][k];
    if (a.type == schedule::ActionType::kBackward ||
        a.type == schedule::ActionType::kBackwardWeight)
      final_backward[a.stage] = k;
  }
  for (const auto& [s, policy] : options.stage_remat) {
    PIPEMAT_CHECK(s >= 0 && s < plan.stages_count, ConfigError,
                  "PipelineOptions::stage_remat names stage ", s, " but the schedule has ",
                  plan.stages_count, " stages (0 to ", plan.stages_count - 1, ")");
  }
  // With the tracking allocator installed, the transport's receive buffers (the stage inputs
  // and output gradients a rank holds) count in StepMetrics::peak_bytes like tensors.
  if (remat::tracking_allocator_installed()) {
    comm::set_buffer_memory({&remat::allocate_tracked, &remat::release_tracked});
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
    const std::vector<std::string> paths = remat::module_paths(*stage.module);
    if (own != options.stage_remat.end()) {
      check_matched(policy, paths, "PipelineOptions::stage_remat[" + std::to_string(s) + "]",
                    "stage " + std::to_string(s));
    } else {
      remat_paths.insert(remat_paths.end(), paths.begin(), paths.end());
    }
    if (!policy.checkpoint.empty() || !policy.exclude.empty()) {
      policy.allow_unmatched = true;  // checked above and below, over the stages it applies to
      remat::apply_policy(*stage.module, policy);
    }
    if (!options.device.is_cpu()) stage.module->to(options.device);
    for (const auto& [name, key] : stage.tied) {  // Note [Tied weights]
      PIPEMAT_CHECK(stage.module->named_parameters().contains(name), ConfigError, "stage ", s,
                    " declares '", name, "' tied (key '", key,
                    "') but its module has no parameter of that name");
      tied_stages.insert(s);
    }
    for (const auto& p : stage.module->parameters()) {
      stage_params[s].push_back(p);
      params.push_back(p);
    }
    stages.emplace(s, std::move(stage));
  }
  optimized = params;
  parameter_bytes = remat::storage_bytes(params);
  if (options.data_group != nullptr) {
    plan_buckets();
    equalize_parameters();
  }
  if (sharded()) make_shards();  // Note [Sharded optimizer]: `optimized` becomes the pieces
  optimizer = options.optimizer(optimized);
  PIPEMAT_CHECK(optimizer != nullptr, ConfigError,
                "PipelineOptions::optimizer returned no optimizer on rank ", rank);
  if (sharded()) check_shardable();
}

// PipelineOptions::remat applies to every stage without a stage_remat entry, on all ranks: a
// pattern is an error when it matches on none of them. The ranks exchange their paths at the
// first step, the first collective call (the constructor sends nothing).
void Pipeline::Impl::check_remat_paths() {
  if (remat_checked) return;
  remat_checked = true;
  // No message when stage_remat covers every stage (every rank knows it: its keys are global).
  const int shared_stages = plan.stages_count - static_cast<int>(options.stage_remat.size());
  if (shared_stages == 0 || (options.remat.checkpoint.empty() && options.remat.exclude.empty())) {
    return;
  }
  check_matched(options.remat, lines_of_all_ranks(transport, remat_paths_tag(), remat_paths),
                "PipelineOptions::remat",
                "any of the pipeline's " + std::to_string(shared_stages) + " stages");
  std::vector<std::string>().swap(remat_paths);
}

// Note [Random streams of a step] (pipemat/pp/pipeline.h): before each draw site of a step.
void Pipeline::Impl::reseed(int64_t step, int64_t micro_batch, int stream) {
  if (generator.defined()) {
    const uint64_t seed = forward_seed(*options.seed, step, micro_batch, stream);
    generator.set_current_seed(seed);
    seed_device(options.device, seed);  // ops on a CUDA device draw from its generator
  }
}

Tensors Pipeline::Impl::on_host(Tensors ts) const {
  if (options.device.is_cpu()) return ts;
  // Note [Copies between host and device]; a device lane moves the tensors of its device as
  // they are (Note [Device lanes]).
  for (auto& t : ts) {
    if (!comm::lane_carries(transport, t)) t = copy_to_host(t);
  }
  return ts;
}

Tensors Pipeline::Impl::on_device(Tensors ts) const {
  if (options.device.is_cpu()) return ts;
  for (auto& t : ts) t = copy_to_device(t, options.device);  // a leaf, as received
  return ts;
}

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
bool Pipeline::shards_optimizer() const { return impl_->sharded(); }
comm::Transport* Pipeline::data_group() const { return impl_->options.data_group; }
void Pipeline::load_optimizer_state(torch::serialize::InputArchive& archive) {
  impl_->load_optimizer_state(archive);
}
void Pipeline::load_optimizer_state(const torch::optim::Optimizer& full) {
  impl_->load_optimizer_state(full);
}
at::Generator Pipeline::generator() const { return impl_->generator; }

}  // namespace pipemat::pp
