#pragma once
// `pipemat bench pipeline`: does the pipeline pay off? Runs the single-process reference and each
// (schedule, transport) variant of one config, and reports per variant the median step time
// after warm-up, the speedup over the faster reference (1 thread or the default threads), the
// measured bubble next to the simulated one without and with the measured message delay
// (Note [Measured message delay]), the time blocked in receives, the peak bytes, and whether
// every step's loss equals the reference's bitwise, and the per-layer costs it measured. With
// parallel.data above 1 a variant runs D x schedule.ranks ranks, the reference combines the
// replicas' gradients the same way, and a row adds the gradient all-reduce: its time from the
// first bucket's post to the last sum and the share of it hidden behind the rank's actions
// (Note [Overlapped gradient all-reduce]), per parallel.weight_tail asked for, and per
// parallel.shard_optimizer asked for the optimizer state each rank held and the gather's time
// (Note [Sharded optimizer]).
// The local variant runs in this process (ranks as threads); mpi and tcp start `pipemat-run`
// (next to the running binary, or `launcher`) and read the metrics file of the run.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pipemat::bench {

struct BenchPipelineOptions {
  std::string config;                  // YAML file (the mpi / tcp ranks read it too)
  std::vector<std::string> overrides;  // --set k=v for every variant
  std::vector<std::string> schedules = {"1f1b", "zb-h1", "zb-v"};
  std::vector<std::string> transports = {"mpi", "tcp", "local"};
  // parallel.weight_tail of each variant (Note [Weight tail]); only the first without data
  // parallelism.
  std::vector<bool> weight_tails = {true};
  // parallel.shard_optimizer of each variant (Note [Sharded optimizer]); only the first without
  // data parallelism.
  std::vector<bool> shard_optimizers = {false};
  int64_t steps = 20;    // per variant, warm-up included
  int64_t warmup = 5;    // steps left out of the medians
  std::string launcher;  // pipemat-run; empty: next to /proc/self/exe
  std::string log;       // output of the mpi / tcp runs; empty: a temp file
};

struct BenchPipelineRow {
  std::string schedule;          // "-" for the reference rows
  std::string transport;         // "reference" for the single-process rows
  bool weight_tail = true;       // parallel.weight_tail of the variant
  bool shard_optimizer = false;  // parallel.shard_optimizer of the variant
  // The reporting rank's pipeline (replica 0): the most optimizer-state bytes of one rank after
  // the last step, and the median time of its rank's gather of the updated parameters.
  int64_t optimizer_state_bytes = 0;
  double gather_ms = 0;
  int threads = 0;     // compute threads per rank
  double step_ms = 0;  // median after warm-up
  double speedup = 0;  // faster reference step / step_ms
  // Medians. bubble: 1 - busy / (ranks x step time), the optimizer step and the runtime's
  // work between actions included; schedule_bubble: the same over the measured timeline (first
  // to last action), which is what the simulator predicts.
  double bubble = 0, schedule_bubble = 0, simulated_bubble = 0, simulated_bubble_comm = 0;
  double message_delay_ms = 0, recv_wait_ms = 0;  // medians
  // With data parallelism (medians over the reporting rank, replica 0's last stage): the
  // all-reduce from its first post to its last sum, and 1 - its wait at the step's end / that.
  double allreduce_ms = 0, allreduce_hidden = 0;
  int64_t peak_bytes = 0;  // max over ranks and steps (local: the whole process)
  // Per rank, the most resident memory its process held (pp::peak_resident_bytes; local and
  // the reference rows: the benchmark's own process, which ran the earlier rows too).
  std::vector<int64_t> resident_peak_bytes;
  double loss = 0;  // the last step's loss
  // Every step's loss bitwise equal to the reference's with the ranks' threads; not compared
  // (losses_compared false) for a reference with other threads (other reduction orders).
  bool losses_equal = true;
  bool losses_compared = true;
  // Per layer: the median mean time of each action type divided by the layers of one model
  // stage (model.layers / (ranks x chunks per rank)), and the median message delay as comm: the
  // --costs of `pipemat project` (schedule/project.h). Empty for the reference rows.
  std::string layer_costs;
};

// Runs the reference (with the ranks' threads, 1 thread and one rank's default threads) and
// every variant, calling on_row as each row is done. ConfigError for bad options; PipelineError
// naming the variant and the log when a run fails.
std::vector<BenchPipelineRow> run_bench_pipeline(
    const BenchPipelineOptions& options,
    const std::function<void(const BenchPipelineRow&)>& on_row);

}  // namespace pipemat::bench
