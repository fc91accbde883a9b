// The pipeline's training drivers: one rank on this process's transport (train_on), all ranks
// as threads here (train_in_process), and `pipemat train` (run_train), which picks between them
// and the reference (train_reference.cpp). What they print and write: train_report.h.

#include "pipemat/train/train.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <new>
#include <optional>

#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "pipemat/comm/device_lane.h"
#include "pipemat/comm/rank_threads.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/pp/compute.h"
#include "pipemat/pp/device.h"
#include "pipemat/remat/memory.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/torch_csv.h"
#include "pipemat/train/config.h"
#include "pipemat/train/generate.h"
#include "pipemat/train/loss_curve.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/plan.h"
#include "pipemat/train/weights.h"
#include "train_checkpoints.h"
#include "train_optimizer.h"
#include "train_report.h"

namespace pipemat::train {
namespace {

// Keeps `m` whole as the last step and its summary (no timelines; of `measured` only the
// bubble ratio) in the bounded history.
void keep_step(TrainResult& result, StepMetrics m) {
  result.last = m;
  m.timeline = {};
  m.spans = {};
  m.rank_timelines = {};
  m.rank_spans = {};
  m.replica_timelines = {};
  m.simulated = {};
  const double schedule_bubble = m.measured.bubble_ratio;
  m.measured = schedule::SimulationResult{};
  m.measured.bubble_ratio = schedule_bubble;
  if (result.steps.size() == kKeptSteps) result.steps.erase(result.steps.begin());
  result.steps.push_back(std::move(m));
}

// Builds the generated schedule of `config` to check its constraints before anything runs.
// The schedule module names its options by their `pipemat schedule` flags; a config names keys.
void check_schedule(const ResolvedSchedule& resolved) {
  if (resolved.actions) return;  // imported: validated on import
  try {
    schedule::build_schedule(resolved.config.schedule);
  } catch (const ConfigError& e) {
    std::string text = e.what();
    const std::pair<const char*, const char*> keys[] = {
        {"--micro-batches", "schedule.micro_batches"},
        {"--ranks", "schedule.ranks"},
        {"--virtual", "schedule.virtual_stages"},
        {"--kind", "schedule.kind"}};
    for (const auto& [flag, key] : keys) {
      for (size_t at = text.find(flag); at != std::string::npos; at = text.find(flag, at)) {
        text.replace(at, std::strlen(flag), key);
        at += std::strlen(key);
      }
    }
    throw ConfigError(text);
  }
}

// Note [Rank layout]
// ~~~~~~~~~~~~~~~~~~
// A job of D x P ranks (parallel.data x schedule.ranks) puts the data axis innermost: rank w is
// pipeline rank w / D of replica w % D, so replica d's pipeline is ranks d, D + d, 2D + d, ...
// and the D ranks that hold one stage are neighbours 0..D-1, D..2D-1, ... The reason is the
// bytes each axis moves per step. A stage's data group all-reduces all its gradients once a step
// (the whole model's size, spread over the stages), in one burst at the end of the backward; the
// pipeline moves one activation and one gradient per micro-batch and boundary, smaller, spread
// over the step and overlapped with compute by the schedule. On a cluster, launchers number the
// ranks of one node consecutively, so data-innermost keeps the all-reduce on the node's fast
// links and lets the pipeline's point-to-point messages cross nodes, as DeepSpeed's default
// topology does. On one machine (here: two cores, shared memory for every transport) the two
// placements move the same bytes through the same memory; the order only decides which ranks
// share a core's neighbour. Each pipeline and each data group is a comm::make_group view of the
// job's transport (Note [Groups of ranks]): a replica's pipeline and a stage's data group meet
// in one rank only, so their messages never mix.
struct RankLayout {
  std::unique_ptr<comm::Transport> pipeline;  // this replica's ranks; null: the job's transport
  std::unique_ptr<comm::Transport> data;      // this stage's replicas; null: one pipeline
  int replica = 0;
};

RankLayout make_rank_layout(const TrainConfig& config, comm::Transport& job) {
  RankLayout layout;
  const int data = static_cast<int>(config.parallel.data);
  const int ranks = static_cast<int>(config.schedule.ranks);
  if (data == 1) return layout;
  PIPEMAT_CHECK(job.world_size() == data * ranks, ConfigError, "parallel.data is ", data,
                " and schedule.ranks ", ranks, ": the job needs ", data * ranks,
                " ranks (pipemat-run -n ", data * ranks, " ...) but has ", job.world_size());
  const int w = job.rank();
  layout.replica = w % data;
  std::vector<int> pipeline, group;
  for (int p = 0; p < ranks; ++p) pipeline.push_back(p * data + layout.replica);
  for (int d = 0; d < data; ++d) group.push_back((w / data) * data + d);
  layout.pipeline = comm::make_group(job, pipeline);
  layout.data = comm::make_group(job, group);
  return layout;
}

}  // namespace

ResolvedSchedule resolve_schedule(const TrainConfig& config) {
  ResolvedSchedule out{config, std::nullopt, ""};
  if (config.schedule_csv.empty()) return out;
  // A regular file of at most kMaxInputFileBytes (core/files.h), refused by stat before opening.
  const std::string text = read_regular_file(config.schedule_csv, "schedule.csv");
  schedule::TorchCsvImport imported = schedule::import_torch_csv_report(text, config.schedule_csv);
  schedule::ScheduleOptions& s = out.config.schedule;
  s.kind = schedule::ScheduleKind::kImported;
  s.ranks = imported.schedule.ranks_count;
  s.micro_batches = imported.schedule.micro_batches;
  s.virtual_stages = imported.schedule.virtual_stages;
  out.actions = std::move(imported.schedule);
  out.note = std::move(imported.note);
  return out;
}

std::vector<int> stages_without_replay(const models::RematConfig& remat,
                                       schedule::RecomputeMode recompute,
                                       const schedule::Schedule& schedule) {
  if (!remat.stages.empty() || recompute != schedule::RecomputeMode::kPretrigger ||
      (remat.policy != models::RematPolicyKind::kSelective &&
       remat.policy != models::RematPolicyKind::kFull)) {
    return {};
  }
  std::vector<int> stages = schedule::stages_whose_replay_follows_forward(schedule);
  if (static_cast<int>(stages.size()) == schedule.stages_count) return {};  // keep the policy
  return stages;
}

namespace {

// The schedule part of the pipeline's options: it fixes the stage count the model is built for.
pp::PipelineOptions schedule_options(const ResolvedSchedule& resolved) {
  pp::PipelineOptions options;
  options.schedule = resolved.config.schedule;
  options.actions = resolved.actions;
  return options;
}

// The model run's remat, loss and seed, the training's optimizer and the rank's data group.
void add_run_options(pp::PipelineOptions& options, const TrainConfig& config, const ModelRun& run,
                     const RankLayout& layout) {
  options.remat = run.policy;
  options.stage_remat = run.stage_policies;
  options.loss = run.loss;
  options.optimizer = [training = config.training](const std::vector<at::Tensor>& params) {
    return make_optimizer(training, params);
  };
  options.lr_schedule = lr_schedule_of(config.training);
  options.clip_grad_norm = config.training.clip_grad_norm;
  if (run.random) options.seed = config.training.seed;
  options.data_group = layout.data.get();
  options.trace_replicas = !config.output.trace.empty();  // Note [Step trace]: every replica
  options.gradient_bucket_bytes = config.parallel.bucket_bytes;
  options.weight_tail = config.parallel.weight_tail;
  options.shard_optimizer = config.parallel.shard_optimizer;
}

// stages_without_replay of the run: `options.stage_remat` gets an empty policy for each.
std::vector<int> drop_replays_without_gain(pp::PipelineOptions& options,
                                           const TrainConfig& config) {
  const std::vector<int> stages = stages_without_replay(config.remat, config.schedule.recompute,
                                                        pp::executed_schedule(options));
  for (int s : stages) options.stage_remat[s] = remat::RematPolicy{};
  return stages;
}

// "remat: selective on every stage but 1: ..." for drop_replays_without_gain's stages.
std::string describe_dropped_replays(const std::vector<int>& stages, const TrainConfig& config) {
  std::vector<std::string> names;
  for (int s : stages) names.push_back(std::to_string(s));
  const bool one = stages.size() == 1;
  return std::string("remat: ") + to_string(config.remat.policy) + " on every stage but " +
         join(names, ", ") + (one ? ", which runs" : ", which run") +
         " without a checkpoint: each of " + (one ? "its" : "their") +
         " forwards is followed by its own pre-triggered replay, so a replay would lower no "
         "peak (remat.stages gives every stage its policy by hand)";
}

// The rank's index among the ranks of its host, which `training.device: cuda` maps to a GPU:
// Open MPI's local rank under mpirun, else the job rank (pipemat-run --tcp and the local
// transport start every rank on one host).
int local_rank_of(const comm::Transport& job) {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (local != nullptr) {
    char* end = nullptr;
    const long value = std::strtol(local, &end, 10);
    if (end != local && *end == '\0' && value >= 0 && value < (1 << 20)) {
      return static_cast<int>(value);
    }
  }
  return job.rank();
}

// What one rank's run shares between its start, its steps and its end.
struct RankRun {
  const TrainConfig& config;
  const ModelRun& run;
  pp::Pipeline& pipeline;
  comm::Transport& transport;  // the pipeline's
  int replica = 0;
  std::ostream* talk = nullptr;  // the progress stream on the rank that speaks for the job
  TrainResult& result;
};

// The model keys whose values differ between the config a checkpoint's run was started with
// (`then`) and `config`: "; model.hidden is 128 in the checkpoint's run but 64 here"; empty
// when they agree.
std::string changed_model_keys(const TrainConfig& then, const TrainConfig& config) {
  std::vector<std::string> changed;
  const YAML::Node was = YAML::Load(config_to_yaml(then))["model"];
  const YAML::Node now = YAML::Load(config_to_yaml(config))["model"];
  for (const auto& item : now) {
    const std::string key = item.first.as<std::string>();
    const std::string a = YAML::Dump(was[key]), b = YAML::Dump(item.second);
    if (key != "from" && a != b) {
      changed.push_back("model." + key + " is " + a + " in the checkpoint's run but " + b +
                        " here");
    }
  }
  return changed.empty() ? "" : "; " + join(changed, ", ");
}

// Loads the checkpoint the run resumes from, if any, and says so and where the run saves.
void resume_run(const RankRun& r, const RunCheckpoints& checkpoints) {
  if (r.talk) {
    for (const std::string& skipped : checkpoints.skipped) {
      *r.talk << "resume latest: skipped " << skipped << "\n";
    }
  }
  if (!checkpoints.resume_dir.empty()) {
    pp::CheckpointLoad loaded;
    double load_ms = 0;
    try {
      const auto t0 = std::chrono::steady_clock::now();
      loaded = pp::load_checkpoint(r.pipeline, r.transport, checkpoints.resume_dir,
                                   r.config.training.allow_non_finite);
      load_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      r.result.final_checkpoint = checkpoints.resume_dir;  // the last complete one, so far
    } catch (const PipelineError& e) {
      // Nothing was loaded on any rank: say which checkpoint to name instead (the rank whose
      // part failed keeps its error's kind, the others their echo's).
      const std::string hint =
          (checkpoints.resumed_config ? changed_model_keys(*checkpoints.resumed_config, r.config)
                                      : std::string()) +
          (checkpoints.older.empty()
               ? std::string("; there is no older complete checkpoint of this run")
               : "; to resume the newest complete one before it: --resume " + checkpoints.older);
      if (dynamic_cast<const PeerFailedError*>(&e) != nullptr) {
        throw PeerFailedError(e.what() + hint);
      }
      throw PipelineError(e.what() + hint);
    }
    if (r.talk) {
      const std::string from = pp::describe_layout(
          loaded.from, checkpoints.resumed_config
                           ? checkpoints.resumed_config->partition.layers_per_stage
                           : std::vector<int64_t>{});
      const std::string to = pp::describe_layout(r.pipeline, r.config.partition.layers_per_stage);
      if (from != to) *r.talk << "resharded from " << from << " to " << to << "\n";
      *r.talk << "resumed from " << checkpoints.resume_dir << " after step " << r.pipeline.step();
      // Note [Checkpoint load planner]: what each rank read, against the tensors it holds.
      if (!loaded.rank_bytes_read.empty()) {
        *r.talk << ": read";
        for (size_t k = 0; k < loaded.rank_bytes_read.size(); ++k) {
          *r.talk << (k == 0 ? " " : ", ") << format_bytes(loaded.rank_bytes_read[k])
                  << (k == 0 ? " on rank 0" : " on " + std::to_string(k));
        }
        *r.talk << " for " << format_bytes(loaded.rank_tensor_bytes[0]);
        for (size_t k = 1; k < loaded.rank_tensor_bytes.size(); ++k) {
          *r.talk << ", " << format_bytes(loaded.rank_tensor_bytes[k]);
        }
        *r.talk << " of their tensors, holding at most "
                << format_bytes(*std::max_element(loaded.rank_peak_bytes.begin(),
                                                  loaded.rank_peak_bytes.end()))
                << " more on a rank while loading, in " << format_fixed(load_ms / 1000.0, 2)
                << " s";
      }
      *r.talk << "\n";
    }
  }
  if (r.talk && !r.config.checkpoint.dir.empty()) {
    print_checkpoint_run(*r.talk, r.config, checkpoints);
  }
}

// Replica 0 writes the checkpoints: the replicas hold the same weights and optimizer state (Note
// [Sharded optimizer]: each replica writes its own optimizer shard beside them).
// True when a checkpoint was saved (or its final save failed).
bool save_after_step(const RankRun& r, const RunCheckpoints& checkpoints, int64_t step, int64_t end,
                     const std::string& metadata) {
  const CheckpointOptions& ck = r.config.checkpoint;
  if (ck.dir.empty() || (r.replica != 0 && !r.pipeline.shards_optimizer()) ||
      !((ck.every > 0 && (step + 1) % ck.every == 0) || step + 1 == end))
    return false;
  // Note [End of a run]: the last step's save failing ends the run, not the training; every
  // replica (Note [Sharded optimizer]: each writes its shard) ends the save the same way.
  const bool final_save = step + 1 == end;
  try {
    const std::string dir = pp::save_checkpoint(r.pipeline, r.transport, ck.dir, checkpoints.run,
                                                static_cast<int>(ck.keep_last), metadata);
    if (r.replica != 0) return true;
    r.result.final_checkpoint = dir;
    if (r.talk) *r.talk << "checkpoint " << r.result.final_checkpoint << "\n";
  } catch (const PipelineError& e) {
    if (!final_save) throw;
    if (r.replica != 0) return true;
    r.result.final_checkpoint.clear();
    r.result.end_failures.push_back({EndPart::kCheckpoint, e.what()});
  }
  return true;
}

// After the last step: the timeline, the loss curve and the sample, each failure recorded
// (Note [End of a run]), then one replica's parameters.
void finish_run(const RankRun& r, const std::vector<LossPoint>& train_curve, int64_t end) {
  const TrainConfig& config = r.config;
  TrainResult& result = r.result;
  const auto at_end = [&](EndPart part, const std::function<void()>& work) {
    try {
      work();
    } catch (const std::exception& e) {
      result.end_failures.push_back({part, e.what()});
    }
  };
  if (result.last_stage_rank && !config.output.timeline_svg.empty() && !result.steps.empty()) {
    at_end(EndPart::kOutput,
           [&] { write_timeline_svg(config, r.pipeline.schedule(), result.last); });
  }
  if (!train_curve.empty()) {
    at_end(EndPart::kOutput, [&] {
      std::vector<LossPoint> validation_curve;
      for (const auto& [step, loss] : result.validation) {
        validation_curve.push_back({step + 1, loss});
      }
      write_loss_svg(config.output.loss_svg, train_curve, validation_curve, r.run.summary);
      if (r.talk) *r.talk << "loss curve " << config.output.loss_svg << "\n";
    });
  }
  if (result.last_stage_rank && config.sample.tokens > 0 && !config.checkpoint.dir.empty() &&
      end == config.training.steps) {
    at_end(EndPart::kSample, [&] {
      PIPEMAT_CHECK(!result.final_checkpoint.empty(), PipelineError,
                    "no sample: it is drawn from the final checkpoint, which was not saved");
      const GenerateResult sample = generate_text(result.final_checkpoint, config.sample);
      result.sample = sample.text;
      if (r.talk) {
        *r.talk << "sample (pipemat generate --checkpoint " << result.final_checkpoint
                << " --tokens " << config.sample.tokens << "):\n"
                << config.sample.prompt << sample.text << "\n"
                << std::flush;
      }
    });
  }
  // One replica's parameters: the others hold the same bits (Note [Data x pipeline]).
  for (int s : r.replica == 0 ? r.pipeline.stages() : std::vector<int>{}) {
    for (const auto& item : r.pipeline.stage(s).module->named_parameters()) {
      result.params.emplace_back(r.run.global_name(s, item.key()), item.value());
    }
  }
}

// A step whose loss or clipped gradient norm is not finite ends the run (DivergedError): the
// same on every rank, since the loss and the norm are shared (Note [Data x pipeline]).
void stop_if_diverged(const TrainConfig& config, const StepMetrics& m, int64_t step,
                      const TrainResult& result) {
  const bool loss_bad = !std::isfinite(m.loss);
  const bool norm_bad = config.training.clip_grad_norm > 0 && !std::isfinite(m.grad_norm);
  if (!loss_bad && !norm_bad) return;
  std::string what = loss_bad ? ::pipemat::detail::concat("the loss is ", m.loss) : "";
  if (norm_bad) {
    what +=
        ::pipemat::detail::concat(loss_bad ? " and " : "", "the gradient norm is ", m.grad_norm);
  }
  throw DivergedError(::pipemat::detail::concat(
      "training diverged at step ", step + 1, " of ", config.training.steps, ": ", what,
      "; the run stopped before saving that step. ",
      result.final_checkpoint.empty()
          ? std::string("No checkpoint of this run was saved")
          : "The last complete checkpoint is " + result.final_checkpoint,
      ". The weights were finite when the run started (every loaded tensor is checked for "
      "NaN and infinities), so the training itself diverged. Lower training.lr (",
      config.training.lr,
      ") or clip the gradients (training.clip_grad_norm), or set "
      "training.allow_non_finite=true to train on"));
}

// Note [Stopping on a signal]: true, with result.interrupted set, when a stop is requested at
// this boundary (`steps_done` steps complete).
bool stop_here(const RankRun& r, const StopRequested& stop_requested, int64_t steps_done) {
  if (!stop_requested || !stop_requested()) return false;
  // The last checkpoint saved, else the one resumed from (resume_run sets it).
  r.result.interrupted = Interruption{steps_done, r.result.final_checkpoint, r.replica == 0};
  return true;
}

// transport.lane (Note [Device lanes]): attached once to the job's transport, before its groups
// and the pipeline; collective over the job's ranks for nccl.
void attach_lane(const TrainConfig& config, comm::Transport& job, c10::Device device) {
  if (config.transport.lane == comm::LaneKind::kNone || job.device_lane() != nullptr) return;
  PIPEMAT_CHECK(device.is_cuda(), ConfigError,
                "transport.lane: nccl moves tensors between GPUs, but training.device is ",
                device.str(), "; set training.device: cuda, or transport.lane: none");
  job.attach_device_lane(comm::make_device_lane(job, comm::make_nccl_link(job, device.index())));
}

// Note [Split by cost]: job rank 0 profiles the config and chooses the split; every rank gets
// it (or rank 0's error) before any stage is built, and the config holds it from here on.
std::optional<CostSplit> share_cost_split(TrainConfig& config, comm::Transport& job) {
  if (!config.partition.by_cost) return std::nullopt;
  const std::string message = decide_on_rank_zero(job, kSplitTag, "split", [&] {
    try {
      const CostSplit split = choose_cost_split(config, PlanOptions{});
      return nlohmann::json{{"layers_per_stage", split.layers_per_stage},
                            {"step_ms", split.step_ms},
                            {"parameter_split", split.parameter_split},
                            {"parameter_step_ms", split.parameter_step_ms},
                            {"simulations", split.simulations},
                            {"kept", split.kept_parameter_split},
                            {"budget_bytes", split.budget_bytes},
                            {"peak_bytes", split.peak_bytes},
                            {"parameter_peak_bytes", split.parameter_peak_bytes},
                            {"parameter_fits", split.parameter_fits}}
          .dump();
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {  // the profile's: named for the key that asked for it
      PIPEMAT_THROW(ConfigError, "partition.layers_per_stage auto: ", e.what());
    }
  });
  CostSplit split;
  try {
    const nlohmann::json j = nlohmann::json::parse(message);
    split.layers_per_stage = j.at("layers_per_stage").get<std::vector<int64_t>>();
    split.step_ms = j.at("step_ms").get<double>();
    split.parameter_split = j.at("parameter_split").get<std::vector<int64_t>>();
    split.parameter_step_ms = j.at("parameter_step_ms").get<double>();
    split.simulations = j.at("simulations").get<long long>();
    split.kept_parameter_split = j.at("kept").get<bool>();
    split.budget_bytes = j.at("budget_bytes").get<std::vector<double>>();
    split.peak_bytes = j.at("peak_bytes").get<std::vector<double>>();
    split.parameter_peak_bytes = j.at("parameter_peak_bytes").get<std::vector<double>>();
    split.parameter_fits = j.at("parameter_fits").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    PIPEMAT_THROW(CommError, "rank 0 sent a malformed split: ", e.what());
  }
  config.partition.by_cost = false;
  config.partition.memory_budget.clear();  // met by the counts
  config.partition.layers_per_stage = split.layers_per_stage;
  return split;
}

}  // namespace

TrainResult train_on(const TrainConfig& given, comm::Transport& job, std::ostream* progress,
                     const AfterStep& after_step, const StopRequested& stop_requested) {
  remat::install_tracking_allocator();
  ResolvedSchedule resolved = resolve_schedule(given);
  check_schedule(resolved);
  const TrainConfig& config = resolved.config;
  const c10::Device device =
      pp::resolve_device(config.training.device, local_rank_of(job), "training.device");
  attach_lane(config, job, device);
  // Note [Rank layout]: this rank's pipeline and, with data parallelism, its data group.
  const RankLayout layout = make_rank_layout(config, job);
  comm::Transport& transport = layout.pipeline ? *layout.pipeline : job;
  // Before anything is built: a directory this run must not write into is refused at once (by
  // every rank of the job: replica 0 writes, every replica resumes).
  const RunCheckpoints checkpoints = start_checkpoints(config, job);
  const std::optional<CostSplit> cost_split = share_cost_split(resolved.config, job);
  pp::PipelineOptions options = schedule_options(resolved);
  const ModelRun run = make_model_run(config, pp::stage_count(options));
  add_run_options(options, config, run, layout);
  const std::vector<int> no_replay = drop_replays_without_gain(options, config);
  options.device = device;
  options.precision = config.training.precision;
  // training.init_from: the whole model's names and shapes, to check the file against, before
  // this rank drops the stages it does not hold. A resumed run loads its checkpoint instead.
  const bool init_from = !config.training.init_from.empty() && checkpoints.resume_dir.empty();
  const WeightShapes init_shapes =
      init_from ? model_weight_shapes(run, config.model.kind) : WeightShapes{};
  pp::Pipeline pipeline(transport, options, run.stage);
  run.release_unused();  // the other ranks' stages' weights
  TrainResult result;
  // Replica 0's last stage speaks for the job (every replica holds the same loss and weights).
  result.last_stage_rank = pipeline.is_last_stage_rank() && layout.replica == 0;
  const RankRun r{
      config,         run,
      pipeline,       transport,
      layout.replica, result.last_stage_rank && config.output.progress ? progress : nullptr,
      result};
  resume_run(r, checkpoints);
  if (init_from) {
    std::vector<std::pair<int, torch::nn::Module*>> own;
    for (int s : pipeline.stages()) own.emplace_back(s, pipeline.stage(s).module.get());
    const LoadSummary loaded =
        load_weights(config.training.init_from, "training.init_from", init_shapes, run.global_name,
                     config.model.kind, own, config.training.allow_non_finite);
    if (r.talk) {
      *r.talk << "init_from " << config.training.init_from << ": " << init_shapes.size()
              << " tensors checked, " << loaded.tensors << " of this rank's read\n";
    }
  } else if (!config.training.init_from.empty() && r.talk) {
    *r.talk << "init_from " << config.training.init_from
            << ": not read, the run resumes from its checkpoint\n";
  }
  MetricsFile metrics(result.last_stage_rank ? config.output.metrics : "",
                      !config.checkpoint.resume.empty());
  TraceFile trace(result.last_stage_rank ? config.output.trace : "", pipeline.schedule(),
                  static_cast<int>(config.parallel.data));
  if (r.talk) {
    print_compute(*r.talk, job.world_size(),
                  {comm::transport_name(job),
                   place_of_device(options.device, config.training.device), options.precision});
    *r.talk << "model: " << run.summary << "\n";
    if (cost_split) *r.talk << describe_cost_split(*cost_split) << "\n";
    if (!no_replay.empty()) *r.talk << describe_dropped_replays(no_replay, config) << "\n";
    *r.talk << std::flush;
  }
  const std::string metadata = config_to_yaml(given);
  Pace pace;
  pace.first_step = pipeline.step();
  pace.tokens_per_step =
      run.tokens_per_micro_batch * config.schedule.micro_batches * config.parallel.data;
  const int64_t eval_every = run.eval_data ? config.training.eval_every : 0;
  // The train curve only when it is drawn: a long run's memory stays flat.
  const bool draw_curve = result.last_stage_rank && !config.output.loss_svg.empty();
  std::vector<LossPoint> train_curve;
  const int64_t end = config.training.stop_after > 0
                          ? std::min(config.training.stop_after, config.training.steps)
                          : config.training.steps;
  for (int64_t step = pipeline.step(); step < end; ++step) {
    if (stop_here(r, stop_requested, step)) break;
    StepMetrics m;
    try {
      m = pipeline.train_step(run.train_data);
    } catch (const CommError&) {
      if (stop_here(r, stop_requested, step)) break;  // a peer stopped before it
      throw;
    }
    const bool last = step + 1 == config.training.steps;
    std::optional<double> validation;
    if (eval_every > 0 && ((step + 1) % eval_every == 0 || last)) {
      pp::EvalOptions eo;
      eo.micro_batches = config.training.eval_batches;
      validation = pipeline.evaluate(run.eval_data, eo).loss;
      result.validation.push_back({step, *validation});
    }
    if (draw_curve) train_curve.push_back({step + 1, m.loss});
    if (result.last_stage_rank) {
      result.totals.add(m);
      metrics.write(m, validation);
      if (r.talk) {
        print_progress(*r.talk, config, m, true, pace);
        if (validation)
          print_validation(*r.talk, step, *validation, r.run.validation_tokens_per_byte);
      }
    }
    if (!config.training.allow_non_finite) stop_if_diverged(config, m, step, result);
    if (result.last_stage_rank && trace.on()) {
      const double writing = pp::steady_clock_us();
      trace.step(m);
      result.totals.trace_ms.push_back((pp::steady_clock_us() - writing) / 1000.0);
    }
    keep_step(result, std::move(m));
    const double saving = pp::steady_clock_us();
    if (save_after_step(r, checkpoints, step, end, metadata) && result.last_stage_rank) {
      trace.span("CHECKPOINT", job.rank(), saving, pp::steady_clock_us(), step);
    }
    if (after_step) after_step(step, transport);
  }
  if (!result.interrupted && !stop_here(r, stop_requested, end)) {
    finish_run(r, train_curve, end);
  }
  return result;
}

TrainResult train_in_process(const TrainConfig& config, std::ostream* progress,
                             const AfterStep& after_step, const StopRequested& stop_requested) {
  const ResolvedSchedule resolved = resolve_schedule(config);
  const int ranks =
      resolved.config.schedule.ranks * static_cast<int>(resolved.config.parallel.data);
  PIPEMAT_CHECK(ranks >= 1, ConfigError, "schedule.ranks must be at least 1");
  check_schedule(resolved);  // before any thread or tensor exists
  std::vector<TrainResult> results(ranks);
  try {
    comm::run_local_ranks(ranks, config.transport, [&](comm::Transport& transport) {
      results[transport.rank()] = train_on(config, transport, progress, after_step, stop_requested);
    });
  } catch (const comm::ThreadStartError& e) {
    PIPEMAT_THROW(ConfigError, "transport local: could not start thread ", e.thread, " of ",
                  e.count, " (", e.reason,
                  "); run fewer ranks in one process "
                  "(schedule.ranks) or use transport.kind mpi / tcp");
  }
  TrainResult merged;
  for (auto& r : results) {
    if (r.last_stage_rank) {
      merged.steps = r.steps;
      merged.last = r.last;
      merged.last_stage_rank = true;
      merged.validation = r.validation;
      merged.sample = r.sample;
      merged.final_checkpoint = r.final_checkpoint;
      merged.totals = r.totals;
    }
    if (r.interrupted && (r.last_stage_rank || !merged.interrupted)) {
      merged.interrupted = r.interrupted;  // replica 0's last stage's, which knows the checkpoint
    }
    for (const EndFailure& f : r.end_failures) {  // one line per part (a save fails everywhere)
      const bool known = std::any_of(merged.end_failures.begin(), merged.end_failures.end(),
                                     [&](const EndFailure& g) { return g.part == f.part; });
      if (!known) merged.end_failures.push_back(f);
    }
    merged.params.insert(merged.params.end(), r.params.begin(), r.params.end());
  }
  return merged;
}

const char* to_string(EndPart part) {
  switch (part) {
    case EndPart::kCheckpoint:
      return "the final checkpoint";
    case EndPart::kOutput:
      return "an output file";
    case EndPart::kSample:
      return "the sample";
  }
  return "?";
}

namespace {

// Prints each end-of-run failure (Note [End of a run]) and returns the exit code.
int report_end(const TrainResult& result, const TrainConfig& config, std::ostream& err) {
  int code = 0;
  for (const EndFailure& f : result.end_failures) {
    // One write per line: ranks started as local processes share the terminal, and a line
    // written in pieces interleaves with another rank's.
    std::string line = ::pipemat::detail::concat(
        "pipemat: error: ", to_string(f.part), " failed after the run's last step (step ",
        result.last.step + 1, " of ", config.training.steps, "): ", f.message);
    if (f.part != EndPart::kCheckpoint && !result.final_checkpoint.empty()) {
      line += ::pipemat::detail::concat("; the final checkpoint ", result.final_checkpoint,
                                        " is complete");
    }
    err << line + "\n" << std::flush;
    const int part = static_cast<int>(f.part);
    code = code == 0 ? part : std::min(code, part);
  }
  return code;
}

// Note [Stopping on a signal]: replica 0's ranks say where the run stopped (`who`: "rank R: "
// for one process of a job); returns the exit code.
// Runs `train`; an allocation that failed (LibTorch's allocator, or operator new) becomes a
// PipelineError naming the keys that size what the run allocates, instead of the allocator's
// text and a C++ backtrace.
TrainResult out_of_memory_names_the_keys(const TrainConfig& config,
                                         const std::function<TrainResult()>& train) {
  std::string what;
  try {
    return train();
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
    const bool allocation = dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
                            what.find("can't allocate memory") != std::string::npos ||
                            what.find("not enough memory") != std::string::npos;
    if (!allocation) throw;
  } catch (const std::bad_alloc& e) {
    what = e.what();
  }
  const models::ModelOptions& m = config.model;
  const std::string size =
      models::is_text_model(m.kind)
          ? ::pipemat::detail::concat("model.batch ", m.batch, " x model.seq_len ", m.seq_len)
          : ::pipemat::detail::concat("model.tokens ", m.tokens);
  PIPEMAT_THROW(PipelineError, "out of memory: the run (", size, " per micro-batch, model.hidden ",
                m.hidden, ", model.layers ", m.layers, ", schedule.micro_batches ",
                config.schedule.micro_batches, ") needs more memory than this machine gave it (",
                what.substr(0, what.find('\n')),
                "); lower those keys, or recompute more (remat.policy full)");
}

int report_interrupted(const TrainResult& result, const TrainConfig& config, const std::string& who,
                       std::ostream& err) {
  const Interruption& at = *result.interrupted;
  if (!at.replica0) return kInterrupted;
  std::string line =
      ::pipemat::detail::concat("pipemat: ", who, "interrupted at step ", at.steps_done, " of ",
                                config.training.steps, " (the last complete step); ");
  if (at.checkpoint.empty()) {
    line += config.checkpoint.dir.empty()
                ? "there is no complete checkpoint (checkpoint.dir is not set)"
                : "there is no complete checkpoint (this run has saved none yet)";
  } else {
    line += ::pipemat::detail::concat("the last complete checkpoint is ", at.checkpoint,
                                      " (pipemat train --resume ", at.checkpoint,
                                      " continues from it)");
  }
  err << line + "\n" << std::flush;
  return kInterrupted;
}

}  // namespace

int run_train(const TrainConfig& config, bool reference, std::ostream& out, std::ostream& err,
              const StopRequested& stop_requested) {
  const ResolvedSchedule resolved = resolve_schedule(config);
  if (!resolved.note.empty()) out << resolved.note << "\n";
  // The ranks of this machine share its cores (all of them when they are threads here). The
  // reference computes with the threads one rank of that pipeline gets: LibTorch's reductions
  // depend on the thread count, and the oracle must be comparable bitwise.
  int ranks_on_host = resolved.config.schedule.ranks * static_cast<int>(config.parallel.data);
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    ranks_on_host = std::atoi(local);
  set_training_threads(config, config.training.threads > 0
                                   ? static_cast<int>(config.training.threads)
                                   : pp::default_compute_threads(ranks_on_host));
  if (reference) {
    train_reference(config, &out);
    return 0;
  }
  // After training, on the rank that prints: the run summary, with the single process measured
  // now (the other ranks are done and leave it the machine).
  const auto summarize = [&](const TrainResult& result, bool one_process) {
    if (!result.last_stage_rank || !config.output.progress) return;
    std::optional<ReferenceFigures> figures;
    if (config.output.reference_steps > 0 && !(stop_requested && stop_requested())) {
      out << "measuring the single process for the summary: " << config.output.reference_steps
          << " steps of pipemat train --reference (output.reference_steps)\n"
          << std::flush;
      // The single process on this machine: all its cores unless threads were set.
      figures = measure_reference(
          config, config.output.reference_steps,
          config.training.threads > 0 ? static_cast<int>(config.training.threads)
                                      : pp::default_compute_threads(1),
          stop_requested);  // a stop request ends the measurement: a summary without it
    }
    const int64_t tokens_per_step = tokens_per_micro_batch(config.model) *
                                    resolved.config.schedule.micro_batches * config.parallel.data;
    print_run_summary(out, resolved.config, result.totals, tokens_per_step, figures, one_process);
  };
  comm::TransportOptions options = comm::resolve_options(config.transport);
  // tcp refuses a rank of another job at the rendezvous: every rank must run this config.
  options.job = "pipemat train " + sha256_hex(config_to_yaml(config));
  if (options.kind == comm::TransportKind::kLocal) {
    const TrainResult result = out_of_memory_names_the_keys(
        config, [&] { return train_in_process(config, &out, nullptr, stop_requested); });
    if (result.interrupted) return report_interrupted(result, config, "", err);
    summarize(result, /*one_process=*/true);
    return report_end(result, config, err);
  }
  auto transport = comm::make_transport(options);
  const TrainResult result = out_of_memory_names_the_keys(
      config, [&] { return train_on(config, *transport, &out, nullptr, stop_requested); });
  if (result.interrupted) {
    const std::string who = ::pipemat::detail::concat("rank ", transport->rank(), ": ");
    return report_interrupted(result, config, who, err);
  }
  summarize(result, /*one_process=*/false);
  return report_end(result, config, err);
}

}  // namespace pipemat::train
