#include "train_report.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/models/train.h"
#include "pipemat/pp/compute.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::models {

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

MetricsFile::MetricsFile(const std::string& path, bool append) {
  if (path.empty()) return;
  file_.open(path, append ? std::ios::app : std::ios::trunc);
  PIPEMAT_CHECK(file_.good(), ConfigError, "output.metrics: cannot write '", path, "'");
}

void MetricsFile::write(const StepMetrics& m, std::optional<double> validation) {
  if (file_.is_open()) file_ << metrics_json(m, validation) << "\n" << std::flush;
}

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
  j["start_bytes"] = m.start_bytes;
  if (!m.rank_peak_bytes.empty()) {
    j["rank_peak_bytes"] = m.rank_peak_bytes;
    j["rank_start_bytes"] = m.rank_start_bytes;
  }
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

void make_parent(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
}

namespace {

// "run.svg" -> "run.predicted.svg".
std::string predicted_svg_path(const std::string& path) {
  const auto dot = path.rfind('.');
  const auto slash = path.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return path + ".predicted.svg";
  }
  return path.substr(0, dot) + ".predicted" + path.substr(dot);
}

}  // namespace

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

void write_loss_svg(const std::string& path, const std::vector<LossPoint>& train,
                    const std::vector<LossPoint>& validation, const std::string& title) {
  make_parent(path);
  std::ofstream file(path);
  PIPEMAT_CHECK(file.good(), ConfigError, "output.loss_svg: cannot write '", path, "'");
  file << render_loss_svg(train, validation, title);
}

}  // namespace pipemat::models
