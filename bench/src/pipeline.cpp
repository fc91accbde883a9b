#include "pipemat/bench/pipeline.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/stats.h"
#include "pipemat/pp/compute.h"
#include "pipemat/remat/memory.h"
#include "pipemat/train/config.h"
#include "pipemat/train/launched_run.h"
#include "pipemat/train/train.h"

namespace pipemat::bench {
namespace {

// The medians of the steps after warm-up; losses compared with the reference's, bitwise.
// `layers_per_stage` > 0: also the per-layer costs (BenchPipelineRow::layer_costs), with I and W
// when the schedule splits the backward.
BenchPipelineRow summarize(const std::vector<pp::StepMetrics>& steps, int64_t warmup,
                           const std::vector<double>& reference_losses, double layers_per_stage = 0,
                           bool split_backward = false) {
  BenchPipelineRow row;
  std::vector<double> step_ms, bubble, schedule_bubble, sim, sim_comm, delay, wait;
  double allreduce = 0, allreduce_wait = 0;  // sums, for the hidden share
  std::vector<double> allreduce_ms, gather_ms;
  std::vector<double> f, b, i_cost, w, r;
  for (const pp::StepMetrics& m : steps) {
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
    allreduce_ms.push_back(m.allreduce_ms);
    gather_ms.push_back(m.gather_ms);
    allreduce += m.allreduce_ms;
    allreduce_wait += m.allreduce_wait_ms;
    f.push_back(m.measured_costs.forward);
    b.push_back(m.measured_costs.backward_cost());
    i_cost.push_back(m.measured_costs.backward_input);
    w.push_back(m.measured_costs.backward_weight);
    r.push_back(m.measured_costs.recompute.value_or(0.0));
  }
  if (!steps.empty()) {
    const pp::StepMetrics& last = steps.back();
    row.loss = last.loss;
    row.resident_peak_bytes = last.rank_resident_peak_bytes.empty()
                                  ? std::vector<int64_t>{last.resident_peak_bytes}
                                  : last.rank_resident_peak_bytes;
    row.optimizer_state_bytes = last.optimizer_state_bytes;
    for (int64_t bytes : last.rank_optimizer_state_bytes)
      row.optimizer_state_bytes = std::max(row.optimizer_state_bytes, bytes);
  }
  row.step_ms = median(step_ms);
  row.bubble = median(bubble);
  row.schedule_bubble = median(schedule_bubble);
  row.simulated_bubble = median(sim);
  row.simulated_bubble_comm = median(sim_comm);
  row.message_delay_ms = median(delay);
  row.recv_wait_ms = median(wait);
  row.allreduce_ms = median(allreduce_ms);
  row.allreduce_hidden = allreduce > 0 ? 1.0 - allreduce_wait / allreduce : 0.0;
  row.gather_ms = median(gather_ms);
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

// Each schedule's config: the common overrides with its schedule.kind.
std::map<std::string, train::TrainConfig> schedule_configs(const BenchPipelineOptions& o,
                                                           const std::vector<std::string>& common) {
  std::map<std::string, train::TrainConfig> variant;
  for (const auto& s : o.schedules) {
    std::vector<std::string> with_kind = common;
    with_kind.push_back("schedule.kind=" + s);
    variant.emplace(s, train::load_config(o.config, with_kind));
  }
  return variant;
}

// The reference runs: with the pipeline ranks' threads (the oracle of the losses: the same
// kernels and reduction orders), then with 1 thread and with the default threads of one rank
// on this host where those differ: the faster reference is what a speedup is counted from.
struct References {
  std::vector<double> losses;  // with the ranks' threads
  double best_step_ms = 0;
  std::vector<BenchPipelineRow> rows;  // speedups over the best
};

References run_references(const train::TrainConfig& base, int64_t warmup, int rank_threads) {
  const int one_rank = base.training.threads > 0 ? static_cast<int>(base.training.threads)
                                                 : pp::default_compute_threads(1);
  std::vector<int> reference_threads = {rank_threads};
  for (int t : {1, one_rank}) {
    if (std::find(reference_threads.begin(), reference_threads.end(), t) ==
        reference_threads.end()) {
      reference_threads.push_back(t);
    }
  }
  References refs;
  for (int threads : reference_threads) {
    pp::set_compute_threads(threads);
    const auto steps = train::run_reference(base, nullptr);
    if (refs.losses.empty()) {
      for (const auto& m : steps) refs.losses.push_back(m.loss);
    }
    BenchPipelineRow row = summarize(steps, warmup, refs.losses);
    row.schedule = "-";
    row.transport = "reference";
    row.threads = threads;
    row.losses_compared = threads == rank_threads;
    refs.best_step_ms =
        refs.best_step_ms == 0 ? row.step_ms : std::min(refs.best_step_ms, row.step_ms);
    refs.rows.push_back(row);
  }
  for (auto& row : refs.rows) row.speedup = refs.best_step_ms / row.step_ms;
  return refs;
}

bool splits_backward(pipemat::schedule::ScheduleKind kind) {
  using Kind = pipemat::schedule::ScheduleKind;
  return kind == Kind::kZeroBubbleH1 || kind == Kind::kZeroBubbleH2 || kind == Kind::kZeroBubbleV;
}

// The steps of `config` (schedule `schedule`) over `transport` with weight_tail `tail` and
// shard_optimizer `shard`: in this process for local, else launched as `job` (its overrides the
// common ones) with the schedule's.
std::vector<pp::StepMetrics> run_variant(const train::TrainConfig& config,
                                         const std::string& schedule, const std::string& transport,
                                         bool tail, bool shard, train::LaunchedRun job,
                                         int64_t steps, int rank_threads) {
  if (transport == "local") {
    train::TrainConfig local = config;
    local.parallel.weight_tail = tail;
    local.parallel.shard_optimizer = shard;
    local.transport.kind = comm::TransportKind::kLocal;
    local.output = train::OutputOptions{};
    local.output.progress = false;
    pp::set_compute_threads(rank_threads);
    return train::train_in_process(local, nullptr).steps;
  }
  job.transport = transport;
  job.overrides.push_back("schedule.kind=" + schedule);
  job.overrides.push_back(std::string("parallel.weight_tail=") + (tail ? "true" : "false"));
  job.overrides.push_back(std::string("parallel.shard_optimizer=") + (shard ? "true" : "false"));
  return train::run_launched(job, steps,
                             "bench pipeline: the " + schedule + " run over " + transport);
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
  // A benchmark measures steps (the main job's config writes run files of every kind).
  std::vector<std::string> common = train::measured_run_overrides();
  common.insert(common.end(), o.overrides.begin(), o.overrides.end());
  common.push_back("training.steps=" + std::to_string(o.steps));
  train::TrainConfig base = train::load_config(o.config, common);
  // Every variant's config, valid before anything runs.
  const std::map<std::string, train::TrainConfig> variant = schedule_configs(o, common);
  PIPEMAT_CHECK(!o.weight_tails.empty(), ConfigError,
                "bench pipeline: give at least one --weight-tail value");
  const int ranks = static_cast<int>(base.schedule.ranks * base.parallel.data);
  const std::vector<bool> tails =
      base.parallel.data > 1 ? o.weight_tails : std::vector<bool>{o.weight_tails[0]};
  PIPEMAT_CHECK(!o.shard_optimizers.empty(), ConfigError,
                "bench pipeline: give at least one --shard-optimizer value");
  const std::vector<bool> shards =
      base.parallel.data > 1 ? o.shard_optimizers : std::vector<bool>{o.shard_optimizers[0]};
  std::vector<BenchPipelineRow> rows;
  const auto add = [&](BenchPipelineRow row) {
    if (on_row) on_row(row);
    rows.push_back(std::move(row));
  };

  remat::install_tracking_allocator();  // peak bytes of the in-process runs
  const int rank_threads = base.training.threads > 0 ? static_cast<int>(base.training.threads)
                                                     : pp::default_compute_threads(ranks);
  const References refs = run_references(base, o.warmup, rank_threads);
  for (const auto& row : refs.rows) add(row);
  std::map<int, std::vector<double>> oracle;  // reference losses by model stages
  {
    pp::PipelineOptions shape;
    shape.schedule = base.schedule;
    oracle[pp::stage_count(shape)] = refs.losses;
  }

  const std::string who = "bench pipeline";
  const std::string launcher = o.launcher.empty() ? train::default_launcher(who) : o.launcher;
  // Kept when a run fails: the error names it.
  const train::TempFile temp_log("pipemat-bench-pipeline-XXXXXX.log", who, /*keep=*/true);
  const train::LaunchedRun job{launcher, ranks,  "",
                               o.config, common, o.log.empty() ? temp_log.path() : o.log};
  for (const auto& schedule : o.schedules) {
    const train::TrainConfig& config = variant.at(schedule);
    pp::PipelineOptions shape;
    shape.schedule = config.schedule;
    // A model with random layers (dropout) draws stage s's stream from pp::forward_seed(..., s):
    // the oracle of a variant with another stage split (zb-v: two per rank) is the reference of
    // that split, run once with the ranks' threads.
    const int stages = pp::stage_count(shape);
    if (!oracle.count(stages)) {
      pp::set_compute_threads(rank_threads);
      std::vector<double>& l = oracle[stages];
      for (const auto& m : train::run_reference(config, nullptr)) l.push_back(m.loss);
    }
    for (const auto& transport : o.transports) {
      for (const bool tail : tails) {
        for (const bool shard : shards) {
          const std::vector<pp::StepMetrics> steps =
              run_variant(config, schedule, transport, tail, shard, job, o.steps, rank_threads);
          BenchPipelineRow row = summarize(steps, o.warmup, oracle.at(stages),
                                           static_cast<double>(config.model.layers) / stages,
                                           splits_backward(config.schedule.kind));
          row.schedule = schedule;
          row.transport = transport;
          row.weight_tail = tail;
          row.shard_optimizer = shard;
          row.threads = rank_threads;
          row.speedup = refs.best_step_ms / row.step_ms;
          add(row);
        }
      }
    }
  }
  std::remove(temp_log.path().c_str());
  return rows;
}

}  // namespace pipemat::bench
