#pragma once
// What a training run reports (private to train): the progress lines of `pipemat train` and its
// output files (output.metrics, output.timeline_svg, output.loss_svg). The drivers in train.cpp
// and train_reference.cpp decide when; this file decides how it reads. metrics_json (one step's
// JSON line) is public, in pipemat/train/train.h.

#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "pipemat/pp/compute.h"
#include "pipemat/pp/device.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/pp/trace.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/train/loss_curve.h"
#include "pipemat/train/options.h"
#include "pipemat/train/train.h"
#include "train_checkpoints.h"

namespace pipemat::train {

// Elapsed time and steps of this process's run, for tokens/s and the ETA.
struct Pace {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  int64_t first_step = 0;  // the step this process started at (resume: not 0)
  int64_t tokens_per_step = 0;
};

// One progress line of step `m`: loss, tokens/s, step time, peak bytes, percent and ETA; with
// `pipeline` also the bubbles and the remat counters, without it "(reference)".
void print_progress(std::ostream& out, const TrainConfig& c, const pp::StepMetrics& m,
                    bool pipeline, const Pace& pace);

// The run summary after the last step: tokens/s, step time and peak memory per rank over the
// whole run, and with `reference` the single process's figures and the ratios. `one_process`:
// the ranks ran as threads of this process, whose tracking allocator counts them all together.
void print_run_summary(std::ostream& out, const TrainConfig& c, const RunTotals& totals,
                       int64_t tokens_per_step, const std::optional<ReferenceFigures>& reference,
                       bool one_process);

// "validation after step N: loss L nats/byte (B bits)" when the tokens are bytes
// (`tokens_per_byte` 1); else the loss per token and, when `tokens_per_byte` > 0, per byte of the
// text ("loss L nats/token (B bits), P nats/byte (Q bits)"), so runs with other tokenizers compare.
void print_validation(std::ostream& out, int64_t step, double loss, double tokens_per_byte);

// Where the first progress line says the ranks run: "over tcp" (empty for one process without a
// transport) and the talking rank's device ("cpu", "cuda:1 (training.device: cuda)").
struct ComputePlace {
  std::string transport;
  std::string device;
  pp::Precision precision = pp::Precision::kFloat32;  // training.precision
};

// The first progress line: the ranks, their transport and device, which BLAS runs the GEMMs and
// with how many threads, and how they were chosen when they were measured (pp::ThreadChoice):
// "compute: 4 ranks over tcp on cpu, 1 thread per rank (training.threads), LibTorch ...".
void print_compute(std::ostream& out, int ranks, const ComputePlace& place);

// ComputePlace::device: `device` as it prints, with the spelling of training.device when that
// differs ("cuda:1 (training.device: cuda)").
std::string place_of_device(const c10::Device& device, const std::string& spelled);

// "; 2 asked, measured first: ... ms on 1 thread and ... ms on 2 (...), the faster kept"; empty
// for a choice that measured nothing.
std::string describe_thread_choice(const pp::ThreadChoice& choice);

// The metrics file: one metrics_json line per step. An empty path writes nothing. ConfigError
// naming output.metrics when the file cannot be opened.
class MetricsFile {
 public:
  // `append`: a resumed run adds its steps to the lines of the run it continues.
  explicit MetricsFile(const std::string& path, bool append = false);
  void write(const pp::StepMetrics& m, std::optional<double> validation = std::nullopt);

 private:
  std::ofstream file_;
  std::string path_;
};

// output.trace: the job's steps as Chrome trace-event JSON (Note [Step trace] in
// pipemat/pp/trace.h), written step by step and closed when the object goes. An empty path
// writes nothing. ConfigError naming output.trace when the file cannot be opened or written.
class TraceFile {
 public:
  TraceFile(const std::string& path, const schedule::Schedule& plan, int replicas);
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;
  bool on() const { return file_.is_open(); }
  void step(const pp::StepMetrics& m);
  // A span of job rank `rank`'s communication track on the steady clock (pp::steady_clock_us).
  void span(const std::string& name, int rank, double start_us, double end_us, int64_t step);

 private:
  void put(const std::string& text);
  std::ofstream file_;
  std::string path_;
  pp::ChromeTrace trace_;
};

// Opens the output file `path` of config key `key` (creating its parent directories);
// ConfigError naming the key, the path and the OS's reason when it cannot.
void open_output(std::ofstream& file, const char* key, const std::string& path,
                 std::ios::openmode mode);

// "checkpoints: DIR, run 3f2a9c01d4e7 (new)": where this run's checkpoints go and which run
// they belong to (Note [Checkpoint directories]), after what checkpoint.overwrite removed.
void print_checkpoint_run(std::ostream& out, const TrainConfig& config,
                          const RunCheckpoints& checkpoints);

// output.timeline_svg: the measured timeline of step `m` of `plan`, and next to it
// ("run.svg" -> "run.predicted.svg") the simulator's prediction with the measured costs.
// ConfigError naming output.timeline_svg when a file cannot be written.
void write_timeline_svg(const TrainConfig& config, const schedule::Schedule& plan,
                        const pp::StepMetrics& m);

// output.loss_svg: the loss curve (its parent directory created). ConfigError naming
// output.loss_svg when the file cannot be written.
void write_loss_svg(const std::string& path, const std::vector<LossPoint>& train,
                    const std::vector<LossPoint>& validation, const std::string& title);

}  // namespace pipemat::train
