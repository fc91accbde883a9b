#include "pipemat/pp/train.h"

#include <cstdio>
#include <exception>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/remat/memory.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::pp {
namespace {

void print_progress(std::ostream& out, const TrainConfig& c, const StepMetrics& m, bool pipeline) {
  char line[320];
  if (pipeline) {
    std::snprintf(line, sizeof(line),
                  "step %lld/%lld  loss %.6f  %.1f ms  bubble %.3f (simulated %.3f)  peak %s  "
                  "remat: units %lld replays %lld early-stops %lld save %lld skipped %lld\n",
                  static_cast<long long>(m.step + 1), static_cast<long long>(c.training.steps),
                  m.loss, m.step_ms, m.bubble, m.simulated_bubble,
                  format_bytes(m.peak_bytes).c_str(),
                  static_cast<long long>(m.remat.unit_calls),
                  static_cast<long long>(m.remat.replays),
                  static_cast<long long>(m.remat.early_stops),
                  static_cast<long long>(m.remat.save_calls),
                  static_cast<long long>(m.remat.save_skips));
  } else {
    std::snprintf(line, sizeof(line), "step %lld/%lld  loss %.6f  %.1f ms  peak %s  (reference)\n",
                  static_cast<long long>(m.step + 1), static_cast<long long>(c.training.steps),
                  m.loss, m.step_ms, format_bytes(m.peak_bytes).c_str());
  }
  out << line << std::flush;
}

class MetricsFile {
 public:
  explicit MetricsFile(const std::string& path) {
    if (path.empty()) return;
    file_.open(path);
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
  j["simulated_bubble"] = m.simulated_bubble;
  j["peak_bytes"] = m.peak_bytes;
  j["replays"] = m.remat.replays;
  j["early_stops"] = m.remat.early_stops;
  j["save_calls"] = m.remat.save_calls;
  j["save_skips"] = m.remat.save_skips;
  return j.dump();
}

TrainResult train_on(const TrainConfig& config, comm::Transport& transport,
                     std::ostream* progress) {
  remat::install_tracking_allocator();
  PipelineRuntime runtime(config, transport);
  TrainResult result;
  result.last_stage_rank = runtime.is_last_stage_rank();
  MetricsFile metrics(result.last_stage_rank ? config.output.metrics : "");
  for (int64_t step = 0; step < config.training.steps; ++step) {
    StepMetrics m = runtime.run_step(step);
    if (result.last_stage_rank) {
      metrics.write(m);
      if (progress && config.output.progress) print_progress(*progress, config, m, true);
    }
    result.steps.push_back(std::move(m));
  }
  if (result.last_stage_rank && !config.output.timeline_svg.empty() && !result.steps.empty()) {
    write_timeline_svg(config, runtime.schedule(), result.steps.back());
  }
  result.params = runtime.named_parameters();
  return result;
}

TrainResult train_in_process(const TrainConfig& config, std::ostream* progress) {
  const int ranks = config.schedule.stages;
  PIPEMAT_CHECK(ranks >= 1, ConfigError, "schedule.stages must be at least 1");
  comm::TransportOptions options = config.transport;
  options.kind = comm::TransportKind::kLocal;
  auto transports = comm::make_local_transports(ranks, options);
  std::vector<TrainResult> results(ranks);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        results[r] = train_on(config, *transports[r], progress);
      } catch (...) {
        errors[r] = std::current_exception();
      }
      transports[r].reset();  // peers waiting on this rank fail fast
    });
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
      merged.last_stage_rank = true;
    }
    merged.params.insert(merged.params.end(), r.params.begin(), r.params.end());
  }
  return merged;
}

TrainResult train_reference(const TrainConfig& config, std::ostream* progress) {
  remat::install_tracking_allocator();
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

}  // namespace pipemat::pp
