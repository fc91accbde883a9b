// The exact plan search (Note [Plan search]) and the evaluation of one assignment.
//
// Note [Plan search]
// ~~~~~~~~~~~~~~~~~~
// Both what is limited and what is minimised are monotone in a stage's sums: a rank's peak does
// not fall when a stage's resident or replayed bytes grow (Note [Plan memory]), and with a core
// per rank the simulated step does not fall when any stage's F, I, W, R or B grows (a longest
// path over a DAG whose order the schedule fixes). So the search keeps only non-dominated partial
// sums and stays exact:
//   1. per stage, a dynamic programme over its layers keeps the assignments whose sums
//      (resident, replayed, F, I, W, R, B; the largest temporaries of F, R and B) no other
//      assignment beats or equals in all ten; equal layers collapse here, since their
//      permutations reach equal sums;
//   2. per rank, the product of its stages' frontiers, filtered by the budget, keeps the options
//      no other fitting option beats in every stage time (ties: the smaller peak);
//   3. across ranks, branch and bound: ranks are fixed one at a time, and the step simulated
//      with every unfixed rank at the per-component minimum of its options bounds every
//      completion from below; a branch whose bound exceeds the best step found is cut.
// When ranks slow each other down (shared cores or a shared speed below 1, Note [Plan step]) a
// leaf's step is simulated with them, and the bound of step 3 is the full-speed step (no action
// then starts earlier or runs faster) raised, with shared cores, to the summed busy time over the
// cores: still a lower bound, so step 3 stays exact. Steps 1 and 2 then assume that a stage that
// is slower in every time never makes the step shorter, which sharing can break by a little (a
// slower action can move another rank's work out of a contended stretch); the plan is then the
// best of the assignments they keep. With a shared speed below 1 the full-speed bound is loose,
// so the search may simulate as many steps as enumeration would (tests: under twice as many).
// Cost: step 1 is O(layers x candidates x frontier^2) per stage; the frontier is at most
// candidates^layers, and the multiset count C(candidates + layers - 1, layers) when the layers
// are equal. Step 3 simulates at most the product of the ranks' option counts, far fewer in
// practice since the bound cuts most branches (PlanResult::simulations says how many ran).

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "internal.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::plan {
namespace {

using detail::PeakForms;
using detail::StageSums;

// The pairwise dominance filter is quadratic: a stage whose assignments grow past this stops the
// search with an error instead of running for minutes.
constexpr size_t kMaxFrontier = 20000;

constexpr size_t kTimes = 5;  // F, I, W, R, B of a stage in RankOption::times

bool shares_cores(const PlanProblem& problem, const schedule::Schedule& schedule) {
  return problem.parallel_ranks > 0 && problem.parallel_ranks < schedule.ranks_count;
}

// The step of Note [Plan step] once every rank's last action has ended.
double with_tails(const PlanProblem& problem, const schedule::SimulationResult& result) {
  double step = 0.0, ends = 0.0, tails = 0.0;
  for (const schedule::RankTimeline& rank : result.ranks) {
    const size_t r = static_cast<size_t>(rank.rank);
    const double tail = r < problem.step_tail.size() ? problem.step_tail[r] : 0.0;
    step = std::max(step, rank.last_end + tail);
    ends = std::max(ends, rank.last_end);
    tails = std::max(tails, tail);
  }
  return problem.tails_wait_for_all ? ends + problem.message_cost + tails : step;
}

// A lower bound of the step for `costs` that is monotone in them (Note [Plan search]): the step
// with every rank on its own cores and, when the ranks share cores, their summed busy time over
// the cores (no more than `parallel_ranks` ranks' work is done per unit of time).
double step_bound(const PlanProblem& problem, const schedule::Schedule& schedule,
                  const std::vector<schedule::CostModel>& costs) {
  const schedule::SimulationResult own = schedule::simulate(schedule, costs);
  double step = with_tails(problem, own);
  if (shares_cores(problem, schedule)) {
    double busy = 0.0;
    for (const schedule::RankTimeline& rank : own.ranks) busy += rank.busy;
    step = std::max(step, busy / problem.parallel_ranks);
  }
  return step;
}

std::string bytes_text(double bytes) { return format_bytes(static_cast<int64_t>(bytes)); }

std::vector<double> sums_vector(const StageSums& s) {
  return {
      s.resident,  s.replayed, s.forward,           s.backward_input,      s.backward_weight,
      s.recompute, s.backward, s.forward_temporary, s.recompute_temporary, s.backward_temporary};
}

// a <= b in every component.
bool no_worse(const std::vector<double>& a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] > b[i]) return false;
  return true;
}

struct Partial {
  StageSums sums;
  std::vector<int> choice;  // candidate per layer of the stage, in layer order
};

// Step 1: the non-dominated assignments of one stage's layers.
std::vector<Partial> stage_frontier(const PlanProblem& problem, const std::vector<int>& layers,
                                    int stage) {
  std::vector<Partial> frontier(1);
  for (int layer : layers) {
    std::vector<Partial> grown;
    const auto& candidates = problem.layers[layer].candidates;
    for (const Partial& p : frontier) {
      for (size_t c = 0; c < candidates.size(); ++c) {
        Partial next = p;
        next.sums.add(candidates[c]);
        next.choice.push_back(static_cast<int>(c));
        grown.push_back(std::move(next));
      }
    }
    PIPEMAT_CHECK(grown.size() <= kMaxFrontier, ConfigError, "plan: stage ", stage, " has ",
                  grown.size(), " assignments to compare at layer '", problem.layers[layer].layer,
                  "' (limit ", kMaxFrontier, "); profile fewer candidates per layer.");
    std::vector<std::vector<double>> keys;
    for (const Partial& p : grown) keys.push_back(sums_vector(p.sums));
    frontier.clear();
    for (size_t i = 0; i < grown.size(); ++i) {
      bool dominated = false;
      for (size_t j = 0; j < grown.size() && !dominated; ++j) {
        if (i == j || !no_worse(keys[j], keys[i])) continue;
        // j is no worse everywhere: i goes when j is strictly better somewhere, or equal and first.
        dominated = keys[j] != keys[i] || j < i;
      }
      if (!dominated) frontier.push_back(std::move(grown[i]));
    }
  }
  return frontier;
}

// One fitting way to run a rank: a frontier entry per stage of the rank.
struct RankOption {
  std::vector<size_t> entry;  // index into each of the rank's stage frontiers
  std::vector<double> times;  // F, I, W, R, B of each of the rank's stages
  double peak = 0.0;          // fixed bytes included
  double total_time = 0.0;
};

struct Search {
  const PlanProblem& problem;
  const schedule::Schedule& schedule;
  std::vector<std::vector<Partial>> frontiers;    // per model stage
  std::vector<std::vector<RankOption>> options;   // per rank, fitting and non-dominated
  std::vector<std::vector<double>> rank_minimum;  // per rank: per-component minimum times
  std::vector<std::vector<int>> rank_stages;      // per rank: its model stages, ascending
  std::vector<size_t> fixed;                      // per rank: chosen option while searching
  std::vector<size_t> best;
  double best_step = 0.0, best_bytes = 0.0;
  bool found = false;
  long long simulations = 0;

  // The stage costs with ranks below `fixed_ranks` at their chosen option and the others at
  // their per-component minimum (the bound of Note [Plan search]).
  std::vector<schedule::CostModel> stage_costs(int fixed_ranks) const {
    std::vector<schedule::CostModel> costs(schedule.stages_count);
    for (int r = 0; r < schedule.ranks_count; ++r) {
      const std::vector<double>& t = r < fixed_ranks ? options[r][fixed[r]].times : rank_minimum[r];
      for (size_t s = 0; s < rank_stages[r].size(); ++s) {
        StageSums sums;
        sums.forward = t[kTimes * s];
        sums.backward_input = t[kTimes * s + 1];
        sums.backward_weight = t[kTimes * s + 2];
        sums.recompute = t[kTimes * s + 3];
        sums.backward = t[kTimes * s + 4];
        costs[rank_stages[r][s]] = sums.costs(problem.message_cost);
      }
    }
    return costs;
  }

  double bytes_of(int ranks) const {
    double sum = 0.0;
    for (int r = 0; r < ranks; ++r) sum += options[r][fixed[r]].peak;
    return sum;
  }

  void descend(int rank) {
    const int p = schedule.ranks_count;
    for (size_t o = 0; o < options[rank].size(); ++o) {
      fixed[rank] = o;
      ++simulations;
      const std::vector<schedule::CostModel> costs = stage_costs(rank + 1);
      const double bound = step_bound(problem, schedule, costs);
      const double slack = 1e-9 * std::max(1.0, std::fabs(best_step));
      if (found && bound > best_step + slack) continue;
      if (rank + 1 < p) {
        descend(rank + 1);
        continue;
      }
      double step = bound;
      if (shares_cores(problem, schedule) || problem.shared_speed < 1) {
        ++simulations;
        step = detail::step_time(problem, schedule, costs);
      }
      const double bytes = bytes_of(p);
      if (!found || step < best_step - slack || (step <= best_step + slack && bytes < best_bytes)) {
        found = true;
        best = fixed;
        best_step = step;
        best_bytes = bytes;
      }
    }
  }
};

std::vector<int> layers_of_stage(const PlanProblem& problem, int stage) {
  std::vector<int> layers;
  for (size_t l = 0; l < problem.stage_of_layer.size(); ++l)
    if (problem.stage_of_layer[l] == stage) layers.push_back(static_cast<int>(l));
  return layers;
}

// Step 2 for one rank: every combination of its stages' frontiers, the fitting ones kept when
// no other fitting one is as fast in every stage time. Returns the smallest peak of all.
double rank_options(Search& search, int rank, std::vector<RankOption>* out) {
  const PeakForms forms = detail::peak_forms(search.schedule, rank, search.problem.stage_bytes);
  const size_t n = forms.stages.size();
  std::vector<StageSums> sums(search.schedule.stages_count);
  std::vector<size_t> at(n, 0);
  double smallest = -1.0;
  std::vector<RankOption> fitting;
  while (true) {
    RankOption option;
    option.entry = at;
    for (size_t s = 0; s < n; ++s) {
      const StageSums& sum = search.frontiers[forms.stages[s]][at[s]].sums;
      sums[forms.stages[s]] = sum;
      option.times.insert(option.times.end(), {sum.forward, sum.backward_input, sum.backward_weight,
                                               sum.recompute, sum.backward});
    }
    option.peak = search.problem.fixed_bytes[rank] + forms.peak(sums);
    option.total_time = std::accumulate(option.times.begin(), option.times.end(), 0.0);
    if (smallest < 0 || option.peak < smallest) smallest = option.peak;
    if (option.peak <= search.problem.budget_bytes[rank]) fitting.push_back(std::move(option));
    size_t s = 0;
    while (s < n && ++at[s] == search.frontiers[forms.stages[s]].size()) at[s++] = 0;
    if (s == n) break;
  }
  std::sort(fitting.begin(), fitting.end(), [](const RankOption& a, const RankOption& b) {
    return a.total_time != b.total_time ? a.total_time < b.total_time : a.peak < b.peak;
  });
  for (size_t i = 0; i < fitting.size(); ++i) {
    bool dominated = false;
    for (size_t j = 0; j < i && !dominated; ++j)
      dominated =
          no_worse(fitting[j].times, fitting[i].times) && fitting[j].peak <= fitting[i].peak;
    if (!dominated) out->push_back(fitting[i]);
  }
  return smallest;
}

}  // namespace

bool Prediction::fits() const {
  return std::all_of(ranks.begin(), ranks.end(), [](const RankPrediction& r) { return r.fits(); });
}

schedule::Schedule plan_schedule(const PlanProblem& problem) {
  schedule::ScheduleOptions options = problem.schedule;
  options.recompute = schedule::RecomputeMode::kPretrigger;
  return schedule::build_schedule(options);
}

namespace detail {

double step_time(const PlanProblem& problem, const schedule::Schedule& schedule,
                 const std::vector<schedule::CostModel>& costs) {
  schedule::SimulateOptions options;
  if (shares_cores(problem, schedule)) options.parallel_ranks = problem.parallel_ranks;
  options.shared_speed = problem.shared_speed;
  return with_tails(problem, schedule::simulate(schedule, costs, options));
}

void check_problem(const PlanProblem& problem, const schedule::Schedule& schedule) {
  const size_t ranks = static_cast<size_t>(schedule.ranks_count);
  PIPEMAT_CHECK(problem.fixed_bytes.size() == ranks && problem.budget_bytes.size() == ranks,
                ConfigError, "plan: ", problem.fixed_bytes.size(), " fixed byte counts and ",
                problem.budget_bytes.size(), " budgets for ", ranks, " ranks; give one per rank.");
  PIPEMAT_CHECK(problem.stage_bytes.empty() ||
                    problem.stage_bytes.size() == static_cast<size_t>(schedule.stages_count),
                ConfigError, "plan: ", problem.stage_bytes.size(), " stage byte counts for ",
                schedule.stages_count, " stages; give one per stage or none.");
  PIPEMAT_CHECK(problem.step_tail.empty() || problem.step_tail.size() == ranks, ConfigError,
                "plan: ", problem.step_tail.size(), " step tails for ", ranks,
                " ranks; give one per rank or none.");
  PIPEMAT_CHECK(problem.shared_speed > 0 && problem.shared_speed <= 1, ConfigError,
                "plan: shared_speed must be in (0, 1], got ", problem.shared_speed, ".");
  PIPEMAT_CHECK(problem.parallel_ranks >= 0, ConfigError,
                "plan: parallel_ranks must be >= 0 (0: every rank has its own cores), got ",
                problem.parallel_ranks, ".");
  PIPEMAT_CHECK(problem.stage_of_layer.size() == problem.layers.size(), ConfigError,
                "plan: ", problem.stage_of_layer.size(), " stage numbers for ",
                problem.layers.size(), " layers; give the stage of every layer.");
  std::vector<int> count(schedule.stages_count, 0);
  for (size_t l = 0; l < problem.layers.size(); ++l) {
    const int s = problem.stage_of_layer[l];
    PIPEMAT_CHECK(s >= 0 && s < schedule.stages_count, ConfigError, "plan: layer '",
                  problem.layers[l].layer, "' is on stage ", s, " but the schedule has ",
                  schedule.stages_count, " stages (0 to ", schedule.stages_count - 1, ").");
    PIPEMAT_CHECK(l == 0 || s >= problem.stage_of_layer[l - 1], ConfigError, "plan: layer '",
                  problem.layers[l].layer, "' is on stage ", s, " after a layer on stage ",
                  problem.stage_of_layer[l - 1], "; stages hold consecutive layers.");
    PIPEMAT_CHECK(!problem.layers[l].candidates.empty(), ConfigError, "plan: layer '",
                  problem.layers[l].layer, "' has no candidate policy.");
    ++count[s];
  }
  for (int s = 0; s < schedule.stages_count; ++s)
    PIPEMAT_CHECK(count[s] > 0, ConfigError, "plan: stage ", s,
                  " holds no layer; every one of the ", schedule.stages_count,
                  " stages needs at least one.");
}

}  // namespace detail

Prediction evaluate(const PlanProblem& problem, const std::vector<int>& choice) {
  const schedule::Schedule schedule = plan_schedule(problem);
  detail::check_problem(problem, schedule);
  PIPEMAT_CHECK(choice.size() == problem.layers.size(), ConfigError, "plan: ", choice.size(),
                " choices for ", problem.layers.size(), " layers.");
  std::vector<StageSums> sums(schedule.stages_count);
  for (size_t l = 0; l < choice.size(); ++l) {
    const auto& candidates = problem.layers[l].candidates;
    PIPEMAT_CHECK(choice[l] >= 0 && choice[l] < static_cast<int>(candidates.size()), ConfigError,
                  "plan: layer '", problem.layers[l].layer, "' has no candidate ", choice[l],
                  " (it has ", candidates.size(), ").");
    sums[problem.stage_of_layer[l]].add(candidates[choice[l]]);
  }
  Prediction prediction;
  prediction.choice = choice;
  std::vector<schedule::CostModel> costs;
  for (const StageSums& s : sums) costs.push_back(s.costs(problem.message_cost));
  prediction.step = detail::step_time(problem, schedule, costs);
  for (int r = 0; r < schedule.ranks_count; ++r) {
    const double peak =
        problem.fixed_bytes[r] + detail::peak_forms(schedule, r, problem.stage_bytes).peak(sums);
    prediction.ranks.push_back({r, peak, problem.budget_bytes[r]});
  }
  return prediction;
}

PlanResult solve(const PlanProblem& problem) {
  const schedule::Schedule schedule = plan_schedule(problem);
  detail::check_problem(problem, schedule);
  Search search{problem, schedule, {}, {}, {}, {}, {}, {}, 0.0, 0.0, false, 0};
  for (int r = 0; r < schedule.ranks_count; ++r)
    search.rank_stages.push_back(schedule.stages_of(r));
  for (int s = 0; s < schedule.stages_count; ++s)
    search.frontiers.push_back(stage_frontier(problem, layers_of_stage(problem, s), s));

  std::vector<std::string> unfit;
  double smallest_budget = 0.0;
  search.options.resize(schedule.ranks_count);
  for (int r = 0; r < schedule.ranks_count; ++r) {
    const double smallest = rank_options(search, r, &search.options[r]);
    smallest_budget = std::max(smallest_budget, smallest);
    if (search.options[r].empty())
      unfit.push_back("rank " + std::to_string(r) + " needs at least " + bytes_text(smallest) +
                      " (budget " + bytes_text(problem.budget_bytes[r]) + ")");
  }
  PIPEMAT_CHECK(unfit.empty(), ConfigError,
                "plan: no remat plan fits the memory budget: ", join(unfit, "; "),
                ". The smallest budget every rank fits is ", bytes_text(smallest_budget), ".");

  for (const auto& rank : search.options) {
    std::vector<double> minimum = rank.front().times;
    for (const RankOption& o : rank)
      for (size_t i = 0; i < minimum.size(); ++i) minimum[i] = std::min(minimum[i], o.times[i]);
    search.rank_minimum.push_back(std::move(minimum));
  }
  search.fixed.assign(schedule.ranks_count, 0);
  search.descend(0);
  PIPEMAT_INTERNAL_ASSERT(search.found);

  std::vector<int> choice(problem.layers.size(), 0);
  for (int r = 0; r < schedule.ranks_count; ++r) {
    const RankOption& option = search.options[r][search.best[r]];
    const std::vector<int> stages = schedule.stages_of(r);
    for (size_t s = 0; s < stages.size(); ++s) {
      const Partial& partial = search.frontiers[stages[s]][option.entry[s]];
      const std::vector<int> layers = layers_of_stage(problem, stages[s]);
      for (size_t i = 0; i < layers.size(); ++i) choice[layers[i]] = partial.choice[i];
    }
  }
  PlanResult result;
  result.best = evaluate(problem, choice);
  result.simulations = search.simulations;
  return result;
}

}  // namespace pipemat::plan
