#include "train_report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/stats.h"
#include "pipemat/pp/compute.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/simulate.h"
#include "pipemat/train/launched_run.h"
#include "pipemat/train/train.h"

namespace pipemat::train {

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
  if (m.allreduce_ms > 0) {  // Note [Overlapped gradient all-reduce], this rank's
    n += std::snprintf(line + n, sizeof(line) - n, "  all-reduce %.1f ms (%.1f waited)",
                       m.allreduce_ms, m.allreduce_wait_ms);
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

void RunTotals::add(const StepMetrics& m) {
  step_ms.push_back(m.step_ms);
  data_ms.push_back(m.data_ms);
  const auto per_rank = [](const std::vector<int64_t>& ranks, int64_t mine) {
    return ranks.empty() ? std::vector<int64_t>{mine} : ranks;
  };
  rank_parameter_bytes = per_rank(m.rank_parameter_bytes, m.parameter_bytes);
  rank_gradient_bytes = per_rank(m.rank_gradient_bytes, m.gradient_bytes);
  rank_optimizer_state_bytes = per_rank(m.rank_optimizer_state_bytes, m.optimizer_state_bytes);
  std::vector<int64_t> held;
  if (m.rank_peak_bytes.size() == m.rank_start_bytes.size() && !m.rank_peak_bytes.empty()) {
    for (size_t r = 0; r < m.rank_peak_bytes.size(); ++r) {
      held.push_back(m.rank_start_bytes[r] + m.rank_peak_bytes[r]);
    }
  } else {
    held.push_back(m.start_bytes + m.peak_bytes);
  }
  if (rank_peak_bytes.size() != held.size()) rank_peak_bytes.assign(held.size(), 0);
  for (size_t r = 0; r < held.size(); ++r) {
    rank_peak_bytes[r] = std::max(rank_peak_bytes[r], held[r]);
  }
  const std::vector<int64_t> device = m.rank_device_peak_bytes.empty()
                                          ? std::vector<int64_t>{m.device_peak_bytes}
                                          : m.rank_device_peak_bytes;
  if (std::all_of(device.begin(), device.end(), [](int64_t b) { return b == 0; })) return;
  if (rank_device_peak_bytes.size() != device.size()) {
    rank_device_peak_bytes.assign(device.size(), 0);
  }
  for (size_t r = 0; r < device.size(); ++r) {
    rank_device_peak_bytes[r] = std::max(rank_device_peak_bytes[r], device[r]);
  }
}

namespace {

// "; device memory per rank A, B (CUDA caching allocator)" for a run on CUDA devices, else "".
std::string device_memory(const RunTotals& totals) {
  if (totals.rank_device_peak_bytes.empty()) return "";
  std::vector<std::string> peaks;
  for (int64_t b : totals.rank_device_peak_bytes) peaks.push_back(format_bytes(b));
  return "; device memory per rank " + join(peaks, ", ") + " (CUDA caching allocator)";
}

// "; per rank parameters A, B, gradients C, D, optimizer state E, F" (the latest step's; Note
// [Sharded optimizer]), or "" when no step reported any optimizer state.
std::string training_state(const RunTotals& totals) {
  const auto& state = totals.rank_optimizer_state_bytes;
  if (std::all_of(state.begin(), state.end(), [](int64_t b) { return b == 0; })) return "";
  const auto listed = [](const std::vector<int64_t>& bytes) {
    std::vector<std::string> each;
    for (int64_t b : bytes) each.push_back(format_bytes(b));
    return join(each, ", ");
  };
  return std::string(state.size() == 1 ? "; " : "; per rank ") + "parameters " +
         listed(totals.rank_parameter_bytes) + ", gradients " + listed(totals.rank_gradient_bytes) +
         ", optimizer state " + listed(state);
}

}  // namespace

void print_run_summary(std::ostream& out, const TrainConfig& c, const RunTotals& totals,
                       int64_t tokens_per_step, const std::optional<ReferenceFigures>& reference,
                       bool one_process) {
  if (totals.step_ms.empty()) return;
  const double steps = static_cast<double>(totals.step_ms.size());
  double total_ms = 0;
  for (double ms : totals.step_ms) total_ms += ms;
  const double tokens = steps * static_cast<double>(tokens_per_step);
  const double tokens_per_s = tokens * 1000.0 / total_ms;
  const double median_ms = median(totals.step_ms);
  int64_t max_peak = 0;
  std::vector<std::string> peaks;
  for (int64_t b : totals.rank_peak_bytes) {
    peaks.push_back(format_bytes(b));
    max_peak = std::max(max_peak, b);
  }
  // Ranks as threads share one allocator count: one figure, the process's.
  const bool per_rank = !one_process && peaks.size() > 1;
  const std::string memory =
      per_rank ? "peak memory per rank " + join(peaks, ", ")
               : ::pipemat::detail::concat("peak memory ", format_bytes(max_peak),
                                           one_process && c.schedule.ranks > 1
                                               ? " (the whole process: its ranks are threads)"
                                               : "");
  std::string line = ::pipemat::detail::concat(
      "summary: ", totals.step_ms.size(), " steps, ", format_count(tokens), " tokens in ",
      format_duration(total_ms / 1000.0), " of steps: ", format_count(tokens_per_s),
      " tokens/s (median step ", format_fixed(median_ms, 1), " ms) on ",
      c.parallel.data > 1
          ? ::pipemat::detail::concat(c.parallel.data * c.schedule.ranks, " ranks (",
                                      c.parallel.data, " replicas of ", c.schedule.ranks,
                                      c.schedule.ranks == 1 ? " rank; " : " ranks; ",
                                      "the memory is replica 0's)")
          : ::pipemat::detail::concat(c.schedule.ranks, c.schedule.ranks == 1 ? " rank" : " ranks"),
      "; ", memory, " (tensors: weights, gradients, optimizer state, activations)",
      device_memory(totals), training_state(totals), "\n");
  if (!totals.data_ms.empty() && median_ms > 0) {  // what reading the micro-batches costs
    const double data = median(totals.data_ms);
    line += ::pipemat::detail::concat(
        "data: ", format_fixed(data, 3), " ms per step in the data source (median), ",
        format_fixed(100.0 * data / median_ms, 3), " % of the median step\n");
  }
  if (!totals.trace_ms.empty() && median_ms > 0) {  // what output.trace costs
    const double trace = median(totals.trace_ms);
    line += ::pipemat::detail::concat(
        "trace: ", format_fixed(trace, 3), " ms per step to make and write its events (median), ",
        format_fixed(100.0 * trace / median_ms, 3), " % of the median step\n");
  }
  if (reference) {
    const ReferenceFigures& r = *reference;
    const double ref_tokens_per_s = static_cast<double>(tokens_per_step) * 1000.0 / r.step_ms;
    line += ::pipemat::detail::concat(
        "single process (the same model and data chained in one process, ", r.threads,
        r.threads == 1 ? " thread" : " threads", r.choice ? describe_thread_choice(*r.choice) : "",
        "; median of steps ", r.steps - r.measured_steps + 1, "-", r.steps, " of ", r.steps,
        " run after training): ", format_count(ref_tokens_per_s), " tokens/s (",
        format_fixed(r.step_ms, 1), " ms per step), peak memory ", format_bytes(r.peak_bytes),
        "; the pipeline: ", format_fixed(tokens_per_s / ref_tokens_per_s, 2), "x the tokens/s, ",
        format_fixed(static_cast<double>(max_peak) / static_cast<double>(r.peak_bytes), 2),
        "x the peak memory", per_rank ? " on its largest rank" : "", "\n");
  }
  out << line << std::flush;  // one write: ranks started as local processes share the terminal
}

void print_validation(std::ostream& out, int64_t step, double loss, double tokens_per_byte) {
  char line[200];
  const double bits = 1 / std::log(2.0);
  if (tokens_per_byte == 1) {  // bytes are the tokens
    std::snprintf(line, sizeof(line),
                  "validation after step %lld: loss %.4f nats/byte (%.3f bits)\n",
                  static_cast<long long>(step + 1), loss, loss * bits);
  } else if (tokens_per_byte > 0) {
    const double per_byte = loss * tokens_per_byte;
    std::snprintf(line, sizeof(line),
                  "validation after step %lld: loss %.4f nats/token (%.3f bits), %.4f nats/byte "
                  "(%.3f bits)\n",
                  static_cast<long long>(step + 1), loss, loss * bits, per_byte, per_byte * bits);
  } else {
    std::snprintf(line, sizeof(line),
                  "validation after step %lld: loss %.4f nats/token (%.3f bits)\n",
                  static_cast<long long>(step + 1), loss, loss * bits);
  }
  out << line << std::flush;
}

std::string describe_thread_choice(const pp::ThreadChoice& c) {
  if (!c.probed) return "";
  return ::pipemat::detail::concat(
      "; ", c.asked, " asked, measured first: one micro-batch's forward and backward took ",
      format_fixed(c.one_ms, 1), " ms on 1 thread and ", format_fixed(c.asked_ms, 1), " ms on ",
      c.asked, " (medians of ", c.rounds, " rounds, OMP_WAIT_POLICY ",
      c.wait_policy.empty() ? std::string("unset") : c.wait_policy, "), the faster kept");
}

void print_compute(std::ostream& out, int ranks, const ComputePlace& place) {
  const pp::ComputeInfo info = pp::compute_info();
  out << "compute: " << ranks << (ranks == 1 ? " rank" : " ranks")
      << (place.transport.empty() ? "" : " over " + place.transport) << " on " << place.device
      << " in " << pp::to_string(place.precision) << ", " << info.threads
      << (info.threads == 1 ? " thread" : " threads") << " per rank (training.threads"
      << (info.choice ? describe_thread_choice(*info.choice) : "") << "), LibTorch "
      << info.torch_version << ", BLAS " << info.blas;
  if (info.blas_threads >= 0) {
    out << " (" << info.blas_threads << (info.blas_threads == 1 ? " thread)" : " threads)");
  }
  out << (info.freed_memory_retained ? "; freed memory kept for reuse" : "") << "\n" << std::flush;
}

std::string place_of_device(const c10::Device& device, const std::string& spelled) {
  const std::string name = device.str();
  return name == spelled ? name : name + " (training.device: " + spelled + ")";
}

MetricsFile::MetricsFile(const std::string& path, bool append) : path_(path) {
  if (path.empty()) return;
  open_output(file_, "output.metrics", path, append ? std::ios::app : std::ios::trunc);
}

void MetricsFile::write(const StepMetrics& m, std::optional<double> validation) {
  if (!file_.is_open()) return;
  file_ << metrics_json(m, validation) << "\n" << std::flush;
  PIPEMAT_CHECK(file_.good(), ConfigError, "output.metrics: cannot write '", path_,
                "': ", std::strerror(errno));
}

TraceFile::TraceFile(const std::string& path, const schedule::Schedule& plan, int replicas)
    : path_(path), trace_(plan, replicas) {
  if (path.empty()) return;
  open_output(file_, "output.trace", path, std::ios::trunc);
  put(trace_.begin());
}

TraceFile::~TraceFile() {
  if (!file_.is_open()) return;
  file_ << pp::ChromeTrace::end();  // a failure here leaves a file that ends at its last step
}

void TraceFile::put(const std::string& text) {
  file_ << text << std::flush;
  PIPEMAT_CHECK(file_.good(), ConfigError, "output.trace: cannot write '", path_,
                "': ", std::strerror(errno));
}

void TraceFile::step(const StepMetrics& m) {
  if (file_.is_open()) put(trace_.step(m));
}

void TraceFile::span(const std::string& name, int rank, double start_us, double end_us,
                     int64_t step) {
  if (file_.is_open()) put(trace_.span(name, rank, start_us, end_us, step));
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
  j["data_ms"] = m.data_ms;
  if (m.allreduce_ms > 0) {
    j["allreduce_ms"] = m.allreduce_ms;
    j["allreduce_wait_ms"] = m.allreduce_wait_ms;
  }
  j["peak_bytes"] = m.peak_bytes;
  j["max_rank_peak_bytes"] = m.max_rank_peak_bytes;
  j["start_bytes"] = m.start_bytes;
  j["resident_peak_bytes"] = m.resident_peak_bytes;
  if (!m.rank_peak_bytes.empty()) {
    j["rank_peak_bytes"] = m.rank_peak_bytes;
    j["rank_start_bytes"] = m.rank_start_bytes;
    j["rank_resident_peak_bytes"] = m.rank_resident_peak_bytes;
  }
  j["optimizer_state_bytes"] = m.optimizer_state_bytes;
  if (!m.rank_optimizer_state_bytes.empty())
    j["rank_optimizer_state_bytes"] = m.rank_optimizer_state_bytes;
  j["parameter_bytes"] = m.parameter_bytes;
  j["gradient_bytes"] = m.gradient_bytes;
  if (!m.rank_parameter_bytes.empty()) {
    j["rank_parameter_bytes"] = m.rank_parameter_bytes;
    j["rank_gradient_bytes"] = m.rank_gradient_bytes;
  }
  if (m.gather_ms > 0) j["gather_ms"] = m.gather_ms;
  const bool on_device =
      m.device_peak_bytes > 0 ||
      std::any_of(m.rank_device_peak_bytes.begin(), m.rank_device_peak_bytes.end(),
                  [](int64_t bytes) { return bytes > 0; });
  if (on_device) {  // a CUDA run's
    j["device_peak_bytes"] = m.device_peak_bytes;
    if (!m.rank_device_peak_bytes.empty()) j["rank_device_peak_bytes"] = m.rank_device_peak_bytes;
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

void open_output(std::ofstream& file, const char* key, const std::string& path,
                 std::ios::openmode mode) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  PIPEMAT_CHECK(!ec, ConfigError, key, ": cannot create the directory '", parent.string(), "' of '",
                path, "': ", ec.message());
  errno = 0;
  file.open(path, mode);
  PIPEMAT_CHECK(file.good(), ConfigError, key, ": cannot write '", path, "'",
                errno != 0 ? std::string(": ") + std::strerror(errno) : std::string());
}

namespace {

// Writes `text` to the output file `path` of config key `key`, whole or with an error.
void write_output(const char* key, const std::string& path, const std::string& text) {
  std::ofstream file;
  open_output(file, key, path, std::ios::trunc);
  file << text;
  file.flush();
  PIPEMAT_CHECK(file.good(), ConfigError, key, ": cannot write '", path,
                "': ", std::strerror(errno));
}

}  // namespace

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
  // Note [Overlapped gradient all-reduce]: each rank's exchange under its actions.
  measured_options.rank_spans = m.rank_allreduce_ms;
  measured_options.span_label =
      "gradient all-reduce of the data group, first message to last sum (replica 0's ranks)";
  write_output("output.timeline_svg", config.output.timeline_svg,
               schedule::render_svg(plan, m.measured, measured_options));
  // Next to it: the simulator's prediction for the same schedule with the measured costs.
  schedule::RenderOptions predicted_options;
  predicted_options.costs_label = "simulated with the measured mean costs (ms)";
  write_output(
      "output.timeline_svg", predicted_svg_path(config.output.timeline_svg),
      schedule::render_svg(plan, schedule::simulate(plan, m.measured_costs), predicted_options));
}

void write_loss_svg(const std::string& path, const std::vector<LossPoint>& train,
                    const std::vector<LossPoint>& validation, const std::string& title) {
  write_output("output.loss_svg", path, render_loss_svg(train, validation, title));
}

void print_checkpoint_run(std::ostream& out, const TrainConfig& config,
                          const RunCheckpoints& checkpoints) {
  if (!checkpoints.overwritten.empty()) {
    out << "checkpoint.overwrite: removed " << checkpoints.overwritten.size() << " step director"
        << (checkpoints.overwritten.size() == 1 ? "y" : "ies") << " from " << config.checkpoint.dir
        << "\n";
  }
  out << "checkpoints: " << config.checkpoint.dir << ", run " << checkpoints.run.id.substr(0, 12);
  if (checkpoints.continued) {
    out << " (continued)";
  } else if (!checkpoints.resume_dir.empty()) {
    out << " (new: " << checkpoints.resume_dir
        << " was written before checkpoints named their run)";
  } else {
    out << " (new)";
  }
  out << "\n";
}

}  // namespace pipemat::train
