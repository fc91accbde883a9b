// Event-free list simulation: each rank runs its list in order; an action starts when the rank
// is free and its inputs have arrived. Evaluating ranks round-robin until nobody can move gives
// the same times as any other evaluation order (times are a longest-path over a DAG) and finds
// cross-rank cycles as "no rank can move".

#include "pipemat/schedule/simulate.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::schedule {
namespace {

constexpr double kNotYet = -1.0;

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  size_t e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::string number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

class Simulator {
 public:
  Simulator(const Schedule& s, const std::vector<CostModel>& c, const SimulateOptions& o)
      : schedule_(s),
        costs_(c),
        options_(o),
        comms_(s.has_comms()),
        cells_(static_cast<size_t>(s.stages_count) * s.micro_batches) {}

  SimulationResult run() {
    const int p = schedule_.ranks_count;
    std::vector<size_t> next(p, 0);
    SimulationResult result;
    result.ranks.resize(p);
    for (int r = 0; r < p; ++r) result.ranks[r].rank = r;
    if ((options_.parallel_ranks > 0 && options_.parallel_ranks < p) ||
        options_.shared_speed < 1.0) {
      run_shared(next, result);
    } else {
      run_own_cores(next, result);
    }
    bool finished = true;
    for (int r = 0; r < p; ++r) finished = finished && next[r] == schedule_.actions[r].size();
    if (!finished) report_deadlock(next);

    double busy_total = 0.0;
    for (auto& rank : result.ranks) {
      bool first = true;
      int in_flight = 0;
      for (const TimedAction& t : rank.actions) {
        const Action& a = t.action;
        if (!is_compute(a.type)) continue;
        rank.busy += t.end - t.start;
        if (first) rank.first_start = t.start;
        first = false;
        rank.last_end = std::max(rank.last_end, t.end);
        result.makespan = std::max(result.makespan, t.end);
        if (a.type == ActionType::kForward) {
          rank.peak_activations = std::max(rank.peak_activations, ++in_flight);
        } else if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight) {
          --in_flight;
        }
      }
      busy_total += rank.busy;
    }
    result.bubble_ratio = result.makespan > 0 ? 1.0 - busy_total / (p * result.makespan) : 0.0;
    return result;
  }

 private:
  // Every rank on its own cores: an action ends its cost after it starts.
  void run_own_cores(std::vector<size_t>& next, SimulationResult& result) {
    const int p = schedule_.ranks_count;
    std::vector<double> clock(p, 0.0);
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < p; ++r) {
        const auto& list = schedule_.actions[r];
        while (next[r] < list.size()) {
          const Action& a = list[next[r]];
          double ready = 0.0;
          if (!inputs_ready(r, a, &ready)) break;
          const double start = std::max(clock[r], ready);
          const double end = start + duration(a);
          record(a, start, end);
          result.ranks[r].actions.push_back({a, static_cast<int>(next[r]), start, end});
          clock[r] = end;
          ++next[r];
          progress = true;
        }
      }
    }
  }

  // Note [Shared cores] (simulate.h): from event to event (an action's end, a message's
  // arrival), every computing rank runs at the same speed in between.
  void run_shared(std::vector<size_t>& next, SimulationResult& result) {
    const int p = schedule_.ranks_count;
    std::vector<double> clock(p, 0.0);      // when the rank's previous action ended
    std::vector<double> remaining(p, 0.0);  // cost left of the running compute action
    std::vector<double> started(p, 0.0);
    std::vector<bool> running(p, false);
    double now = 0.0;
    while (true) {
      // Start what can start now; zero-time actions may unblock other ranks at the same time.
      double wake = std::numeric_limits<double>::infinity();
      bool progress = true;
      while (progress) {
        progress = false;
        wake = std::numeric_limits<double>::infinity();
        for (int r = 0; r < p; ++r) {
          const auto& list = schedule_.actions[r];
          while (!running[r] && next[r] < list.size()) {
            const Action& a = list[next[r]];
            double ready = 0.0;
            if (!inputs_ready(r, a, &ready)) break;
            const double start = std::max(clock[r], ready);
            if (start > now + time_slack(now)) {  // a message still on its way
              wake = std::min(wake, start);
              break;
            }
            if (is_compute(a.type) && duration(a) > 0) {
              running[r] = true;
              remaining[r] = duration(a);
              started[r] = now;
              break;
            }
            record(a, now, now);
            result.ranks[r].actions.push_back({a, static_cast<int>(next[r]), now, now});
            clock[r] = now;
            ++next[r];
            progress = true;
          }
        }
      }
      const int computing = static_cast<int>(std::count(running.begin(), running.end(), true));
      if (computing == 0 && !std::isfinite(wake)) return;  // finished, or a deadlock
      const int cores = options_.parallel_ranks > 0 ? options_.parallel_ranks : computing;
      const double speed =
          computing < 2 ? 1.0 : options_.shared_speed * std::min(1.0, double(cores) / computing);
      double step = wake - now;
      for (int r = 0; r < p; ++r)
        if (running[r]) step = std::min(step, remaining[r] / speed);
      now += step;
      for (int r = 0; r < p; ++r) {
        if (!running[r]) continue;
        remaining[r] -= step * speed;
        if (remaining[r] > time_slack(now)) continue;
        const Action& a = schedule_.actions[r][next[r]];
        record(a, started[r], now);
        result.ranks[r].actions.push_back({a, static_cast<int>(next[r]), started[r], now});
        clock[r] = now;
        running[r] = false;
        ++next[r];
      }
    }
  }

  // Rounding allowance when comparing times near `t`.
  static double time_slack(double t) { return 1e-12 * std::max(1.0, std::fabs(t)); }

  struct Cell {
    double f = kNotYet, bwd = kNotYet, i = kNotYet, r = kNotYet;
    double send_f = kNotYet, recv_f = kNotYet, send_b = kNotYet, recv_b = kNotYet;
  };
  Cell& cell(int stage, int mb) {
    return cells_[static_cast<size_t>(stage) * schedule_.micro_batches + mb];
  }

  double duration(const Action& a) const {
    const CostModel& c = costs_[a.stage];
    const double lazy =
        schedule_.recompute == RecomputeMode::kLazy ? c.recompute_cost(schedule_.recompute) : 0.0;
    switch (a.type) {
      case ActionType::kForward:
        return c.forward;
      case ActionType::kBackward:
        return c.backward_cost() + lazy;
      case ActionType::kBackwardInput:
        return c.backward_input + lazy;
      case ActionType::kBackwardWeight:
        return c.backward_weight;
      case ActionType::kRecompute:
        return c.recompute_cost(schedule_.recompute);
      default:
        return 0.0;
    }
  }

  // Arrival time of a message: sender stage's SEND and this stage's RECV both done.
  static bool arrival(double send, double post, double comm, double* out) {
    if (send == kNotYet || post == kNotYet) return false;
    *out = std::max(send, post) + comm;
    return true;
  }

  // Input of the pass `a` on rank r; false (with the reason in blocked_on_) when not there yet.
  bool inputs_ready(int r, const Action& a, double* ready) {
    const int st = a.stage, mb = a.micro_batch;
    PIPEMAT_CHECK(st >= 0 && st < schedule_.stages_count && mb >= 0 && mb < schedule_.micro_batches,
                  ScheduleError, "simulate: rank ", r, " action ", format_action(a),
                  " names a stage or micro-batch outside the schedule (", schedule_.stages_count,
                  " stages, ", schedule_.micro_batches,
                  " micro-batches); run validate_schedule first.");
    Cell& me = cell(st, mb);
    switch (a.type) {
      case ActionType::kForward:
        return forward_input_ready(r, st, mb, ready);
      case ActionType::kBackward:
      case ActionType::kBackwardInput:
        if (!need_local(me.f, ActionType::kForward, st, mb, ready)) return false;
        return output_gradient_ready(r, st, mb, ready);
      case ActionType::kBackwardWeight:
        return need_local(me.i, ActionType::kBackwardInput, st, mb, ready);
      case ActionType::kRecompute:
        return need_local(me.f, ActionType::kForward, st, mb, ready);
      case ActionType::kSendForward:
        if (!need_local(me.f, ActionType::kForward, st, mb, ready)) return false;
        return receiver_posted(a, ready);
      case ActionType::kSendBackward:
        if (me.bwd == kNotYet) {
          blocked_on_ = "the backward (B or I) of " + std::to_string(st) + " micro-batch " +
                        std::to_string(mb);
          return false;
        }
        return receiver_posted(a, ready);
      case ActionType::kRecvForward:
      case ActionType::kRecvBackward:
        return true;
    }
    return true;
  }

  // The pass `type` of (stage, mb), which ended at `t`, has run; else blocked on it.
  bool need_local(double t, ActionType type, int stage, int mb, double* ready) {
    if (t == kNotYet) {
      blocked_on_ =
          format_action({stage, type, mb}) + " on rank " + std::to_string(schedule_.rank_of(stage));
      return false;
    }
    *ready = std::max(*ready, t);
    return true;
  }

  // The input of F(st, mb) on rank r: the previous stage's output, local or a message.
  bool forward_input_ready(int r, int st, int mb, double* ready) {
    if (st == 0) return true;
    Cell& me = cell(st, mb);
    Cell& prev = cell(st - 1, mb);
    if (schedule_.rank_of(st - 1) == r || !comms_) {
      if (!need_local(prev.f, ActionType::kForward, st - 1, mb, ready)) return false;
      if (schedule_.rank_of(st - 1) != r) *ready += costs_[st - 1].message_cost();
      return true;
    }
    double t = 0.0;
    if (!arrival(prev.send_f, me.recv_f, costs_[st - 1].message_cost(), &t)) {
      blocked_on_ =
          prev.send_f == kNotYet
              ? format_action({st - 1, ActionType::kSendForward, mb}) + " on rank " +
                    std::to_string(schedule_.rank_of(st - 1))
              : format_action({st, ActionType::kRecvForward, mb}) + " on rank " + std::to_string(r);
      return false;
    }
    *ready = std::max(*ready, t);
    return true;
  }

  // The output gradient of B / I(st, mb) on rank r: the next stage's backward, local or a
  // message.
  bool output_gradient_ready(int r, int st, int mb, double* ready) {
    if (st == schedule_.stages_count - 1) return true;
    Cell& me = cell(st, mb);
    Cell& nxt = cell(st + 1, mb);
    if (schedule_.rank_of(st + 1) == r || !comms_) {
      double before = *ready;
      *ready = 0.0;
      if (!need_local(nxt.bwd, ActionType::kBackward, st + 1, mb, ready)) {
        blocked_on_ = "the backward (B or I) of stage " + std::to_string(st + 1) + " micro-batch " +
                      std::to_string(mb) + " on rank " + std::to_string(schedule_.rank_of(st + 1));
        return false;
      }
      if (schedule_.rank_of(st + 1) != r) *ready += costs_[st + 1].message_cost();
      *ready = std::max(*ready, before);
      return true;
    }
    double t = 0.0;
    if (!arrival(nxt.send_b, me.recv_b, costs_[st + 1].message_cost(), &t)) {
      blocked_on_ = nxt.send_b == kNotYet
                        ? format_action({st + 1, ActionType::kSendBackward, mb}) + " on rank " +
                              std::to_string(schedule_.rank_of(st + 1))
                        : format_action({st, ActionType::kRecvBackward, mb}) + " on rank " +
                              std::to_string(r);
      return false;
    }
    *ready = std::max(*ready, t);
    return true;
  }

  // With rendezvous sends a SEND completes only once the peer has posted the matching RECV.
  bool receiver_posted(const Action& send, double* ready) {
    if (!options_.rendezvous_sends) return true;
    const Action recv = matching_action(send);
    const Cell& peer = cell(recv.stage, recv.micro_batch);
    const double posted = send.type == ActionType::kSendForward ? peer.recv_f : peer.recv_b;
    if (posted == kNotYet) {
      blocked_on_ = format_action(recv) + " on rank " +
                    std::to_string(schedule_.rank_of(recv.stage)) + " (rendezvous send)";
      return false;
    }
    *ready = std::max(*ready, posted);
    return true;
  }

  void record(const Action& a, double start, double end) {
    Cell& c = cell(a.stage, a.micro_batch);
    switch (a.type) {
      case ActionType::kForward:
        c.f = end;
        break;
      case ActionType::kBackward:
        c.bwd = end;
        break;
      case ActionType::kBackwardInput:
        c.bwd = end;
        c.i = end;
        break;
      case ActionType::kBackwardWeight:
        break;
      case ActionType::kRecompute:
        c.r = end;
        break;
      case ActionType::kSendForward:
        c.send_f = start;
        break;
      case ActionType::kRecvForward:
        c.recv_f = start;
        break;
      case ActionType::kSendBackward:
        c.send_b = start;
        break;
      case ActionType::kRecvBackward:
        c.recv_b = start;
        break;
    }
  }

  [[noreturn]] void report_deadlock(const std::vector<size_t>& next) {
    std::vector<std::string> lines;
    for (int r = 0; r < schedule_.ranks_count; ++r) {
      const auto& list = schedule_.actions[r];
      if (next[r] == list.size()) {
        lines.push_back("rank " + std::to_string(r) + " finished its " +
                        std::to_string(list.size()) + " actions");
        continue;
      }
      double ignored = 0.0;
      inputs_ready(r, list[next[r]], &ignored);  // fills blocked_on_
      lines.push_back("rank " + std::to_string(r) + " is blocked at action " +
                      format_action(list[next[r]]) + " (position " + std::to_string(next[r]) +
                      ") waiting for " + blocked_on_);
    }
    PIPEMAT_THROW(ScheduleError,
                  "invalid schedule: rule 'cross-rank deadlock' broken: no rank can "
                  "make progress; ",
                  join(lines, "; "),
                  ". Reorder the lists so that every pass a rank waits for is not behind a pass "
                  "that waits for this rank.");
  }

  const Schedule& schedule_;
  const std::vector<CostModel>& costs_;  // per stage
  const SimulateOptions& options_;
  bool comms_;
  std::vector<Cell> cells_;
  std::string blocked_on_;
};

}  // namespace

CostModel parse_costs(const std::string& text) {
  CostModel c;
  if (trim(text).empty()) return c;
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trim(raw);
    const size_t eq = item.find('=');
    PIPEMAT_CHECK(!item.empty() && eq != std::string::npos, ConfigError, "--costs item '", item,
                  "' is not KEY=VALUE; expected e.g. F=1,I=1,W=1,B=2,R=1,comm=0.");
    std::string key = trim(item.substr(0, eq));
    const std::string value_text = trim(item.substr(eq + 1));
    char* end = nullptr;
    const double value = std::strtod(value_text.c_str(), &end);
    PIPEMAT_CHECK(!value_text.empty() && end && *end == '\0' && std::isfinite(value) && value >= 0,
                  ConfigError, "--costs ", key, "='", value_text,
                  "' is not a non-negative number; expected e.g. ", key, "=1.5.");
    std::string upper = key;
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (upper == "F")
      c.forward = value;
    else if (upper == "B")
      c.backward = value;
    else if (upper == "I")
      c.backward_input = value;
    else if (upper == "W")
      c.backward_weight = value;
    else if (upper == "R")
      c.recompute = value;
    else if (upper == "COMM")
      c.comm = value;
    else if (upper == "BW")
      c.bandwidth = value;
    else if (upper == "BYTES")
      c.message_bytes = value;
    else
      PIPEMAT_THROW(ConfigError, "--costs key '", key,
                    "' is unknown; expected F, B, I, W, R, comm, bw or bytes (e.g. "
                    "F=1,I=1,W=1,B=2,R=1,comm=0.05,bw=5e6,bytes=262144).");
  }
  return c;
}

std::string format_costs(const CostModel& c, RecomputeMode mode) {
  return "F=" + number(c.forward) + ",B=" + number(c.backward_cost()) +
         ",I=" + number(c.backward_input) + ",W=" + number(c.backward_weight) +
         ",R=" + number(c.recompute_cost(mode)) + ",comm=" + number(c.comm) +
         (c.bandwidth > 0 ? ",bw=" + number(c.bandwidth) + ",bytes=" + number(c.message_bytes)
                          : std::string());
}

double span_bubble_ratio(const SimulationResult& result) {
  double worst = 0.0;
  for (const RankTimeline& rank : result.ranks) {
    const double span = rank.last_end - rank.first_start;
    if (span > 0) worst = std::max(worst, 1.0 - rank.busy / span);
  }
  return worst;
}

SimulationResult simulate(const Schedule& schedule, const CostModel& costs,
                          const SimulateOptions& options) {
  return simulate(
      schedule,
      std::vector<CostModel>(static_cast<size_t>(std::max(schedule.stages_count, 0)), costs),
      options);
}

SimulationResult simulate(const Schedule& schedule, const std::vector<CostModel>& stage_costs,
                          const SimulateOptions& options) {
  PIPEMAT_CHECK(
      options.parallel_ranks >= 0 && options.shared_speed > 0 && options.shared_speed <= 1,
      ScheduleError, "simulate: parallel_ranks must be >= 0 (got ", options.parallel_ranks,
      ") and shared_speed in (0, 1] (got ", options.shared_speed, ").");
  PIPEMAT_CHECK(static_cast<int>(stage_costs.size()) == schedule.stages_count, ScheduleError,
                "simulate: ", stage_costs.size(), " stage costs for a schedule of ",
                schedule.stages_count, " stages; give one CostModel per stage.");
  PIPEMAT_CHECK(static_cast<int>(schedule.actions.size()) == schedule.ranks_count &&
                    static_cast<int>(schedule.stage_to_rank.size()) == schedule.stages_count,
                ScheduleError, "simulate: the schedule's shape is inconsistent (",
                schedule.actions.size(), " lists for ", schedule.ranks_count, " ranks, ",
                schedule.stage_to_rank.size(), " stage_to_rank entries for ", schedule.stages_count,
                " stages); run validate_schedule first.");
  PIPEMAT_CHECK(schedule.micro_batches >= 1 &&
                    static_cast<long long>(schedule.stages_count) * schedule.micro_batches <=
                        kMaxStageMicroBatches,
                ScheduleError, "simulate: ", schedule.stages_count, " stages x ",
                schedule.micro_batches, " micro-batches is outside what pipemat handles (1 to ",
                kMaxStageMicroBatches, " pairs).");
  return Simulator(schedule, stage_costs, options).run();
}

}  // namespace pipemat::schedule
