// The stage split by cost: evaluation of one contiguous split and the exact branch and bound of
// Note [Cost split] (plan/include/pipemat/plan/split.h).

#include "pipemat/plan/split.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "internal.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::plan {
namespace {

using detail::StageSums;
using schedule::ActionType;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string split_bytes(double bytes) { return format_bytes(static_cast<int64_t>(bytes)); }

std::string split_text(const std::vector<int>& counts) {
  std::string out;
  for (size_t i = 0; i < counts.size(); ++i) out += (i ? "," : "") + std::to_string(counts[i]);
  return out;
}

void check_value(const std::string& layer, const std::string& field, double value) {
  PIPEMAT_CHECK(std::isfinite(value) && value >= 0, ConfigError, "split: layer '", layer, "' ",
                field, " must be a finite number >= 0, got ", value, ".");
}

void check_layers(const SplitProblem& problem, const schedule::Schedule& schedule) {
  const int stages = schedule.stages_count;
  PIPEMAT_CHECK(static_cast<int>(problem.layers.size()) >= stages, ConfigError,
                "split: ", problem.layers.size(), " layers cannot fill ", stages, " stages (",
                schedule.ranks_count, " ranks x ", schedule.virtual_stages,
                " virtual stages); every stage needs at least one layer.");
  for (size_t k = 0; k < problem.stages_without_replay.size(); ++k) {
    const int s = problem.stages_without_replay[k];
    PIPEMAT_CHECK(s >= 0 && s < stages && (k == 0 || s > problem.stages_without_replay[k - 1]),
                  ConfigError, "split: stages_without_replay must be ascending stages below ",
                  stages, ", got ", s, " at index ", k, ".");
  }
  const bool without_replay = !problem.stages_without_replay.empty();
  for (const LayerCost& l : problem.layers) {
    for (const Candidate* c : {&l.cost, without_replay ? &l.without_replay : nullptr}) {
      if (c == nullptr) continue;
      const std::string in = c == &l.cost ? "" : "without_replay.";
      check_value(l.layer, in + "forward", c->forward);
      check_value(l.layer, in + "backward_input", c->backward_input);
      check_value(l.layer, in + "backward_weight", c->backward_weight);
      check_value(l.layer, in + "recompute", c->recompute);
      check_value(l.layer, in + "backward", c->backward);
      check_value(l.layer, in + "resident_bytes", c->resident_bytes);
      check_value(l.layer, in + "replayed_bytes", c->replayed_bytes);
      check_value(l.layer, in + "forward_temporary_bytes", c->forward_temporary_bytes);
      check_value(l.layer, in + "recompute_temporary_bytes", c->recompute_temporary_bytes);
      check_value(l.layer, in + "backward_temporary_bytes", c->backward_temporary_bytes);
    }
    check_value(l.layer, "fixed_bytes", l.fixed_bytes);
  }
  PIPEMAT_CHECK(std::isfinite(problem.message_cost) && problem.message_cost >= 0, ConfigError,
                "split: message_cost must be a finite number >= 0, got ", problem.message_cost,
                ".");
  PIPEMAT_CHECK(
      problem.parallel_ranks >= 0 && problem.shared_speed > 0 && problem.shared_speed <= 1,
      ConfigError, "split: parallel_ranks must be >= 0 (got ", problem.parallel_ranks,
      ") and shared_speed in (0, 1] (got ", problem.shared_speed, ").");
  PIPEMAT_CHECK(problem.budget_bytes.empty() ||
                    problem.budget_bytes.size() == static_cast<size_t>(schedule.ranks_count),
                ConfigError, "split: ", problem.budget_bytes.size(), " budgets for ",
                schedule.ranks_count, " ranks; give one per rank or none.");
  for (double b : problem.budget_bytes)
    PIPEMAT_CHECK(!std::isnan(b) && b >= 0, ConfigError,
                  "split: budget_bytes must be numbers >= 0, got ", b, ".");
}

void check_split(const SplitProblem& problem, const schedule::Schedule& schedule,
                 const std::vector<int>& counts, const char* what) {
  PIPEMAT_CHECK(counts.size() == static_cast<size_t>(schedule.stages_count), ConfigError,
                "split: ", what, " has ", counts.size(), " stages but the schedule has ",
                schedule.stages_count, ".");
  long long total = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    PIPEMAT_CHECK(counts[s] >= 1, ConfigError, "split: ", what, " gives stage ", s, " ", counts[s],
                  " layers; every stage needs at least one.");
    total += counts[s];
  }
  PIPEMAT_CHECK(total == static_cast<long long>(problem.layers.size()), ConfigError,
                "split: ", what, " covers ", total, " layers but the model has ",
                problem.layers.size(), ".");
}

// Everything the search keeps: the schedule, its peak forms, what each stage's actions add up to
// per unit of F, I, W, R and B (for the busy bound), and the best split so far.
struct SplitSearch {
  const SplitProblem& problem;
  schedule::Schedule schedule;
  PlanProblem plan;  // for detail::step_time (no tails; shared cores as the problem says)
  std::vector<detail::PeakForms> forms;
  // Per stage: how many times its F, I, W, R and B run (lazy recompute adds R to each B and I).
  struct Counts {
    double f = 0, i = 0, w = 0, r = 0, b = 0;
  };
  std::vector<Counts> action_counts;
  std::vector<double> least_work;    // per layer: its smallest work on any stage
  std::vector<bool> without_replay;  // per stage: its layers cost LayerCost::without_replay
  bool budgeted = false;
  long long simulations = 0;

  std::vector<int> split;  // layers per stage, the open ones 0
  std::vector<StageSums> sums;
  std::vector<double> fixed;  // per rank: the fixed bytes of its layers so far

  // Step search.
  bool found = false;
  std::vector<int> best;
  double best_step = kInf;
  // Overshoot search (no split fits).
  double best_over = kInf;

  explicit SplitSearch(const SplitProblem& p)
      : problem(p), schedule(schedule::build_schedule(p.schedule)) {
    plan.schedule = p.schedule;
    plan.parallel_ranks = p.parallel_ranks;
    plan.shared_speed = p.shared_speed;
    check_layers(p, schedule);
    for (int r = 0; r < schedule.ranks_count; ++r)
      forms.push_back(detail::peak_forms(schedule, r, {}));
    action_counts.resize(schedule.stages_count);
    const bool lazy = schedule.recompute == schedule::RecomputeMode::kLazy;
    for (const auto& list : schedule.actions)
      for (const schedule::Action& a : list) {
        Counts& c = action_counts[a.stage];
        switch (a.type) {
          case ActionType::kForward:
            c.f += 1;
            break;
          case ActionType::kBackward:
            c.b += 1;
            c.r += lazy ? 1 : 0;
            break;
          case ActionType::kBackwardInput:
            c.i += 1;
            c.r += lazy ? 1 : 0;
            break;
          case ActionType::kBackwardWeight:
            c.w += 1;
            break;
          case ActionType::kRecompute:
            c.r += 1;
            break;
          default:
            break;
        }
      }
    without_replay.assign(schedule.stages_count, false);
    for (int s : p.stages_without_replay) without_replay[s] = true;
    for (size_t l = 0; l < p.layers.size(); ++l) {
      double least = kInf;
      for (int s = 0; s < schedule.stages_count; ++s) {
        StageSums one;
        one.add(cost_on(s, l));
        least = std::min(least, work(s, one));
      }
      least_work.push_back(least);
    }
    budgeted = !p.budget_bytes.empty();
    reset();
  }

  void reset() {
    split.assign(schedule.stages_count, 0);
    sums.assign(schedule.stages_count, StageSums{});
    fixed.assign(schedule.ranks_count, 0.0);
  }

  // Layer `l`'s cost on `stage`.
  const Candidate& cost_on(int stage, size_t l) const {
    return without_replay[stage] ? problem.layers[l].without_replay : problem.layers[l].cost;
  }

  // Note [Shared cores]: fewer ranks compute at once than there are.
  bool shared_cores() const {
    return problem.parallel_ranks > 0 && problem.parallel_ranks < schedule.ranks_count;
  }

  double work(int stage, const StageSums& s) const {
    const Counts& c = action_counts[stage];
    return c.f * s.forward + c.i * s.backward_input + c.w * s.backward_weight + c.r * s.recompute +
           c.b * s.backward;
  }

  std::vector<schedule::CostModel> costs() const {
    std::vector<schedule::CostModel> out;
    for (const StageSums& s : sums) out.push_back(s.costs(problem.message_cost));
    return out;
  }

  double step() {
    ++simulations;
    return detail::step_time(plan, schedule, costs());
  }

  // The step with each open stage at the least it can hold (Note [Cost split]): stage k holds
  // one layer or more of [lo, hi], where lo leaves a layer to each open stage before it and hi
  // one to each after it (the first open stage holds `first`, the last the model's last layer),
  // so it costs at least the smallest F, I, W, R and B of that window.
  double open_bound(int next_stage, size_t first) {
    const int stages = schedule.stages_count;
    const size_t layers = problem.layers.size();
    for (int k = next_stage; k < stages; ++k) {
      size_t lo = first + static_cast<size_t>(k - next_stage);
      size_t hi = layers - static_cast<size_t>(stages - k);
      if (k == stages - 1) lo = layers - 1;
      if (k == next_stage) lo = hi = first;
      StageSums least;
      least.forward = least.backward_input = least.backward_weight = least.recompute =
          least.backward = kInf;
      for (size_t l = lo; l <= hi; ++l) {
        StageSums one;
        one.add(cost_on(k, l));
        least.forward = std::min(least.forward, one.forward);
        least.backward_input = std::min(least.backward_input, one.backward_input);
        least.backward_weight = std::min(least.backward_weight, one.backward_weight);
        least.recompute = std::min(least.recompute, one.recompute);
        least.backward = std::min(least.backward, one.backward);
      }
      sums[k] = least;
    }
    const double bound = step();
    for (int k = next_stage; k < stages; ++k) sums[k] = StageSums{};
    return bound;
  }

  double peak(int rank) const { return fixed[rank] + forms[rank].peak(sums); }

  // The largest overshoot over the ranks (peak - budget) with the open stages empty.
  double overshoot() const {
    double worst = -kInf;
    for (int r = 0; r < schedule.ranks_count; ++r)
      worst = std::max(worst, peak(r) - problem.budget_bytes[r]);
    return worst;
  }

  // Busy bound (Note [Cost split]): the fixed stages' busy time per rank, then the open layers'
  // least work poured over the ranks of the open stages.
  double busy_bound(int next_stage, size_t next_layer) const {
    std::vector<double> busy(schedule.ranks_count, 0.0);
    for (int s = 0; s < next_stage; ++s) busy[schedule.rank_of(s)] += work(s, sums[s]);
    double top = *std::max_element(busy.begin(), busy.end());
    double rest = 0;
    for (size_t l = next_layer; l < least_work.size(); ++l) rest += least_work[l];
    std::vector<bool> open(schedule.ranks_count, false);
    for (int s = next_stage; s < schedule.stages_count; ++s) open[schedule.rank_of(s)] = true;
    std::vector<double> levels;
    for (int r = 0; r < schedule.ranks_count; ++r)
      if (open[r]) levels.push_back(busy[r]);
    if (levels.empty() || rest <= 0) return top;
    std::sort(levels.begin(), levels.end());
    // Raise the lowest k levels together until the rest is spent.
    double level = levels[0];
    for (size_t k = 1; k <= levels.size(); ++k) {
      const double next = k < levels.size() ? levels[k] : kInf;
      const double room = (next - level) * static_cast<double>(k);
      if (rest <= room) {
        level += rest / static_cast<double>(k);
        break;
      }
      rest -= room;
      level = next;
    }
    return std::max(top, level);
  }

  bool fits_so_far() const {
    for (int r = 0; r < schedule.ranks_count; ++r)
      if (peak(r) > problem.budget_bytes[r]) return false;
    return true;
  }

  void place(int stage, size_t first, int count) {
    split[stage] = count;
    for (int k = 0; k < count; ++k) {
      sums[stage].add(cost_on(stage, first + k));
      fixed[schedule.rank_of(stage)] += problem.layers[first + k].fixed_bytes;
    }
  }
  void unplace(int stage, size_t first, int count) {
    split[stage] = 0;
    sums[stage] = StageSums{};
    for (int k = 0; k < count; ++k)
      fixed[schedule.rank_of(stage)] -= problem.layers[first + k].fixed_bytes;
  }

  // Splits in lexicographic order of their counts; `first` is the next open layer.
  void descend_step(int stage, size_t first) {
    const int stages = schedule.stages_count;
    const size_t layers = problem.layers.size();
    if (stage == stages) {
      if (budgeted && !fits_so_far()) return;
      const double s = step();
      if (s < best_step || (s == best_step && split < best)) {
        best_step = s;
        best = split;
        found = true;
      }
      return;
    }
    const int most = static_cast<int>(layers - first) - (stages - stage - 1);
    if (stage == stages - 1) {
      place(stage, first, most);
      descend_step(stage + 1, layers);
      unplace(stage, first, most);
      return;
    }
    for (int count = 1; count <= most; ++count) {
      place(stage, first, count);
      const size_t next = first + count;
      bool cut = budgeted && !fits_so_far();
      // Cut only above the best: an equal completion may still win the tie.
      if (!cut) cut = busy_bound(stage + 1, next) > best_step;
      if (!cut && !shared_cores()) cut = open_bound(stage + 1, next) > best_step;
      if (!cut) descend_step(stage + 1, next);
      unplace(stage, first, count);
    }
  }

  // The split whose largest overshoot is smallest (used when none fits).
  void descend_over(int stage, size_t first) {
    const int stages = schedule.stages_count;
    const size_t layers = problem.layers.size();
    if (stage == stages) {
      const double o = overshoot();
      if (o < best_over) {
        best_over = o;
        best = split;
      }
      return;
    }
    const int least = stage == stages - 1 ? static_cast<int>(layers - first) : 1;
    const int most = static_cast<int>(layers - first) - (stages - stage - 1);
    for (int count = least; count <= most; ++count) {
      place(stage, first, count);
      if (overshoot() < best_over) descend_over(stage + 1, first + count);
      unplace(stage, first, count);
    }
  }

  // The split minimising the largest stage's work (the seed), by dynamic programming over
  // (stages, layers); ties to the earlier boundary.
  std::vector<int> balanced_seed() const {
    const int stages = schedule.stages_count;
    const int layers = static_cast<int>(problem.layers.size());
    // cost[s][n]: the smallest largest work of stages 0..s holding layers 0..n-1.
    std::vector<std::vector<double>> cost(stages, std::vector<double>(layers + 1, kInf));
    std::vector<std::vector<int>> cut(stages, std::vector<int>(layers + 1, 0));
    auto stage_work = [&](int s, int from, int to) {
      StageSums sum;
      for (int l = from; l < to; ++l) sum.add(cost_on(s, static_cast<size_t>(l)));
      return work(s, sum);
    };
    for (int n = 1; n <= layers; ++n) cost[0][n] = stage_work(0, 0, n);
    for (int s = 1; s < stages; ++s)
      for (int n = s + 1; n <= layers; ++n)
        for (int m = s; m < n; ++m) {
          const double c = std::max(cost[s - 1][m], stage_work(s, m, n));
          if (c < cost[s][n]) {
            cost[s][n] = c;
            cut[s][n] = m;
          }
        }
    std::vector<int> out(stages);
    int n = layers;
    for (int s = stages - 1; s > 0; --s) {
      out[s] = n - cut[s][n];
      n = cut[s][n];
    }
    out[0] = n;
    return out;
  }

  // Moves one boundary by one layer while that shortens the best step (a tighter start for the
  // bound; the search stays exact whatever the start).
  void improve() {
    bool better = true;
    while (better) {
      better = false;
      for (size_t b = 0; b + 1 < best.size() && !better; ++b)
        for (int delta : {-1, 1}) {
          std::vector<int> next = best;
          next[b] += delta;
          next[b + 1] -= delta;
          if (next[b] < 1 || next[b + 1] < 1) continue;
          load(next);
          if (budgeted && !fits_so_far()) continue;
          const double s = step();
          if (s < best_step) {
            best_step = s;
            best = next;
            better = true;
            break;
          }
        }
    }
  }

  // Loads a full split into the sums.
  void load(const std::vector<int>& counts) {
    reset();
    size_t first = 0;
    for (size_t s = 0; s < counts.size(); ++s) {
      place(static_cast<int>(s), first, counts[s]);
      first += counts[s];
    }
  }

  SplitResult result(const std::vector<int>& counts) {
    load(counts);
    SplitResult out;
    out.layers_per_stage = counts;
    out.step = step();
    for (int r = 0; r < schedule.ranks_count; ++r) out.peak_bytes.push_back(peak(r));
    return out;
  }
};

}  // namespace

SplitResult evaluate_split(const SplitProblem& problem, const std::vector<int>& layers_per_stage) {
  SplitSearch search(problem);
  check_split(problem, search.schedule, layers_per_stage, "the split");
  SplitResult out = search.result(layers_per_stage);
  out.simulations = search.simulations;
  return out;
}

SplitResult choose_split(const SplitProblem& problem) {
  SplitSearch search(problem);
  if (!problem.reference.empty())
    check_split(problem, search.schedule, problem.reference, "the reference split");

  const std::vector<int> seed = search.balanced_seed();
  search.load(seed);
  if (!search.budgeted || search.fits_so_far()) {
    search.best = seed;
    search.best_step = search.step();
    search.found = true;
  }
  if (search.found) search.improve();
  search.reset();
  search.descend_step(0, 0);

  if (!search.found) {
    search.reset();
    search.descend_over(0, 0);
    search.load(search.best);
    int worst = 0;
    for (int r = 1; r < search.schedule.ranks_count; ++r)
      if (search.peak(r) - problem.budget_bytes[r] >
          search.peak(worst) - problem.budget_bytes[worst])
        worst = r;
    PIPEMAT_CHECK(false, ConfigError, "split: no contiguous split of the ", problem.layers.size(),
                  " layers on ", search.schedule.stages_count,
                  " stages fits the memory budget; the closest (layers per stage ",
                  split_text(search.best), ") peaks at ", split_bytes(search.peak(worst)),
                  " on rank ", worst, ", whose budget is ",
                  split_bytes(problem.budget_bytes[worst]), ".");
  }

  const long long simulations = search.simulations;
  SplitResult out = search.result(search.best);
  out.simulations = simulations;
  if (!problem.reference.empty()) out.reference_step = search.result(problem.reference).step;
  return out;
}

}  // namespace pipemat::plan
