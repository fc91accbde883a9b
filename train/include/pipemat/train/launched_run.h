#pragma once
// What the benchmarks and the plan calibration share, which run whole trainings: running a
// config as a multi-process job through `pipemat-run` (mpi or tcp) and reading back the metrics
// file of its last stage's rank.

#include <cstdint>
#include <string>
#include <vector>

#include "pipemat/pp/pipeline.h"
#include "pipemat/train/options.h"

namespace pipemat::train {

// pipemat-run next to the running binary (/proc/self/exe). `who` names the command in errors.
std::string default_launcher(const std::string& who);

// A file in /tmp named after `pattern` ("pipemat-bench-XXXXXX.log": XXXXXX and the suffix as
// mkstemps takes them); removed by the destructor unless `keep`.
class TempFile {
 public:
  TempFile(const std::string& pattern, const std::string& who, bool keep = false);
  ~TempFile();
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool keep_;
};

// Writes `config` as YAML to `path` (a TempFile's); ConfigError naming `who` when it cannot.
void write_config_file(const TrainConfig& config, const std::string& path, const std::string& who);

// Runs argv with stdout and stderr appended to `log`; returns the exit status (or -1).
int run_process(const std::vector<std::string>& args, const std::string& log,
                const std::string& who);

// The step metrics of a metrics file (output.metrics), in file order.
std::vector<pp::StepMetrics> read_metrics(const std::string& path);

// The --set overrides of a run that measures steps: the config's checkpoints, evaluations,
// sample, output files and the summary's single process left out, so that nothing is written
// into its run directory and one run's checkpoint never stops the next run.
std::vector<std::string> measured_run_overrides();

struct LaunchedRun {
  std::string launcher;                // pipemat-run
  int ranks = 1;                       // -n
  std::string transport = "tcp";       // "mpi" or "tcp"
  std::string config;                  // YAML file every rank reads
  std::vector<std::string> overrides;  // --set k=v
  std::string log;                     // the ranks' output is appended here
};

// Starts the job, waits for it and returns its metrics. PipelineError naming `what` and the log
// when it fails or writes other than `steps` steps.
std::vector<pp::StepMetrics> run_launched(const LaunchedRun& run, int64_t steps,
                                          const std::string& what);

}  // namespace pipemat::train
