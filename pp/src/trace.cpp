// The Chrome trace-event text of a job's steps (Note [Step trace] in pipemat/pp/trace.h).

#include "pipemat/pp/trace.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat::pp {

using schedule::Action;
using schedule::ActionType;

const char* step_part_name(StepPart part) {
  switch (part) {
    case StepPart::kLoss:
      return "LOSS";
    case StepPart::kSendWait:
      return "SEND_WAIT";
    case StepPart::kTiedSum:
      return "TIED_SUM";
    case StepPart::kGradientExchange:
      return "GRADIENT_EXCHANGE";
    case StepPart::kGradientWait:
      return "GRADIENT_WAIT";
    case StepPart::kClip:
      return "CLIP";
    case StepPart::kOptimizer:
      return "OPTIMIZER";
    case StepPart::kGather:
      return "GATHER";
  }
  return "?";
}

double steady_clock_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// The tracks of a rank's process (Note [Step trace]).
enum Track { kCompute = 0, kCommunication = 1, kDataParallel = 2, kStepTrack = 3 };
constexpr const char* kTrackNames[] = {"compute", "communication", "data-parallel", "step"};

// Steady clocks whose step starts lie closer than this are one host's clock (Note [Step trace]).
constexpr double kSameClockUs = 10e6;

std::string fixed(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

// Names are ours (action codes, part names, "step N"), so nothing needs escaping.
struct Event {
  std::string name;
  int pid = 0, tid = 0;
  double ts = 0, dur = 0;
  int64_t step = 0;
  int stage = -1, micro_batch = -1;
  int64_t bytes = -1;  // -1: none

  std::string text() const {
    std::string s = ",\n{\"name\":\"" + name + "\",\"ph\":\"X\",\"pid\":" + std::to_string(pid) +
                    ",\"tid\":" + std::to_string(tid) + ",\"ts\":" + fixed(ts) +
                    ",\"dur\":" + fixed(dur < 0 ? 0 : dur) +
                    ",\"args\":{\"step\":" + std::to_string(step);
    if (stage >= 0) s += ",\"stage\":" + std::to_string(stage);
    if (micro_batch >= 0) s += ",\"micro_batch\":" + std::to_string(micro_batch);
    if (bytes >= 0) s += ",\"bytes\":" + std::to_string(bytes);
    return s + "}}";
  }
};

std::string metadata(const char* what, int pid, int tid, const std::string& key,
                     const std::string& value) {
  return ",\n{\"name\":\"" + std::string(what) + "\",\"ph\":\"M\",\"pid\":" + std::to_string(pid) +
         ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"" + key + "\":" + value + "}}";
}

Track track_of(StepPart part) {
  switch (part) {
    case StepPart::kLoss:
    case StepPart::kClip:
    case StepPart::kOptimizer:
      return kCompute;
    case StepPart::kGradientExchange:
      return kDataParallel;
    default:
      return kCommunication;
  }
}

// The events of one rank's step (Note [Step trace]): process `pid`, its timeline, spans, step
// time and step start on its clock; `m` is the collecting rank's step, whose start is `base`
// in the trace.
std::string rank_events(int pid, const std::vector<ActionTiming>& timeline,
                        const std::vector<StepSpan>& spans, double step_ms, double clock_start_us,
                        const StepMetrics& m, double base) {
  std::string s;
  // A rank on this clock (one host) starts at its own start; one on another host's clock
  // (seconds or more apart) at the collecting rank's: the barrier that started the step.
  const double skew = clock_start_us - m.clock_start_us;
  const double at = base + (std::abs(skew) < kSameClockUs ? skew : 0.0);
  // The last stage's F ends where its loss starts.
  std::map<std::pair<int, int>, double> loss_start;
  for (const StepSpan& x : spans) {
    if (x.part == StepPart::kLoss) loss_start[{x.stage, x.micro_batch}] = x.start_us;
  }
  for (const ActionTiming& x : timeline) {
    const Action& a = x.action;
    Event e{schedule::format_action(a), pid,    kCompute, at + x.start_us,
            x.end_us - x.start_us,      m.step, a.stage,  a.micro_batch};
    if (schedule::is_comm(a.type)) {
      e.tid = kCommunication;
      e.bytes = x.bytes;
    } else if (x.received) {
      const ActionType recv =
          a.type == ActionType::kForward ? ActionType::kRecvForward : ActionType::kRecvBackward;
      Event w{schedule::format_action({a.stage, recv, a.micro_batch}),
              pid,
              kCommunication,
              at + x.start_us - x.wait_us,
              x.wait_us,
              m.step,
              a.stage,
              a.micro_batch,
              x.bytes};
      s += w.text();
    }
    if (a.type == ActionType::kForward) {  // the loss: from its start to the F's end
      const auto l = loss_start.find({a.stage, a.micro_batch});
      if (l != loss_start.end()) {
        e.dur = l->second - x.start_us;
        s += Event{step_part_name(StepPart::kLoss),
                   pid,
                   kCompute,
                   at + l->second,
                   x.end_us - l->second,
                   m.step,
                   a.stage,
                   a.micro_batch}
                 .text();
      }
    }
    s += e.text();
  }
  for (const StepSpan& x : spans) {
    if (x.part == StepPart::kLoss) continue;  // shown with its F
    Event e{step_part_name(x.part), pid,    track_of(x.part), at + x.start_us,
            x.end_us - x.start_us,  m.step, x.stage,          x.micro_batch};
    if (x.part == StepPart::kGradientExchange) e.bytes = x.bytes;
    s += e.text();
  }
  s +=
      Event{"step " + std::to_string(m.step), pid, kStepTrack, at, step_ms * 1000.0, m.step}.text();
  return s;
}

}  // namespace

ChromeTrace::ChromeTrace(schedule::Schedule plan, int replicas)
    : plan_(std::move(plan)), replicas_(replicas) {
  PIPEMAT_CHECK(replicas >= 1, PipelineError, "trace: ", replicas, " replicas; at least 1");
}

std::string ChromeTrace::begin() const {
  // The first entry has no comma before it: a zero-length marker at time 0.
  std::string s =
      "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n{\"name\":\"trace start\",\"ph\":\"i\","
      "\"s\":\"g\",\"pid\":0,\"tid\":0,\"ts\":0}";
  const int ranks = plan_.ranks_count;
  const int processes = ranks * replicas_;  // the simulation's pid
  for (int job = 0; job < processes; ++job) {
    std::string name = "rank " + std::to_string(job);
    if (replicas_ > 1) {
      name += " (replica " + std::to_string(job % replicas_) + ", pipeline rank " +
              std::to_string(job / replicas_) + ")";
    }
    s += metadata("process_name", job, 0, "name", "\"" + name + "\"");
    s += metadata("process_sort_index", job, 0, "sort_index", std::to_string(job));
    for (int t = 0; t < 4; ++t) {
      s += metadata("thread_name", job, t, "name", std::string("\"") + kTrackNames[t] + "\"");
      s += metadata("thread_sort_index", job, t, "sort_index", std::to_string(t));
    }
  }
  s += metadata("process_name", processes, 0, "name",
                "\"simulated (" + std::string(schedule::to_string(plan_.kind)) +
                    ", each stage's measured mean costs)\"");
  s += metadata("process_sort_index", processes, 0, "sort_index", std::to_string(processes));
  for (int r = 0; r < ranks; ++r) {
    s += metadata("thread_name", processes, r, "name", "\"rank " + std::to_string(r) + "\"");
    s += metadata("thread_sort_index", processes, r, "sort_index", std::to_string(r));
  }
  return s;
}

std::string ChromeTrace::step(const StepMetrics& m) {
  const auto ranks = static_cast<size_t>(plan_.ranks_count);
  PIPEMAT_CHECK(m.rank_timelines.size() == ranks && m.rank_spans.size() == ranks &&
                    m.rank_step_ms.size() == ranks && m.rank_clock_start_us.size() == ranks,
                PipelineError, "trace: step ", m.step,
                " holds no timeline of every rank (the last stage's rank has them, with "
                "collect_timelines)");
  PIPEMAT_CHECK(m.replica_timelines.size() == static_cast<size_t>(replicas_ - 1) &&
                    std::all_of(m.replica_timelines.begin(), m.replica_timelines.end(),
                                [&](const PipelineTimelines& p) {
                                  return p.timelines.size() == ranks && p.spans.size() == ranks &&
                                         p.step_ms.size() == ranks &&
                                         p.clock_start_us.size() == ranks;
                                }),
                PipelineError, "trace: step ", m.step, " holds the timelines of ",
                m.replica_timelines.size() + 1, " replicas, not of ", replicas_,
                " (replica 0's last stage's rank has them, with PipelineOptions::trace_replicas)");
  if (origin_us_ < 0) origin_us_ = m.clock_start_us;
  const double base = m.clock_start_us - origin_us_;
  std::string s;
  for (size_t r = 0; r < ranks; ++r) {
    const int pid = static_cast<int>(r) * replicas_;  // replica 0's: the collecting rank's own
    s += rank_events(pid, m.rank_timelines[r], m.rank_spans[r], m.rank_step_ms[r],
                     m.rank_clock_start_us[r], m, base);
    for (int d = 1; d < replicas_; ++d) {
      const PipelineTimelines& p = m.replica_timelines[static_cast<size_t>(d - 1)];
      s += rank_events(pid + d, p.timelines[r], p.spans[r], p.step_ms[r], p.clock_start_us[r], m,
                       base);
    }
  }
  // The prediction: the simulator on each stage's measured mean costs and the message delay
  // (ms), as the step's metrics hold it.
  const schedule::SimulationResult& predicted = m.simulated;
  // At the step's start, or after the previous prediction where that ran longer than its step.
  const double predicted_at = std::max(base, predicted_end_);
  predicted_end_ = predicted_at + predicted.makespan * 1000.0;
  for (const schedule::RankTimeline& rt : predicted.ranks) {
    for (const schedule::TimedAction& ta : rt.actions) {
      if (!schedule::is_compute(ta.action.type)) continue;
      s += Event{schedule::format_action(ta.action),
                 plan_.ranks_count * replicas_,
                 rt.rank,
                 predicted_at + ta.start * 1000.0,
                 (ta.end - ta.start) * 1000.0,
                 m.step,
                 ta.action.stage,
                 ta.action.micro_batch}
               .text();
    }
  }
  return s;
}

std::string ChromeTrace::span(const std::string& name, int rank, double clock_start_us,
                              double clock_end_us, int64_t step) const {
  const double origin = origin_us_ < 0 ? clock_start_us : origin_us_;
  return Event{name, rank, kCommunication, clock_start_us - origin, clock_end_us - clock_start_us,
               step}
      .text();
}

std::string ChromeTrace::end() { return "\n]}\n"; }

}  // namespace pipemat::pp
