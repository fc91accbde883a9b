#include "pipemat/models/train.h"

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <system_error>
#include <thread>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/models/zoo_stages.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/memory.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/simulate.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/schedule/torch_csv.h"

namespace pipemat::models {
namespace {

void print_progress(std::ostream& out, const TrainConfig& c, const StepMetrics& m, bool pipeline) {
  char line[320];
  if (pipeline) {
    std::snprintf(
        line, sizeof(line),
        "step %lld/%lld  loss %.6f  %.1f ms  bubble %.3f (simulated %.3f)  peak %s  "
        "remat: units %lld replays %lld early-stops %lld save %lld skipped %lld\n",
        static_cast<long long>(m.step + 1), static_cast<long long>(c.training.steps), m.loss,
        m.step_ms, m.bubble, m.simulated_bubble, format_bytes(m.peak_bytes).c_str(),
        static_cast<long long>(m.remat.unit_calls), static_cast<long long>(m.remat.replays),
        static_cast<long long>(m.remat.early_stops), static_cast<long long>(m.remat.save_calls),
        static_cast<long long>(m.remat.save_skips));
  } else {
    std::snprintf(line, sizeof(line), "step %lld/%lld  loss %.6f  %.1f ms  peak %s  (reference)\n",
                  static_cast<long long>(m.step + 1), static_cast<long long>(c.training.steps),
                  m.loss, m.step_ms, format_bytes(m.peak_bytes).c_str());
  }
  out << line << std::flush;
}

// The first progress line: which BLAS runs the GEMMs and with how many threads.
void print_compute(std::ostream& out, int ranks) {
  const pp::ComputeInfo info = pp::compute_info();
  out << "compute: " << ranks << (ranks == 1 ? " rank" : " ranks") << ", " << info.threads
      << (info.threads == 1 ? " thread" : " threads") << " per rank (training.threads), BLAS "
      << info.blas << "\n";
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
  void write(const StepMetrics& m) {
    if (file_.is_open()) file_ << metrics_json(m) << "\n" << std::flush;
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

std::string metrics_json(const StepMetrics& m) {
  nlohmann::ordered_json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
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
  return j.dump();
}

namespace {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainingOptions& t,
                                                        const std::vector<at::Tensor>& params) {
  if (t.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
  }
  PIPEMAT_CHECK(t.optimizer == "adamw", ConfigError, "training.optimizer: '", t.optimizer,
                "' is not allowed; allowed: sgd, adamw");
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
}

at::Tensor mse(const at::Tensor& output, const at::Tensor& target) {
  return (output - target).pow(2).mean();
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
        {"--stages", "schedule.stages"},
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
  s.stages = imported.schedule.ranks_count;
  s.micro_batches = imported.schedule.micro_batches;
  s.virtual_stages = imported.schedule.virtual_stages;
  out.actions = std::move(imported.schedule);
  out.note = std::move(imported.note);
  return out;
}

TrainResult train_on(const TrainConfig& given, comm::Transport& transport, std::ostream* progress,
                     const AfterStep& after_step) {
  remat::install_tracking_allocator();
  ResolvedSchedule resolved = resolve_schedule(given);
  check_schedule(resolved);
  const TrainConfig& config = resolved.config;
  pp::PipelineOptions options;
  options.schedule = config.schedule;
  options.actions = resolved.actions;
  options.remat = stage_policy(config.model, config.remat);
  options.loss = [](const pp::Tensors& out, const pp::Tensors& target) {
    return mse(out.at(0), target.at(0));
  };
  options.optimizer = [training = config.training](const std::vector<at::Tensor>& params) {
    return make_optimizer(training, params);
  };
  options.clip_grad_norm = config.training.clip_grad_norm;
  // Every rank builds all layers from the same seed, so the pipeline and the reference hold
  // bit-identical weights, and keeps those of its own stages.
  const auto layers = build_layers(config.model, config.training.seed);
  const auto bounds = partition_layers(layers, config.partition, pp::stage_count(options));
  pp::Pipeline pipeline(transport, options, [&](int s) {
    return pp::make_stage(s, Stage(std::vector<torch::nn::AnyModule>(
                                 layers.begin() + bounds[s], layers.begin() + bounds[s + 1])));
  });
  const pp::DataSource data = [&](int64_t step, int64_t micro_batch) {
    auto [input, target] = micro_batch_data(config.model, config.training.seed, step, micro_batch);
    return pp::MicroBatch{{input}, {target}};
  };
  TrainResult result;
  result.last_stage_rank = pipeline.is_last_stage_rank();
  const CheckpointOptions& ck = config.checkpoint;
  if (!ck.resume.empty()) {
    const std::string dir = ck.resume == "latest" ? pp::latest_checkpoint(ck.dir) : ck.resume;
    PIPEMAT_CHECK(!dir.empty(), ConfigError, "checkpoint.resume: latest: there is no complete "
                  "checkpoint under '", ck.dir, "' (checkpoint.dir)");
    pp::load_checkpoint(pipeline, transport, dir);
    if (result.last_stage_rank && progress && config.output.progress) {
      *progress << "resumed from " << dir << " after step " << pipeline.step() << "\n";
    }
  }
  MetricsFile metrics(result.last_stage_rank ? config.output.metrics : "", !ck.resume.empty());
  if (result.last_stage_rank && progress && config.output.progress) {
    print_compute(*progress, pipeline.schedule().ranks_count);
  }
  for (int64_t step = pipeline.step(); step < config.training.steps; ++step) {
    StepMetrics m = pipeline.train_step(data);
    if (result.last_stage_rank) {
      metrics.write(m);
      if (progress && config.output.progress) print_progress(*progress, config, m, true);
    }
    keep_step(result, std::move(m));
    const bool last = step + 1 == config.training.steps;
    if (!ck.dir.empty() && ((ck.every > 0 && (step + 1) % ck.every == 0) || last)) {
      const std::string dir =
          pp::save_checkpoint(pipeline, transport, ck.dir, static_cast<int>(ck.keep_last));
      if (result.last_stage_rank && progress && config.output.progress) {
        *progress << "checkpoint " << dir << "\n";
      }
    }
    if (after_step) after_step(step, transport);
  }
  if (result.last_stage_rank && !config.output.timeline_svg.empty() && !result.steps.empty()) {
    write_timeline_svg(config, pipeline.schedule(), result.last);
  }
  for (int s : pipeline.stages()) {
    for (const auto& item : pipeline.stage(s).module->named_parameters()) {
      // "layers.<local>.<rest>" -> "layers.<global>.<rest>"
      const std::string& key = item.key();
      const auto first = key.find('.'), second = key.find('.', first + 1);
      const int64_t local = std::stoll(key.substr(first + 1, second - first - 1));
      result.params.emplace_back("layers." + std::to_string(bounds[s] + local) + key.substr(second),
                                 item.value());
    }
  }
  return result;
}

std::vector<StepMetrics> run_reference(const TrainConfig& given,
                                       std::vector<std::pair<std::string, at::Tensor>>* params) {
  const TrainConfig config = resolve_schedule(given).config;
  auto layers = build_layers(config.model, config.training.seed);
  Stage model(layers);
  auto optimizer = make_optimizer(config.training, model->parameters());
  std::vector<StepMetrics> out;
  const int64_t M = config.schedule.micro_batches;
  for (int64_t step = 0; step < config.training.steps; ++step) {
    StepMetrics m;
    m.step = step;
    for (auto p : model->parameters()) p.mutable_grad().reset();
    remat::reset_peak_bytes();
    const int64_t bytes0 = remat::memory_stats().current_bytes;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < M; ++i) {
      auto [in, target] = micro_batch_data(config.model, config.training.seed, step, i);
      auto loss = micro_batch_loss(model->forward(in), target, M);
      m.loss += loss.item<double>();
      loss.backward();
    }
    if (config.training.clip_grad_norm > 0) {
      m.grad_norm =
          torch::nn::utils::clip_grad_norm_(model->parameters(), config.training.clip_grad_norm);
    }
    optimizer->step();
    m.step_ms = since_ms(t0);
    m.busy_ms = m.step_ms;
    m.peak_bytes = remat::memory_stats().peak_bytes - bytes0;
    out.push_back(std::move(m));
  }
  if (params) {
    params->clear();
    for (const auto& item : model->named_parameters())
      params->emplace_back(item.key(), item.value());
  }
  return out;
}

TrainResult train_in_process(const TrainConfig& config, std::ostream* progress,
                             const AfterStep& after_step) {
  const ResolvedSchedule resolved = resolve_schedule(config);
  const int ranks = resolved.config.schedule.stages;
  PIPEMAT_CHECK(ranks >= 1, ConfigError, "schedule.stages must be at least 1");
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
                  "(schedule.stages) or use transport.kind mpi / tcp");
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
  result.steps = run_reference(config, &result.params);
  MetricsFile metrics(config.output.metrics);
  for (const auto& m : result.steps) {
    metrics.write(m);
    if (progress && config.output.progress) print_progress(*progress, config, m, false);
  }
  return result;
}

int run_train(const TrainConfig& config, bool reference, std::ostream& out) {
  const ResolvedSchedule resolved = resolve_schedule(config);
  if (!resolved.note.empty()) out << resolved.note << "\n";
  // The ranks of this machine share its cores (all of them when they are threads here).
  int ranks_on_host = reference ? 1 : resolved.config.schedule.stages;
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) ranks_on_host = std::atoi(local);
  pp::set_compute_threads(config.training.threads > 0
                              ? static_cast<int>(config.training.threads)
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
