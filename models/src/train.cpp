#include "pipemat/models/train.h"

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <thread>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/models/config.h"
#include "pipemat/models/generate.h"
#include "pipemat/models/loss_curve.h"
#include "pipemat/models/model_run.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/rng.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/simulate.h"
#include "pipemat/schedule/torch_csv.h"

namespace pipemat::models {
namespace {

// Elapsed time and steps of this process's run, for tokens/s and the ETA.
struct Pace {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  int64_t first_step = 0;  // the step this process started at (resume: not 0)
  int64_t tokens_per_step = 0;
};

void print_progress(std::ostream& out, const TrainConfig& c, const StepMetrics& m, bool pipeline,
                    const Pace& pace) {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - pace.start).count();
  const auto done = static_cast<double>(m.step + 1 - pace.first_step);
  const double eta = elapsed / done * static_cast<double>(c.training.steps - m.step - 1);
  const double tokens_per_s =
      m.step_ms > 0 ? static_cast<double>(pace.tokens_per_step) * 1000.0 / m.step_ms : 0.0;
  const int percent = static_cast<int>(100 * (m.step + 1) / c.training.steps);
  char line[400];
  int n =
      std::snprintf(line, sizeof(line), "step %lld/%lld  loss %.6f  %s tok/s  %.1f ms",
                    static_cast<long long>(m.step + 1), static_cast<long long>(c.training.steps),
                    m.loss, format_count(tokens_per_s).c_str(), m.step_ms);
  if (pipeline) {
    n += std::snprintf(line + n, sizeof(line) - n, "  bubble %.3f (simulated %.3f)", m.bubble,
                       m.simulated_bubble);
  }
  n += std::snprintf(line + n, sizeof(line) - n, "  peak %s  %3d%%  ETA %s",
                     format_bytes(m.peak_bytes).c_str(), percent, format_duration(eta).c_str());
  if (pipeline) {
    std::snprintf(
        line + n, sizeof(line) - n,
        "  remat: units %lld replays %lld early-stops %lld save %lld skipped %lld",
        static_cast<long long>(m.remat.unit_calls), static_cast<long long>(m.remat.replays),
        static_cast<long long>(m.remat.early_stops), static_cast<long long>(m.remat.save_calls),
        static_cast<long long>(m.remat.save_skips));
  } else {
    std::snprintf(line + n, sizeof(line) - n, "  (reference)");
  }
  out << line << "\n" << std::flush;
}

void print_validation(std::ostream& out, int64_t step, double loss) {
  char line[160];
  std::snprintf(line, sizeof(line), "validation after step %lld: loss %.4f nats/byte (%.3f bits)\n",
                static_cast<long long>(step + 1), loss, loss / std::log(2.0));
  out << line << std::flush;
}

// The first progress line: which BLAS runs the GEMMs and with how many threads.
void print_compute(std::ostream& out, int ranks) {
  const pp::ComputeInfo info = pp::compute_info();
  out << "compute: " << ranks << (ranks == 1 ? " rank" : " ranks") << ", " << info.threads
      << (info.threads == 1 ? " thread" : " threads") << " per rank (training.threads), BLAS "
      << info.blas << (info.freed_memory_retained ? "; freed memory kept for reuse" : "") << "\n";
  if (info.reference_blas) {
    out << "warning: this is Debian's reference BLAS, about 10x slower than OpenBLAS for the "
           "GEMMs of training; install libopenblas0-pthread (scripts/install-deps.sh does)\n";
  }
  out << std::flush;
}

class MetricsFile {
 public:
  // `append`: a resumed run adds its steps to the lines of the run it continues.
  explicit MetricsFile(const std::string& path, bool append = false) {
    if (path.empty()) return;
    file_.open(path, append ? std::ios::app : std::ios::trunc);
    PIPEMAT_CHECK(file_.good(), ConfigError, "output.metrics: cannot write '", path, "'");
  }
  void write(const StepMetrics& m, std::optional<double> validation = std::nullopt) {
    if (file_.is_open()) file_ << metrics_json(m, validation) << "\n" << std::flush;
  }

 private:
  std::ofstream file_;
};

// "run.svg" -> "run.predicted.svg".
std::string predicted_svg_path(const std::string& path) {
  const auto dot = path.rfind('.');
  const auto slash = path.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return path + ".predicted.svg";
  }
  return path.substr(0, dot) + ".predicted" + path.substr(dot);
}

// The measured timeline of a step next to the simulator's prediction with the measured costs.
void write_timeline_svg(const TrainConfig& config, const schedule::Schedule& plan,
                        const StepMetrics& m) {
  schedule::RenderOptions measured_options;
  measured_options.costs_label = "measured (ms)";
  const std::string measured = schedule::render_svg(plan, m.measured, measured_options);
  std::ofstream file(config.output.timeline_svg);
  PIPEMAT_CHECK(file.good(), ConfigError, "output.timeline_svg: cannot write '",
                config.output.timeline_svg, "'");
  file << measured;
  // Next to it: the simulator's prediction for the same schedule with the measured costs.
  schedule::RenderOptions predicted_options;
  predicted_options.costs_label = "simulated with the measured mean costs (ms)";
  const std::string path = predicted_svg_path(config.output.timeline_svg);
  std::ofstream predicted(path);
  PIPEMAT_CHECK(predicted.good(), ConfigError, "output.timeline_svg: cannot write '", path, "'");
  predicted << schedule::render_svg(plan, schedule::simulate(plan, m.measured_costs),
                                    predicted_options);
}

}  // namespace

std::string metrics_json(const StepMetrics& m, std::optional<double> validation_loss) {
  nlohmann::ordered_json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  if (validation_loss) j["val_loss"] = *validation_loss;
  j["step_ms"] = m.step_ms;
  j["bubble"] = m.bubble;
  j["schedule_bubble"] = m.measured.bubble_ratio;
  j["simulated_bubble"] = m.simulated_bubble;
  j["simulated_bubble_comm"] = m.simulated_bubble_comm;
  j["message_delay_ms"] = m.message_delay_ms;
  j["recv_wait_ms"] = m.recv_wait_ms;
  j["peak_bytes"] = m.peak_bytes;
  j["max_rank_peak_bytes"] = m.max_rank_peak_bytes;
  j["replays"] = m.remat.replays;
  j["early_stops"] = m.remat.early_stops;
  j["save_calls"] = m.remat.save_calls;
  j["save_skips"] = m.remat.save_skips;
  // The measured mean time of each action type (ms), the simulator's costs: what `bench
  // pipeline` turns into per-layer costs for `pipemat project`.
  const schedule::CostModel& c = m.measured_costs;
  j["costs"] = {{"F", c.forward},
                {"B", c.backward_cost()},
                {"I", c.backward_input},
                {"W", c.backward_weight},
                {"R", c.recompute.value_or(0.0)}};
  return j.dump();
}

namespace {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainingOptions& t,
                                                        const std::vector<at::Tensor>& params) {
  switch (t.optimizer) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  }
  PIPEMAT_INTERNAL_ASSERT(false, "training.optimizer ", static_cast<int>(t.optimizer),
                          " is not a value of OptimizerKind");
}

double since_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {

// Keeps `m` whole as the last step and its summary (no timelines; of `measured` only the
// bubble ratio) in the bounded history.
void keep_step(TrainResult& result, StepMetrics m) {
  result.last = m;
  m.timeline.clear();
  m.timeline.shrink_to_fit();
  const double schedule_bubble = m.measured.bubble_ratio;
  m.measured = schedule::SimulationResult{};
  m.measured.bubble_ratio = schedule_bubble;
  if (result.steps.size() == kKeptSteps) result.steps.erase(result.steps.begin());
  result.steps.push_back(std::move(m));
}

}  // namespace

namespace {

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
        {"--stages", "schedule.ranks"},
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

}  // namespace

ResolvedSchedule resolve_schedule(const TrainConfig& config) {
  ResolvedSchedule out{config, std::nullopt, ""};
  if (config.schedule_csv.empty()) return out;
  std::ifstream in(config.schedule_csv, std::ios::binary);
  PIPEMAT_CHECK(in.is_open(), ConfigError, "schedule.csv: cannot open '", config.schedule_csv,
                "'; expected a torch.distributed.pipelining CSV schedule (one row per rank)");
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
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

namespace {

pp::LrSchedule lr_schedule_of(const TrainingOptions& training) {
  if (training.warmup == 0 && training.lr_decay == LrDecay::kNone) return nullptr;
  return [training](torch::optim::Optimizer& optimizer, int64_t step) {
    const double lr = lr_at(training, step);
    for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
  };
}

// Creates the parent directory of an output file.
void make_parent(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
}

void write_loss_svg(const std::string& path, const std::vector<LossPoint>& train,
                    const std::vector<LossPoint>& validation, const std::string& title) {
  make_parent(path);
  std::ofstream file(path);
  PIPEMAT_CHECK(file.good(), ConfigError, "output.loss_svg: cannot write '", path, "'");
  file << render_loss_svg(train, validation, title);
}

}  // namespace

TrainResult train_on(const TrainConfig& given, comm::Transport& transport, std::ostream* progress,
                     const AfterStep& after_step) {
  remat::install_tracking_allocator();
  ResolvedSchedule resolved = resolve_schedule(given);
  check_schedule(resolved);
  const TrainConfig& config = resolved.config;
  pp::PipelineOptions options;
  options.schedule = config.schedule;
  options.actions = resolved.actions;
  const ModelRun run = make_model_run(config, pp::stage_count(options));
  options.remat = run.policy;
  options.stage_remat = run.stage_policies;
  options.loss = run.loss;
  options.optimizer = [training = config.training](const std::vector<at::Tensor>& params) {
    return make_optimizer(training, params);
  };
  options.lr_schedule = lr_schedule_of(config.training);
  options.clip_grad_norm = config.training.clip_grad_norm;
  if (run.random) options.seed = config.training.seed;
  pp::Pipeline pipeline(transport, options, run.stage);
  TrainResult result;
  result.last_stage_rank = pipeline.is_last_stage_rank();
  const bool talk = result.last_stage_rank && progress && config.output.progress;
  const CheckpointOptions& ck = config.checkpoint;
  if (!ck.resume.empty()) {
    const std::string dir = ck.resume == "latest" ? pp::latest_checkpoint(ck.dir) : ck.resume;
    PIPEMAT_CHECK(!dir.empty(), ConfigError,
                  "checkpoint.resume: latest: there is no complete "
                  "checkpoint under '",
                  ck.dir, "' (checkpoint.dir)");
    pp::load_checkpoint(pipeline, transport, dir);
    if (talk) *progress << "resumed from " << dir << " after step " << pipeline.step() << "\n";
  }
  if (result.last_stage_rank && !config.output.metrics.empty()) make_parent(config.output.metrics);
  MetricsFile metrics(result.last_stage_rank ? config.output.metrics : "", !ck.resume.empty());
  if (talk) {
    print_compute(*progress, pipeline.schedule().ranks_count);
    *progress << "model: " << run.summary << "\n" << std::flush;
  }
  const std::string metadata = config_to_yaml(given);
  Pace pace;
  pace.first_step = pipeline.step();
  pace.tokens_per_step = run.tokens_per_micro_batch * config.schedule.micro_batches;
  const int64_t eval_every = run.eval_data ? config.training.eval_every : 0;
  // The train curve only when it is drawn: a long run's memory stays flat.
  const bool draw_curve = result.last_stage_rank && !config.output.loss_svg.empty();
  std::vector<LossPoint> train_curve;
  std::string final_checkpoint;
  const int64_t end = config.training.stop_after > 0
                          ? std::min(config.training.stop_after, config.training.steps)
                          : config.training.steps;
  for (int64_t step = pipeline.step(); step < end; ++step) {
    StepMetrics m = pipeline.train_step(run.train_data);
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
      metrics.write(m, validation);
      if (talk) {
        print_progress(*progress, config, m, true, pace);
        if (validation) print_validation(*progress, step, *validation);
      }
    }
    keep_step(result, std::move(m));
    if (!ck.dir.empty() && ((ck.every > 0 && (step + 1) % ck.every == 0) || step + 1 == end)) {
      final_checkpoint = pp::save_checkpoint(pipeline, transport, ck.dir,
                                             static_cast<int>(ck.keep_last), metadata);
      if (talk) *progress << "checkpoint " << final_checkpoint << "\n";
    }
    if (after_step) after_step(step, transport);
  }
  if (result.last_stage_rank && !config.output.timeline_svg.empty() && !result.steps.empty()) {
    write_timeline_svg(config, pipeline.schedule(), result.last);
  }
  if (draw_curve && !train_curve.empty()) {
    std::vector<LossPoint> validation_curve;
    for (const auto& [step, loss] : result.validation) validation_curve.push_back({step + 1, loss});
    write_loss_svg(config.output.loss_svg, train_curve, validation_curve, run.summary);
    if (talk) *progress << "loss curve " << config.output.loss_svg << "\n";
  }
  if (result.last_stage_rank && config.sample.tokens > 0 && !final_checkpoint.empty() &&
      end == config.training.steps) {
    const GenerateResult sample = generate_text(final_checkpoint, config.sample);
    result.sample = sample.text;
    if (talk) {
      *progress << "sample (pipemat generate --checkpoint " << final_checkpoint << " --tokens "
                << config.sample.tokens << "):\n"
                << config.sample.prompt << sample.text << "\n"
                << std::flush;
    }
  }
  for (int s : pipeline.stages()) {
    for (const auto& item : pipeline.stage(s).module->named_parameters()) {
      result.params.emplace_back(run.global_name(s, item.key()), item.value());
    }
  }
  return result;
}

std::vector<StepMetrics> run_reference(const TrainConfig& given,
                                       std::vector<std::pair<std::string, at::Tensor>>* params,
                                       std::vector<std::pair<int64_t, double>>* validation) {
  const TrainConfig config = resolve_schedule(given).config;
  // The same stages as the pipeline, chained in one process: no transport, no remat.
  pp::PipelineOptions shape;
  shape.schedule = config.schedule;
  const int stages = pp::stage_count(shape);
  const ModelRun run = make_model_run(config, stages);
  std::vector<pp::PipelineStage> chain;
  std::vector<at::Tensor> all;
  for (int s = 0; s < stages; ++s) {
    chain.push_back(run.stage(s));
    for (const auto& p : chain.back().module->parameters()) all.push_back(p);
  }
  auto optimizer = make_optimizer(config.training, all);
  const pp::LrSchedule lr_schedule = lr_schedule_of(config.training);
  const uint64_t seed = config.training.seed;
  // Stage s of micro-batch i draws from forward_seed(seed, step, i, s) when the model is
  // random, as the pipeline's ranks do (Note [Random streams of a step]).
  auto forward = [&](pp::Tensors x, int64_t step, int64_t i) {
    for (int s = 0; s < stages; ++s) {
      std::optional<remat::ThreadGeneratorScope> rng;
      if (run.random) rng.emplace(pp::forward_seed(seed, step, i, s));
      x = chain[s].forward(x);
    }
    return x;
  };
  std::vector<StepMetrics> out;
  const int64_t M = config.schedule.micro_batches;
  const int64_t eval_every = run.eval_data ? config.training.eval_every : 0;
  for (int64_t step = 0; step < config.training.steps; ++step) {
    StepMetrics m;
    m.step = step;
    for (auto& p : all) p.mutable_grad().reset();
    remat::reset_peak_bytes();
    const int64_t bytes0 = remat::memory_stats().current_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < M; ++i) {
      const pp::MicroBatch b = run.train_data(step, i);
      auto loss = run.loss(forward(b.inputs, step, i), b.targets) / static_cast<double>(M);
      m.loss += loss.item<double>();
      loss.backward();
    }
    if (config.training.clip_grad_norm > 0) {
      m.grad_norm = torch::nn::utils::clip_grad_norm_(all, config.training.clip_grad_norm);
    }
    if (lr_schedule) lr_schedule(*optimizer, step);
    optimizer->step();
    m.step_ms = since_ms(t0);
    m.busy_ms = m.step_ms;
    m.peak_bytes = remat::memory_stats().peak_bytes - bytes0;
    out.push_back(std::move(m));
    if (eval_every > 0 && ((step + 1) % eval_every == 0 || step + 1 == config.training.steps) &&
        validation) {
      for (auto& c : chain) c.module->eval();
      c10::AutoGradMode no_grad(false);
      const int64_t E = config.training.eval_batches;
      double loss = 0;
      for (int64_t i = 0; i < E; ++i) {
        const pp::MicroBatch b = run.eval_data(step, i);
        loss += (run.loss(forward(b.inputs, step, i), b.targets) / static_cast<double>(E))
                    .item<double>();
      }
      for (auto& c : chain) c.module->train();
      validation->push_back({step, loss});
    }
  }
  if (params) {
    params->clear();
    for (int s = 0; s < stages; ++s) {
      for (const auto& item : chain[s].module->named_parameters()) {
        params->emplace_back(run.global_name(s, item.key()), item.value());
      }
    }
  }
  return out;
}

TrainResult train_in_process(const TrainConfig& config, std::ostream* progress,
                             const AfterStep& after_step) {
  const ResolvedSchedule resolved = resolve_schedule(config);
  const int ranks = resolved.config.schedule.ranks;
  PIPEMAT_CHECK(ranks >= 1, ConfigError, "schedule.ranks must be at least 1");
  check_schedule(resolved);  // before any thread or tensor exists
  comm::TransportOptions options = config.transport;
  options.kind = comm::TransportKind::kLocal;
  auto transports = comm::make_local_transports(ranks, options);
  std::vector<TrainResult> results(ranks);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  try {
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        try {
          results[r] = train_on(config, *transports[r], progress, after_step);
        } catch (...) {
          errors[r] = std::current_exception();
        }
        transports[r].reset();  // peers waiting on this rank fail fast
      });
    }
  } catch (const std::system_error& e) {
    // Out of threads: end the ranks that started (their peers are gone) and say so.
    for (size_t r = threads.size(); r < transports.size(); ++r) transports[r].reset();
    for (auto& t : threads) t.join();
    PIPEMAT_THROW(ConfigError, "transport local: could not start thread ", threads.size() + 1,
                  " of ", ranks, " (", e.what(),
                  "); run fewer ranks in one process "
                  "(schedule.ranks) or use transport.kind mpi / tcp");
  }
  for (auto& t : threads) t.join();
  // The root cause is the first error that is not a consequence of a peer going away.
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommError&) {
      if (!first) first = e;
    } catch (...) {
      first = e;
      break;
    }
  }
  if (first) std::rethrow_exception(first);
  TrainResult merged;
  for (auto& r : results) {
    if (r.last_stage_rank) {
      merged.steps = r.steps;
      merged.last = r.last;
      merged.last_stage_rank = true;
      merged.validation = r.validation;
      merged.sample = r.sample;
    }
    merged.params.insert(merged.params.end(), r.params.begin(), r.params.end());
  }
  return merged;
}

TrainResult train_reference(const TrainConfig& config, std::ostream* progress) {
  remat::install_tracking_allocator();
  if (progress && config.output.progress) print_compute(*progress, 1);
  TrainResult result;
  result.last_stage_rank = true;
  result.steps = run_reference(config, &result.params, &result.validation);
  MetricsFile metrics(config.output.metrics);
  Pace pace;
  pace.tokens_per_step = tokens_per_micro_batch(config.model) * config.schedule.micro_batches;
  size_t next_validation = 0;
  for (const auto& m : result.steps) {
    std::optional<double> validation;
    if (next_validation < result.validation.size() &&
        result.validation[next_validation].first == m.step) {
      validation = result.validation[next_validation++].second;
    }
    metrics.write(m, validation);
    if (progress && config.output.progress) {
      print_progress(*progress, config, m, false, pace);
      if (validation) print_validation(*progress, m.step, *validation);
    }
  }
  return result;
}

int run_train(const TrainConfig& config, bool reference, std::ostream& out) {
  const ResolvedSchedule resolved = resolve_schedule(config);
  if (!resolved.note.empty()) out << resolved.note << "\n";
  // The ranks of this machine share its cores (all of them when they are threads here). The
  // reference computes with the threads one rank of that pipeline gets: LibTorch's reductions
  // depend on the thread count, and the oracle must be comparable bitwise.
  int ranks_on_host = resolved.config.schedule.ranks;
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    ranks_on_host = std::atoi(local);
  pp::set_compute_threads(config.training.threads > 0 ? static_cast<int>(config.training.threads)
                                                      : pp::default_compute_threads(ranks_on_host));
  if (reference) {
    train_reference(config, &out);
    return 0;
  }
  comm::TransportOptions options = comm::resolve_options(config.transport);
  if (options.kind == comm::TransportKind::kLocal) {
    train_in_process(config, &out);
    return 0;
  }
  auto transport = comm::make_transport(options);
  train_on(config, *transport, &out);
  return 0;
}

}  // namespace pipemat::models
