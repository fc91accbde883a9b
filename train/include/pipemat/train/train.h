#pragma once
// Training drivers of the zoo (`pipemat train`), clients of the public pp API (pipeline.h): a
// pipeline run on this process's transport (mpirun / tcp), the same run with ranks as threads
// over the local transport (tests), and the single-process reference (the oracle).
// Progress: one human-readable line per step and one JSON line per step (metrics file), both
// from the last stage's rank.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/compute.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/train/options.h"

namespace pipemat::train {

using pp::StepMetrics;

// Steps kept in TrainResult::steps: a long run keeps only its most recent ones (the metrics file
// and the progress lines have every step), so memory stays flat however long it trains.
inline constexpr size_t kKeptSteps = 1024;

// Note [End of a run]
// After the last step a run saves its final checkpoint, writes its output files (timeline,
// loss curve) and draws the sample. A failure there does not undo the training: it is recorded
// (and printed by `pipemat train`, naming the part), the rest of the end still runs where it
// can (the sample needs the final checkpoint), the checkpoint stays, and the exit code says
// which part failed (the value of EndPart; the smallest when several did). A failure during
// training, a checkpoint before the last step included, stops the run at once as an error.
enum class EndPart { kCheckpoint = 3, kOutput = 4, kSample = 5 };
struct EndFailure {
  EndPart part;
  std::string message;
};
const char* to_string(EndPart part);

// A run that diverged: step N's loss or clipped gradient norm was not finite (nan or inf) and
// training.allow_non_finite is false. Every rank throws it at the same step (the loss and the
// norm are the same on every rank), before that step's checkpoint: the last complete
// checkpoint is the one named. `pipemat train` exits with kDivergedExitCode.
class DivergedError : public Error {
 public:
  using Error::Error;
};
inline constexpr int kDivergedExitCode = 6;

// Note [Stopping on a signal]
// `pipemat train` turns SIGINT and SIGTERM into a stop request (launch/src/stop_signals.h); the
// library only asks a StopRequested between steps and never reads signals itself. A signal
// before the first ask (while the run builds its model, reads its data or loads a checkpoint or
// weights) ends the process at once: no step boundary would come soon, and nothing is lost. Every
// rank of a job gets the signal (pipemat-run forwards it to each rank, mpirun sends each rank
// SIGTERM, ranks as threads share one process), so every rank stops at a step boundary: the run
// finishes nothing new (no step, evaluation, checkpoint, loss curve or sample) and reports the
// steps that are complete and its newest complete checkpoint. The ranks may see the request at
// different boundaries: one that has already started the next step when its peer stops is blocked
// in that step until the peer's exit fails it (a closed connection on tcp, a transport destroyed on
// local); a CommError in a step while a stop is requested is therefore the stop, not a failure,
// and that rank reports the same complete steps as its peer (the step it was in cannot complete
// without the peer). MPI has no such failure (a peer waiting in MPI_Finalize looks alive), so
// under mpirun `pipemat train` ends the job with MPI_Abort once a stopped rank has printed its
// line (launch/src/cmd_train.cpp): the first rank to stop reports, the others may be ended
// before they do.
// Must be cheap and thread-safe: ranks as threads ask it concurrently.
using StopRequested = std::function<bool()>;

// Where a stop request ended a run.
struct Interruption {
  int64_t steps_done = 0;  // the steps complete (the step counter, resumed steps included)
  // The newest complete checkpoint of the run (the last one it saved, else the one it resumed
  // from); "" when there is none. Known on replica 0's ranks only, which write the checkpoints.
  std::string checkpoint;
  bool replica0 = false;  // this rank belongs to replica 0, which reports the interruption
};

// run_train's return value when a stop request ended the run; `pipemat train` exits with 128 +
// the signal's number instead (130 for SIGINT, 143 for SIGTERM), as a shell reports a signal.
inline constexpr int kInterrupted = 2;

// The whole run as the last stage's rank measured it, for the summary at its end.
struct RunTotals {
  std::vector<double> step_ms;  // every step's time
  std::vector<double> data_ms;  // every step's time in the data source (StepMetrics::data_ms)
  // With output.trace: every step's time to make and write its trace events (replica 0's last
  // stage's rank, after the step).
  std::vector<double> trace_ms;
  // Per rank: the most tensor bytes it held during any step (StepMetrics::rank_start_bytes +
  // rank_peak_bytes: weights, gradients, optimizer state and activations).
  std::vector<int64_t> rank_peak_bytes;
  // Per rank on a CUDA device: the most bytes its device's caching allocator held during any
  // step (StepMetrics::rank_device_peak_bytes); empty while every step's are 0 (CPU runs).
  std::vector<int64_t> rank_device_peak_bytes;
  // Per rank, of the latest step: the bytes of its parameters, of the gradients it held after the
  // gradient exchange and of its optimizer state (StepMetrics::rank_parameter_bytes, ...; Note
  // [Sharded optimizer]).
  std::vector<int64_t> rank_parameter_bytes, rank_gradient_bytes, rank_optimizer_state_bytes;
  void add(const StepMetrics& m);
};

struct TrainResult {
  // The last stage's rank's view of the most recent kKeptSteps steps, without their action
  // timelines; `last` is the final step with its timelines.
  std::vector<StepMetrics> steps;
  StepMetrics last;
  std::vector<std::pair<std::string, at::Tensor>> params;  // this rank's (in-process: all)
  bool last_stage_rank = false;
  std::vector<std::pair<int64_t, double>> validation;  // (step, validation loss): gpt
  std::string sample;            // the text sample after training (sample.tokens), on the last rank
  std::string final_checkpoint;  // "" without checkpoint.dir or when its save failed
  std::vector<EndFailure> end_failures;  // this rank's (in-process: every rank's)
  RunTotals totals;                      // on the last stage's rank
  // Set when a stop request ended the run (Note [Stopping on a signal]).
  std::optional<Interruption> interrupted;
};

// Called on every rank after each step (0-based) with the rank's transport, e.g. to meet the
// other ranks at a barrier and sample memory while no step runs (`pipemat bench soak`).
using AfterStep = std::function<void(int64_t step, comm::Transport& transport)>;

// Runs config.training.steps steps on `transport` (one rank of the pipeline).
// stop_requested (when set) is asked before each step: Note [Stopping on a signal].
TrainResult train_on(const TrainConfig& config, comm::Transport& transport, std::ostream* progress,
                     const AfterStep& after_step = nullptr,
                     const StopRequested& stop_requested = nullptr);

// Runs the whole pipeline in this process, one thread per rank over local transports.
// Rethrows the first rank's error (the other ranks fail fast when a peer is gone).
TrainResult train_in_process(const TrainConfig& config, std::ostream* progress,
                             const AfterStep& after_step = nullptr,
                             const StopRequested& stop_requested = nullptr);

// The oracle run with the same progress and metrics output.
TrainResult train_reference(const TrainConfig& config, std::ostream* progress);

// `pipemat train`: picks the transport (config.transport.kind; local runs in-process), runs,
// writes progress to `out`, metrics to config.output.metrics and each end-of-run failure to
// `err` as "pipemat: error: ..." (Note [End of a run]). Returns the exit code: 0, or the
// EndPart of the first end-of-run failure; kInterrupted when stop_requested ended the run
// (ignored by the reference), after replica 0's ranks wrote "pipemat: [rank R: ]interrupted at
// step N of M; ..." with the newest complete checkpoint to `err`.
int run_train(const TrainConfig& config, bool reference, std::ostream& out, std::ostream& err,
              const StopRequested& stop_requested = nullptr);

// The oracle: the same stages, data and steps chained in one process, no pipeline and no
// remat; a random model draws stage s of micro-batch i from pp::forward_seed(seed, step, i,
// pp::stage_stream(stage s)) as the pipeline does. Returns one StepMetrics per step (loss and step
// time); `params` receives the final parameters, `validation` the (step, loss) of each evaluation,
// `tokens_per_byte` ModelRun::validation_tokens_per_byte. `stop_requested` (when set) is asked
// before each step: true ends the run there (Note [Stopping on a signal]).
std::vector<StepMetrics> run_reference(
    const TrainConfig& config, std::vector<std::pair<std::string, at::Tensor>>* params,
    std::vector<std::pair<int64_t, double>>* validation = nullptr,
    double* tokens_per_byte = nullptr, const StopRequested& stop_requested = nullptr);

// The single-process reference's figures for the run summary (output.reference_steps).
struct ReferenceFigures {
  int64_t steps = 0;           // steps run
  int64_t measured_steps = 0;  // the steps after the first third, whose median is step_ms
  int threads = 1;             // LibTorch's compute threads
  std::optional<pp::ThreadChoice> choice;  // how they were chosen, when measured
  double step_ms = 0;                      // median step time
  int64_t peak_bytes = 0;  // the most tensor bytes it held (weights, optimizer state included)
};

// Runs `steps` (>= 1) steps of `config`'s reference (run_reference) with `threads` compute
// threads (with training.thread_probe, the faster of 1 and `threads` as
// pp::choose_compute_threads measures them) and returns its figures, the step time measured over
// the steps after the first third; bytes this process held before are not counted.
// None when `stop_requested` said stop before all steps ran.
std::optional<ReferenceFigures> measure_reference(const TrainConfig& config, int64_t steps,
                                                  int threads,
                                                  const StopRequested& stop_requested = nullptr);

// One micro-batch's forward and backward through the reference's chain of the config's stages
// (built once, here), the work pp::choose_compute_threads times. The gradients it leaves are
// dropped on the next call.
std::function<void()> micro_batch_work(const TrainConfig& config);

// Sets this process's compute threads for `threads` asked (>= 1): as asked with
// training.thread_probe false or 1 thread, else the faster of 1 and `threads` measured on
// micro_batch_work(config) (Note [Threads are measured, not assumed] in pp/compute.h).
void set_training_threads(const TrainConfig& config, int threads);

// schedule.csv resolved: the imported action list, the config with schedule.kind / stages /
// micro_batches / virtual_stages taken from it, and the importer's note on ignored cells.
// Without schedule.csv: the config as is and no action list. ConfigError naming the file.
struct ResolvedSchedule {
  TrainConfig config;
  std::optional<schedule::Schedule> actions;
  std::string note;
};
ResolvedSchedule resolve_schedule(const TrainConfig& config);

// Note [Replays that cannot lower a peak] (pipemat/schedule/schedule.h): with `remat.policy`
// selective or full for every stage (no remat.stages) and `recompute` pretrigger, the stages
// (ascending) of `schedule` that the run leaves without a checkpoint: those whose every forward is
// followed by its own replay, unless that is every stage (one rank keeps its policy). Empty
// otherwise. The run (train_on) and the cost split (Note [Split by cost]) both take them from here.
std::vector<int> stages_without_replay(const models::RematConfig& remat,
                                       schedule::RecomputeMode recompute,
                                       const schedule::Schedule& schedule);

// The JSON line of one step: {"step":..,"loss":..,"step_ms":..,"bubble":..,"peak_bytes":..,...}
// with "val_loss" after "loss" when the step was followed by an evaluation.
std::string metrics_json(const StepMetrics& m,
                         std::optional<double> validation_loss = std::nullopt);

}  // namespace pipemat::train
