#pragma once
// The Chrome trace-event format of a job's steps: what Perfetto (ui.perfetto.dev) and
// chrome://tracing open. The library makes the text; the caller writes it (train's
// output.trace streams it step by step).
//
// Note [Step trace]
// ~~~~~~~~~~~~~~~~~
// What a step's trace holds. Every rank records, from its step's start (the barrier that starts
// a step when timelines are collected, so the ranks' clocks meet there), each action of its
// schedule and the other parts of its step (StepMetrics::timeline and ::spans); the last stage's
// rank gathers them (rank_timelines, rank_spans). With D > 1 replicas (Note [Data x pipeline],
// PipelineOptions::trace_replicas) the last stage's rank of each replica sends its pipeline's to
// replica 0's (replica_timelines), so the trace holds every rank of the job: pipeline rank r of
// replica d is process r x D + d, its rank in the job as pipemat train lays it out (Note [Rank
// layout] in train/src/train.cpp). The trace is one process per rank with four tracks, since
// Perfetto cannot draw overlapping events on one track:
//   compute        F, B, I, W, R as "<stage><type><micro-batch>" (schedule::format_action),
//                  LOSS (on the last stage the F ends where its loss starts), CLIP, OPTIMIZER;
//   communication  SEND_F / SEND_B (the call that issues the send, with its bytes), RECV_F /
//                  RECV_B (the wait of the compute action that takes the message, with its
//                  bytes; zero length when it had arrived), SEND_WAIT (the step's unfinished
//                  sends), TIED_SUM, GRADIENT_WAIT, GATHER, and outside the steps CHECKPOINT;
//   data-parallel  GRADIENT_EXCHANGE: the data group's reduce in flight (first post to last
//                  sum), with the gradient bytes, overlapping the rank's other work;
//   step           "step N": the rank's whole step.
// One rank runs its step on one thread, so the compute and communication tracks never overlap
// each other and their events and the gaps between them (bookkeeping between actions) make up
// the step. Every event carries its step, and the actions their stage and micro-batch. The
// simulated timeline of the same schedule (schedule::simulate with each stage's measured mean
// cost per action type and the step's measured message delay: StepMetrics::simulated; a job-wide
// mean would give the first stage's empty I the last stage's cost) is one more
// process (replica 0's costs), a track per pipeline rank, at the same step start: predicted
// below measured (where the previous step's prediction ran longer than its step, after that
// prediction's end).
// Times are microseconds from the first traced step's start on the collecting rank's steady
// clock. Every rank sends its step's start on its own steady clock (StepMetrics::
// rank_clock_start_us): ranks of one host (threads, or processes of one machine) share that clock
// and are placed by it, exactly; a rank whose clock reads 10 s or more apart from the collecting
// rank's is on another host and is placed at the collecting rank's step start, which the barrier
// that starts every step aligns to within the barrier's release skew.

#include <cstdint>
#include <string>

#include "pipemat/pp/pipeline.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::pp {

class ChromeTrace {
 public:
  // `replicas`: the job's pipelines (parallel.data), >= 1; PipelineError otherwise.
  explicit ChromeTrace(schedule::Schedule plan, int replicas = 1);

  // The file's start: `{"traceEvents":[` and the names of the processes and tracks.
  std::string begin() const;
  // The events of step `m` as the last stage's rank returns it (collect_timelines: its
  // rank_timelines and rank_spans; with replicas, replica 0's with replica_timelines), then its
  // simulated timeline; each event preceded by ",\n". PipelineError when `m` holds no timeline
  // of every rank of every replica.
  std::string step(const StepMetrics& m);
  // An event on rank `rank`'s communication track outside the steps (e.g. "CHECKPOINT"), its
  // start and end on the steady clock (steady_clock_us), after step `step`.
  std::string span(const std::string& name, int rank, double clock_start_us, double clock_end_us,
                   int64_t step) const;
  // The file's end.
  static std::string end();

 private:
  schedule::Schedule plan_;
  int replicas_ = 1;
  double origin_us_ = -1;     // the first step's clock start: time 0 of the trace
  double predicted_end_ = 0;  // where the last step's simulated timeline ends
};

// Microseconds since the steady clock's epoch (the clock of StepMetrics::clock_start_us).
double steady_clock_us();

}  // namespace pipemat::pp
