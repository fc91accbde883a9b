// Generators: compute-only per-rank lists (F, B, I, W) for each schedule kind.

#include <algorithm>
#include <deque>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::schedule {
namespace {

constexpr int kMaxRanks = 1024;
constexpr int kMaxMicroBatches = 65536;
constexpr int kMaxVirtual = 64;

Action make(int stage, ActionType type, int mb) { return Action{stage, type, mb}; }

Schedule empty_schedule(const ScheduleOptions& o, int virtual_stages, StageLayout layout) {
  Schedule s;
  s.kind = o.kind;
  s.ranks_count = o.ranks;
  s.virtual_stages = virtual_stages;
  s.stages_count = o.ranks * virtual_stages;
  s.micro_batches = o.micro_batches;
  s.layout = layout;
  s.recompute = RecomputeMode::kNone;
  s.stage_to_rank = layout == StageLayout::kV ? v_stage_to_rank(o.ranks)
                                              : loop_stage_to_rank(o.ranks, s.stages_count);
  s.actions.assign(o.ranks, {});
  return s;
}

// GPipe: all forwards, then all backwards in micro-batch order (torch ScheduleGPipe).
void gpipe(Schedule& s) {
  for (int r = 0; r < s.ranks_count; ++r) {
    auto& list = s.actions[r];
    for (int i = 0; i < s.micro_batches; ++i) list.push_back(make(r, ActionType::kForward, i));
    for (int i = 0; i < s.micro_batches; ++i) list.push_back(make(r, ActionType::kBackward, i));
  }
}

// 1F1B (PipeDream-flush, Megatron order): warmup min(P - r - 1, M) forwards, then steady
// {F(next), B(oldest)}, then cooldown backwards.
void one_f_one_b(Schedule& s) {
  const int p = s.ranks_count, m = s.micro_batches;
  for (int r = 0; r < p; ++r) {
    auto& list = s.actions[r];
    const int warmup = std::min(p - r - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) list.push_back(make(r, ActionType::kForward, f));
    while (f < m) {
      list.push_back(make(r, ActionType::kForward, f++));
      list.push_back(make(r, ActionType::kBackward, b++));
    }
    while (b < m) list.push_back(make(r, ActionType::kBackward, b++));
  }
}

// Interleaved 1F1B (Megatron get_schedule_table / torch ScheduleInterleaved1F1B): micro-batches
// go in rounds of `per_round`; within a round every chunk runs the round's micro-batches in
// turn (forwards in chunk order, backwards in reverse chunk order). Warmup on rank r is
// (V - 1) * per_round + 2 * (P - 1 - r) forwards; the factor 2 keeps every rank busy in the
// steady state.
void interleaved(Schedule& s) {
  const int p = s.ranks_count, m = s.micro_batches, v = s.virtual_stages;
  const int rounds = std::max(1, m / p);
  const int per_round = m / rounds;
  const int total = m * v;
  for (int r = 0; r < p; ++r) {
    auto& list = s.actions[r];
    auto fwd = [&](int k) {
      const int chunk = (k / per_round) % v;
      const int mb = (k / (per_round * v)) * per_round + k % per_round;
      return make(chunk * p + r, ActionType::kForward, mb);
    };
    auto bwd = [&](int k) {
      const int chunk = v - 1 - (k / per_round) % v;
      const int mb = (k / (per_round * v)) * per_round + k % per_round;
      return make(chunk * p + r, ActionType::kBackward, mb);
    };
    const int warmup = std::min(total, (v - 1) * per_round + 2 * (p - 1 - r));
    int f = 0, b = 0;
    for (; f < warmup; ++f) list.push_back(fwd(f));
    while (f < total) {
      list.push_back(fwd(f++));
      list.push_back(bwd(b++));
    }
    while (b < total) list.push_back(bwd(b++));
  }
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the 1F1B order with B split into I and
// W. Rank r delays its W passes by r steady iterations, so every rank holds at most P
// micro-batches that are not W'd yet, and the trailing W's fill the cooldown bubble.
void zero_bubble_h1(Schedule& s) {
  const int p = s.ranks_count, m = s.micro_batches;
  for (int r = 0; r < p; ++r) {
    auto& list = s.actions[r];
    const int warmup = std::min(p - r - 1, m);
    int f = 0, i = 0, w = 0, steady = 0;
    for (; f < warmup; ++f) list.push_back(make(r, ActionType::kForward, f));
    while (f < m) {
      list.push_back(make(r, ActionType::kForward, f++));
      list.push_back(make(r, ActionType::kBackwardInput, i++));
      if (steady++ >= r) list.push_back(make(r, ActionType::kBackwardWeight, w++));
    }
    while (i < m) {
      list.push_back(make(r, ActionType::kBackwardInput, i++));
      list.push_back(make(r, ActionType::kBackwardWeight, w++));
    }
    while (w < m) list.push_back(make(r, ActionType::kBackwardWeight, w++));
  }
}

// ZB-H2: a unit-time list schedule. At each step a rank runs, in priority order, the next I
// whose gradient has arrived, else the next F whose input has arrived while fewer than 2P - 1
// micro-batches are in flight, else its oldest pending W. Warmup therefore fills with extra
// forwards (up to 2P - 1 in flight on rank 0) and the W's move into the tail, which turns the
// 1F1B trapezoid into a parallelogram.
void zero_bubble_h2(Schedule& s) {
  const int p = s.ranks_count, m = s.micro_batches;
  const int cap = 2 * p - 1;
  constexpr int kNotDone = -1;
  std::vector<std::vector<int>> f_done(p, std::vector<int>(m, kNotDone));
  std::vector<std::vector<int>> i_done(p, std::vector<int>(m, kNotDone));
  std::vector<int> next_f(p, 0), next_i(p, 0), in_flight(p, 0);
  std::vector<std::deque<int>> pending_w(p);
  int remaining = 3 * p * m;
  for (int t = 0; remaining > 0; ++t) {
    PIPEMAT_INTERNAL_ASSERT(t <= 8 * (p + m) * 3, "zb-h2 list scheduler made no progress");
    auto ready = [t](int done) { return done != kNotDone && done < t; };
    for (int r = 0; r < p; ++r) {
      auto& list = s.actions[r];
      const int ni = next_i[r], nf = next_f[r];
      if (ni < m && ready(f_done[r][ni]) && (r == p - 1 || ready(i_done[r + 1][ni]))) {
        list.push_back(make(r, ActionType::kBackwardInput, ni));
        i_done[r][ni] = t;
        pending_w[r].push_back(ni);
        ++next_i[r];
      } else if (nf < m && in_flight[r] < cap && (r == 0 || ready(f_done[r - 1][nf]))) {
        list.push_back(make(r, ActionType::kForward, nf));
        f_done[r][nf] = t;
        ++in_flight[r];
        ++next_f[r];
      } else if (!pending_w[r].empty()) {
        list.push_back(make(r, ActionType::kBackwardWeight, pending_w[r].front()));
        pending_w[r].pop_front();
        --in_flight[r];
      } else {
        continue;
      }
      --remaining;
    }
  }
}

// ZB-V: rank r holds stage r (chunk 0) and stage 2P - 1 - r (chunk 1). The order is torch's
// ScheduleZBVZeroBubble._calculate_single_rank_operations; it is generated for
// max(2P - 1, M) micro-batches and the ones >= M are dropped.
void zero_bubble_v(Schedule& s) {
  const int p = s.ranks_count, m = s.micro_batches;
  const int n = std::max(2 * p - 1, m);
  for (int r = 0; r < p; ++r) {
    std::vector<Action> ops;
    const int c0 = r, c1 = 2 * p - 1 - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto add = [&ops](int stage, ActionType type, int mb) { ops.push_back(make(stage, type, mb)); };
    for (int k = 0; k < 2 * (p - r) - 1; ++k) add(c0, ActionType::kForward, f0++);
    for (int k = 0; k < r; ++k) {
      add(c1, ActionType::kForward, f1++);
      add(c0, ActionType::kForward, f0++);
    }
    for (int k = 0; k < p - r; ++k) {
      add(c1, ActionType::kForward, f1++);
      add(c1, ActionType::kBackwardInput, b1);
      add(c1, ActionType::kBackwardWeight, b1++);
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) add(c0, ActionType::kForward, f0++);
      add(c0, ActionType::kBackwardInput, b0);
      add(c0, ActionType::kBackwardWeight, b0++);
      add(c1, ActionType::kForward, f1++);
      add(c1, ActionType::kBackwardInput, b1);
      add(c1, ActionType::kBackwardWeight, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int k = 0; k < r; ++k) {
      add(c0, ActionType::kBackwardInput, b0++);
      add(c1, ActionType::kBackwardInput, b1++);
    }
    for (int k = 0; k < p - r; ++k) {
      add(c0, ActionType::kBackwardInput, b0++);
      add(c0, ActionType::kBackwardWeight, w0++);
    }
    while (w1 < b1) add(c1, ActionType::kBackwardWeight, w1++);
    while (w0 < b0) add(c0, ActionType::kBackwardWeight, w0++);
    PIPEMAT_INTERNAL_ASSERT(w0 == b0 && b0 == f0 && w1 == b1 && b1 == f1,
                            "zb-v order lost a micro-batch on rank ", r);
    for (const Action& a : ops) {
      if (a.micro_batch < m) s.actions[r].push_back(a);
    }
  }
}

void check_range(int value, int lo, int hi, const char* flag, const char* what) {
  PIPEMAT_CHECK(value >= lo && value <= hi, ConfigError, flag, " (", what, ") must be in [", lo,
                ", ", hi, "], found ", value, ".");
}

}  // namespace

Schedule generate_schedule(const ScheduleOptions& o) {
  check_range(o.ranks, 1, kMaxRanks, "--ranks", "number of pipeline ranks");
  check_range(o.micro_batches, 1, kMaxMicroBatches, "--micro-batches", "micro-batches per step");
  check_range(o.virtual_stages, 1, kMaxVirtual, "--virtual", "stages per rank");
  const int p = o.ranks, m = o.micro_batches, v = o.virtual_stages;
  const long long stages =
      static_cast<long long>(p) * (o.kind == ScheduleKind::kZeroBubbleV ? 2 : v);
  PIPEMAT_CHECK(stages * m <= kMaxStageMicroBatches, ConfigError, "--ranks ", p, " x --virtual ", v,
                " x --micro-batches ", m, " = ", stages * m,
                " (stage, micro-batch) pairs is more than the ", kMaxStageMicroBatches,
                " pipemat schedules; use fewer micro-batches or stages.");
  switch (o.kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::kOneFOneB:
    case ScheduleKind::kZeroBubbleH1:
    case ScheduleKind::kZeroBubbleH2: {
      PIPEMAT_CHECK(v == 1, ConfigError, "--kind ", to_string(o.kind),
                    " runs one stage per rank, but --virtual is ", v,
                    ". Use --kind interleaved for ", v, " chunks per rank, or drop --virtual.");
      Schedule s = empty_schedule(o, 1, StageLayout::kLoop);
      if (o.kind == ScheduleKind::kGPipe) gpipe(s);
      if (o.kind == ScheduleKind::kOneFOneB) one_f_one_b(s);
      if (o.kind == ScheduleKind::kZeroBubbleH1) zero_bubble_h1(s);
      if (o.kind == ScheduleKind::kZeroBubbleH2) zero_bubble_h2(s);
      return s;
    }
    case ScheduleKind::kInterleaved: {
      Schedule s = empty_schedule(o, v, StageLayout::kLoop);
      if (v == 1) {
        one_f_one_b(s);
        return s;
      }
      const int rounds = std::max(1, m / p);
      if (m % rounds != 0) {
        // Nearest micro-batch counts that split into equal rounds of >= P.
        int below = m - 1, above = m + 1;
        while (below >= 1 && below % std::max(1, below / p) != 0) --below;
        while (above % std::max(1, above / p) != 0) ++above;
        PIPEMAT_THROW(ConfigError, "--kind interleaved with --ranks ", p, " runs micro-batches in ",
                      rounds, " rounds of at least ", p,
                      " (one per rank), so --micro-batches must "
                      "split into equal rounds; ",
                      m, " does not (", m, " % ", rounds, " = ", m % rounds,
                      "). Use --micro-batches ", below, " or ", above, " (any multiple of ", p,
                      " works).");
      }
      interleaved(s);
      return s;
    }
    case ScheduleKind::kZeroBubbleV: {
      PIPEMAT_CHECK(v == 1 || v == 2, ConfigError,
                    "--kind zb-v places exactly two stages per rank in a V, but --virtual is ", v,
                    ". Drop --virtual (or pass 2); use --kind interleaved for ", v,
                    " chunks per rank.");
      Schedule s = empty_schedule(o, 2, StageLayout::kV);
      zero_bubble_v(s);
      return s;
    }
    case ScheduleKind::kImported:
      PIPEMAT_THROW(ConfigError,
                    "kind 'imported' has no generator; read the schedule with "
                    "import_torch_csv (`--import FILE.csv`) instead.");
  }
  PIPEMAT_INTERNAL_ASSERT(false, "unhandled ScheduleKind");
  return {};
}

}  // namespace pipemat::schedule
