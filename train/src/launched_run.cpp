#include "pipemat/train/launched_run.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/train/config.h"

extern char** environ;

namespace pipemat::train {

std::vector<std::string> measured_run_overrides() {
  return {"checkpoint.dir=", "sample.tokens=0",         "training.eval_every=0",
          "output.metrics=", "output.loss_svg=",        "output.timeline_svg=",
          "output.trace=",   "output.reference_steps=0"};
}

std::string default_launcher(const std::string& who) {
  std::vector<char> path(4096);
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  PIPEMAT_CHECK(n > 0, ConfigError, who,
                ": cannot find the running binary (/proc/self/exe); pass --launcher with the path "
                "of pipemat-run");
  std::string exe(path.data(), static_cast<size_t>(n));
  return exe.substr(0, exe.rfind('/') + 1) + "pipemat-run";
}

TempFile::TempFile(const std::string& pattern, const std::string& who, bool keep) : keep_(keep) {
  std::string name = "/tmp/" + pattern;
  const size_t x = name.find("XXXXXX");
  PIPEMAT_CHECK(x != std::string::npos, InternalError, "TempFile: no XXXXXX in ", pattern);
  const int suffix = static_cast<int>(name.size() - (x + 6));
  const int fd = ::mkstemps(name.data(), suffix);
  PIPEMAT_CHECK(fd >= 0, ConfigError, who, ": cannot create a file in /tmp (", pattern,
                "): ", std::strerror(errno));
  ::close(fd);
  path_ = name;
}

TempFile::~TempFile() {
  if (!keep_) std::remove(path_.c_str());
}

void write_config_file(const TrainConfig& config, const std::string& path, const std::string& who) {
  std::ofstream file(path);
  file << config_to_yaml(config);
  PIPEMAT_CHECK(file.good(), ConfigError, who, ": cannot write ", path);
}

int run_process(const std::vector<std::string>& args, const std::string& log,
                const std::string& who) {
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
  PIPEMAT_CHECK(rc == 0, ConfigError, who, ": cannot start ", args[0], ": ", std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<pp::StepMetrics> read_metrics(const std::string& path) {
  std::istringstream in(read_regular_file(path, "output.metrics"));
  std::vector<pp::StepMetrics> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    pp::StepMetrics m;
    m.step = j.value("step", int64_t{0});
    m.loss = j.value("loss", 0.0);
    m.step_ms = j.value("step_ms", 0.0);
    m.bubble = j.value("bubble", 0.0);
    m.measured.bubble_ratio = j.value("schedule_bubble", 0.0);
    m.simulated_bubble = j.value("simulated_bubble", 0.0);
    m.simulated_bubble_comm = j.value("simulated_bubble_comm", 0.0);
    m.message_delay_ms = j.value("message_delay_ms", 0.0);
    m.recv_wait_ms = j.value("recv_wait_ms", 0.0);
    m.data_ms = j.value("data_ms", 0.0);
    m.allreduce_ms = j.value("allreduce_ms", 0.0);
    m.allreduce_wait_ms = j.value("allreduce_wait_ms", 0.0);
    m.peak_bytes = j.value("peak_bytes", int64_t{0});
    m.max_rank_peak_bytes = j.value("max_rank_peak_bytes", int64_t{0});
    m.start_bytes = j.value("start_bytes", int64_t{0});
    m.resident_peak_bytes = j.value("resident_peak_bytes", int64_t{0});
    m.rank_peak_bytes = j.value("rank_peak_bytes", std::vector<int64_t>{});
    m.rank_start_bytes = j.value("rank_start_bytes", std::vector<int64_t>{});
    m.rank_resident_peak_bytes = j.value("rank_resident_peak_bytes", std::vector<int64_t>{});
    m.optimizer_state_bytes = j.value("optimizer_state_bytes", int64_t{0});
    m.rank_optimizer_state_bytes = j.value("rank_optimizer_state_bytes", std::vector<int64_t>{});
    m.parameter_bytes = j.value("parameter_bytes", int64_t{0});
    m.gradient_bytes = j.value("gradient_bytes", int64_t{0});
    m.rank_parameter_bytes = j.value("rank_parameter_bytes", std::vector<int64_t>{});
    m.rank_gradient_bytes = j.value("rank_gradient_bytes", std::vector<int64_t>{});
    m.gather_ms = j.value("gather_ms", 0.0);
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

std::vector<pp::StepMetrics> run_launched(const LaunchedRun& run, int64_t steps,
                                          const std::string& what) {
  const TempFile metrics("pipemat-bench-metrics-XXXXXX.jsonl", what);
  std::vector<std::string> args = {run.launcher, "-n", std::to_string(run.ranks), run.config};
  if (run.transport == "tcp") args.push_back("--tcp");
  args.push_back("--");
  for (const auto& s : run.overrides) {
    args.push_back("--set");
    args.push_back(s);
  }
  args.push_back("--set");
  args.push_back("output.progress=false");
  args.push_back("--metrics");
  args.push_back(metrics.path());
  const int status = run_process(args, run.log, what);
  std::vector<pp::StepMetrics> out = read_metrics(metrics.path());
  PIPEMAT_CHECK(status == 0 && static_cast<int64_t>(out.size()) == steps, PipelineError, what,
                " failed (exit ", status, ", ", out.size(), " of ", steps,
                " steps); its output is in ", run.log);
  return out;
}

}  // namespace pipemat::train
