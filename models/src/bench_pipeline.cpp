#include "pipemat/models/bench_pipeline.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/models/config.h"
#include "pipemat/models/train.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/memory.h"

extern char** environ;

namespace pipemat::models {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The medians of the steps after warm-up; losses compared with the reference's, bitwise.
// `layers_per_stage` > 0: also the per-layer costs (BenchPipelineRow::layer_costs), with I and W
// when the schedule splits the backward.
BenchPipelineRow summarize(const std::vector<StepMetrics>& steps, int64_t warmup,
                           const std::vector<double>& reference_losses, double layers_per_stage = 0,
                           bool split_backward = false) {
  BenchPipelineRow row;
  std::vector<double> step_ms, bubble, schedule_bubble, sim, sim_comm, delay, wait;
  std::vector<double> f, b, i_cost, w, r;
  for (const StepMetrics& m : steps) {
    const auto i = static_cast<size_t>(m.step);
    if (!reference_losses.empty() &&
        (i >= reference_losses.size() || reference_losses[i] != m.loss)) {
      row.losses_equal = false;
    }
    row.peak_bytes = std::max({row.peak_bytes, m.peak_bytes, m.max_rank_peak_bytes});
    if (m.step < warmup) continue;
    step_ms.push_back(m.step_ms);
    bubble.push_back(m.bubble);
    schedule_bubble.push_back(m.measured.bubble_ratio);
    sim.push_back(m.simulated_bubble);
    sim_comm.push_back(m.simulated_bubble_comm);
    delay.push_back(m.message_delay_ms);
    wait.push_back(m.recv_wait_ms);
    f.push_back(m.measured_costs.forward);
    b.push_back(m.measured_costs.backward_cost());
    i_cost.push_back(m.measured_costs.backward_input);
    w.push_back(m.measured_costs.backward_weight);
    r.push_back(m.measured_costs.recompute.value_or(0.0));
  }
  row.step_ms = median(step_ms);
  row.bubble = median(bubble);
  row.schedule_bubble = median(schedule_bubble);
  row.simulated_bubble = median(sim);
  row.simulated_bubble_comm = median(sim_comm);
  row.message_delay_ms = median(delay);
  row.recv_wait_ms = median(wait);
  if (layers_per_stage > 0) {
    // What the schedule measured: I and W with split backward, else B.
    const auto num = [](double v) {
      std::ostringstream os;
      os << v;
      return os.str();
    };
    const auto per_layer = [&](std::vector<double>& v) {
      return num(median(v) / layers_per_stage);
    };
    row.layer_costs =
        "F=" + per_layer(f) +
        (split_backward ? ",I=" + per_layer(i_cost) + ",W=" + per_layer(w) : ",B=" + per_layer(b)) +
        ",R=" + per_layer(r) + ",comm=" + num(row.message_delay_ms);
  }
  return row;
}

std::string default_launcher() {
  std::vector<char> path(4096);
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  PIPEMAT_CHECK(n > 0, ConfigError,
                "bench pipeline: cannot find the running binary (/proc/self/exe); pass --launcher "
                "with the path of pipemat-run");
  std::string exe(path.data(), static_cast<size_t>(n));
  return exe.substr(0, exe.rfind('/') + 1) + "pipemat-run";
}

// Runs argv with stdout and stderr appended to `log`; returns the exit status (or -1).
int run_process(const std::vector<std::string>& args, const std::string& log) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  PIPEMAT_CHECK(rc == 0, ConfigError, "bench pipeline: cannot start ", args[0], ": ",
                std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<StepMetrics> read_metrics(const std::string& path) {
  std::ifstream in(path);
  std::vector<StepMetrics> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    StepMetrics m;
    m.step = j.value("step", int64_t{0});
    m.loss = j.value("loss", 0.0);
    m.step_ms = j.value("step_ms", 0.0);
    m.bubble = j.value("bubble", 0.0);
    m.measured.bubble_ratio = j.value("schedule_bubble", 0.0);
    m.simulated_bubble = j.value("simulated_bubble", 0.0);
    m.simulated_bubble_comm = j.value("simulated_bubble_comm", 0.0);
    m.message_delay_ms = j.value("message_delay_ms", 0.0);
    m.recv_wait_ms = j.value("recv_wait_ms", 0.0);
    m.peak_bytes = j.value("peak_bytes", int64_t{0});
    m.max_rank_peak_bytes = j.value("max_rank_peak_bytes", int64_t{0});
    if (j.contains("costs") && j["costs"].is_object()) {
      const auto& c = j["costs"];
      m.measured_costs.forward = c.value("F", 0.0);
      m.measured_costs.backward = c.value("B", 0.0);
      m.measured_costs.backward_input = c.value("I", 0.0);
      m.measured_costs.backward_weight = c.value("W", 0.0);
      m.measured_costs.recompute = c.value("R", 0.0);
    }
    out.push_back(m);
  }
  return out;
}

}  // namespace

std::vector<BenchPipelineRow> run_bench_pipeline(
    const BenchPipelineOptions& o, const std::function<void(const BenchPipelineRow&)>& on_row) {
  PIPEMAT_CHECK(o.warmup >= 0 && o.steps > o.warmup, ConfigError, "bench pipeline: --steps ",
                o.steps, " must be more than --warmup ", o.warmup);
  PIPEMAT_CHECK(!o.schedules.empty() && !o.transports.empty(), ConfigError,
                "bench pipeline: give at least one schedule and one transport");
  for (const auto& t : o.transports) {
    PIPEMAT_CHECK(t == "mpi" || t == "tcp" || t == "local", ConfigError,
                  "bench pipeline: --transports: '", t, "'; expected mpi, tcp or local");
  }
  std::vector<std::string> common = o.overrides;
  common.push_back("training.steps=" + std::to_string(o.steps));
  TrainConfig base = load_config(o.config, common);
  // Every variant's config, valid before anything runs.
  std::map<std::string, TrainConfig> variant;
  for (const auto& s : o.schedules) {
    std::vector<std::string> with_kind = common;
    with_kind.push_back("schedule.kind=" + s);
    variant.emplace(s, load_config(o.config, with_kind));
  }
  const int ranks = static_cast<int>(base.schedule.ranks);
  std::vector<BenchPipelineRow> rows;
  const auto add = [&](BenchPipelineRow row) {
    if (on_row) on_row(row);
    rows.push_back(std::move(row));
  };

  remat::install_tracking_allocator();  // peak bytes of the in-process runs
  // The reference with the pipeline ranks' threads (the oracle of the losses: the same
  // kernels and reduction orders), then with 1 thread and with the default threads of one rank
  // on this host where those differ: the faster reference is what a speedup is counted from.
  const int rank_threads = base.training.threads > 0 ? static_cast<int>(base.training.threads)
                                                     : pp::default_compute_threads(ranks);
  const int one_rank = base.training.threads > 0 ? static_cast<int>(base.training.threads)
                                                 : pp::default_compute_threads(1);
  std::vector<int> reference_threads = {rank_threads};
  for (int t : {1, one_rank}) {
    if (std::find(reference_threads.begin(), reference_threads.end(), t) ==
        reference_threads.end()) {
      reference_threads.push_back(t);
    }
  }
  std::vector<double> losses;
  double best_reference = 0;
  std::vector<BenchPipelineRow> references;
  for (int threads : reference_threads) {
    pp::set_compute_threads(threads);
    const auto steps = run_reference(base, nullptr);
    if (losses.empty()) {
      for (const auto& m : steps) losses.push_back(m.loss);
    }
    BenchPipelineRow row = summarize(steps, o.warmup, losses);
    row.schedule = "-";
    row.transport = "reference";
    row.threads = threads;
    row.losses_compared = threads == rank_threads;
    best_reference = best_reference == 0 ? row.step_ms : std::min(best_reference, row.step_ms);
    references.push_back(row);
  }
  for (auto& row : references) {
    row.speedup = best_reference / row.step_ms;
    add(row);
  }

  const std::string launcher = o.launcher.empty() ? default_launcher() : o.launcher;
  char temp_log[] = "/tmp/pipemat-bench-pipeline-XXXXXX.log";
  std::string log = o.log;
  if (log.empty()) {
    const int fd = ::mkstemps(temp_log, 4);
    PIPEMAT_CHECK(fd >= 0, ConfigError, "bench pipeline: cannot create a log file in /tmp");
    ::close(fd);
    log = temp_log;
  }
  for (const auto& schedule : o.schedules) {
    for (const auto& transport : o.transports) {
      std::vector<StepMetrics> steps;
      std::vector<std::string> sets = common;
      sets.push_back("schedule.kind=" + schedule);
      if (transport == "local") {
        TrainConfig config = variant.at(schedule);
        config.transport.kind = comm::TransportKind::kLocal;
        config.output = OutputOptions{};
        config.output.progress = false;
        pp::set_compute_threads(rank_threads);
        steps = train_in_process(config, nullptr).steps;
      } else {
        char metrics[] = "/tmp/pipemat-bench-metrics-XXXXXX.jsonl";
        const int fd = ::mkstemps(metrics, 6);
        PIPEMAT_CHECK(fd >= 0, ConfigError, "bench pipeline: cannot create a metrics file in /tmp");
        ::close(fd);
        std::vector<std::string> args = {launcher, "-n", std::to_string(ranks), o.config};
        if (transport == "tcp") args.push_back("--tcp");
        args.push_back("--");
        for (const auto& s : sets) {
          args.push_back("--set");
          args.push_back(s);
        }
        args.push_back("--set");
        args.push_back("output.progress=false");
        args.push_back("--metrics");
        args.push_back(metrics);
        const int status = run_process(args, log);
        steps = read_metrics(metrics);
        std::remove(metrics);
        PIPEMAT_CHECK(status == 0 && static_cast<int64_t>(steps.size()) == o.steps, PipelineError,
                      "bench pipeline: the ", schedule, " run over ", transport, " failed (exit ",
                      status, ", ", steps.size(), " of ", o.steps, " steps); its output is in ",
                      log);
      }
      const TrainConfig& config = variant.at(schedule);
      pp::PipelineOptions shape;
      shape.schedule = config.schedule;
      using Kind = pipemat::schedule::ScheduleKind;
      const bool split = config.schedule.kind == Kind::kZeroBubbleH1 ||
                         config.schedule.kind == Kind::kZeroBubbleH2 ||
                         config.schedule.kind == Kind::kZeroBubbleV;
      BenchPipelineRow row =
          summarize(steps, o.warmup, losses,
                    static_cast<double>(config.model.layers) / pp::stage_count(shape), split);
      row.schedule = schedule;
      row.transport = transport;
      row.threads = rank_threads;
      row.speedup = best_reference / row.step_ms;
      add(row);
    }
  }
  if (o.log.empty()) std::remove(log.c_str());
  return rows;
}

}  // namespace pipemat::models
