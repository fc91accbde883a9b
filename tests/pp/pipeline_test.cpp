// The public pipeline API with a user model that is not in the zoo (user_model.h): every loss,
// gradient norm and parameter after every step equal a plain single-process LibTorch loop
// bitwise, for every schedule kind, with ranks as threads over the local transport. Also the
// stage I/O errors, evaluation, batch splitting and imported torch CSV schedules.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <exception>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/remat/memory.h"
#include "pipemat/remat/stats.h"
#include "pipemat/schedule/simulate.h"
#include "pipemat/schedule/torch_csv.h"
#include "user_model.h"
#include "user_pipeline.h"

namespace pipemat::pp {
namespace {

using schedule::ScheduleKind;
using user_model::PipelineCase;

using user_model::run_ranks;

void expect_equals_plain(const PipelineCase& c) {
  const auto plain = user_model::plain_training(c.blocks, c.micro_batches, c.steps);
  std::vector<user_model::RankRun> runs(c.ranks);
  auto errors = run_ranks(c.ranks, [&](comm::Transport& t) { runs[t.rank()] = run_rank(t, c); });
  std::size_t params = 0;
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    for (const auto& d : user_model::differences(runs[r], plain, r)) ADD_FAILURE() << d;
    params += runs[r].params.back().size();
  }
  EXPECT_EQ(params, plain.params.back().size()) << "every parameter lives on exactly one rank";
  // Clipping was active: the norm is above the threshold in the first step.
  EXPECT_GT(plain.grad_norms[0], user_model::kClip);
}

struct NamedCase {
  std::string name;
  PipelineCase c;
};

class UserModelPipeline : public ::testing::TestWithParam<NamedCase> {};

TEST_P(UserModelPipeline, LossesNormsAndParametersEqualAPlainLoopBitwise) {
  expect_equals_plain(GetParam().c);
}

std::vector<NamedCase> cases() {
  std::vector<NamedCase> out;
  const std::pair<const char*, ScheduleKind> kinds[] = {{"gpipe", ScheduleKind::kGPipe},
                                                        {"1f1b", ScheduleKind::kOneFOneB},
                                                        {"interleaved", ScheduleKind::kInterleaved},
                                                        {"zb_h1", ScheduleKind::kZeroBubbleH1},
                                                        {"zb_h2", ScheduleKind::kZeroBubbleH2},
                                                        {"zb_v", ScheduleKind::kZeroBubbleV}};
  for (const auto& [name, kind] : kinds) {
    PipelineCase c;
    c.kind = kind;
    out.push_back({std::string(name) + "_2ranks_remat", c});
  }
  PipelineCase plain;
  plain.remat = false;
  out.push_back({"1f1b_2ranks_no_remat", plain});
  PipelineCase lazy;
  lazy.kind = ScheduleKind::kZeroBubbleH1;
  lazy.recompute = schedule::RecomputeMode::kLazy;
  out.push_back({"zb_h1_2ranks_lazy", lazy});
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleV}) {
    PipelineCase c;
    c.kind = kind;
    c.ranks = 4;
    c.micro_batches = 8;
    c.steps = 2;
    out.push_back({std::string(kind == ScheduleKind::kOneFOneB ? "1f1b" : "zb_v") + "_4ranks", c});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, UserModelPipeline, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<NamedCase>& test) {
                           return test.param.name;
                         });

// Ranks as threads with dropout in checkpointed blocks: with a seed each rank draws from its own
// generator, so replays reproduce the forward's masks and the run equals the same run without
// recompute bitwise (and repeats itself).
TEST(Pipeline, DropoutInCheckpointedStagesOnThreadRanksEqualsTheRunWithoutRecompute) {
  auto run_all = [](const PipelineCase& c) {
    std::vector<user_model::RankRun> runs(c.ranks);
    auto errors = run_ranks(c.ranks, [&](comm::Transport& t) { runs[t.rank()] = run_rank(t, c); });
    for (int r = 0; r < c.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
    return runs;
  };
  auto expect_same = [](const std::vector<user_model::RankRun>& a,
                        const std::vector<user_model::RankRun>& b, const char* what) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t r = 0; r < a.size(); ++r) {
      EXPECT_EQ(a[r].losses, b[r].losses) << what << ", rank " << r;
      ASSERT_EQ(a[r].params.size(), b[r].params.size());
      for (size_t s = 0; s < a[r].params.size(); ++s) {
        for (const auto& [name, value] : a[r].params[s]) {
          EXPECT_TRUE(at::equal(value, b[r].params[s].at(name)))
              << what << ": rank " << r << " step " << s << " parameter " << name;
        }
      }
    }
  };
  for (ScheduleKind kind : {ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV}) {
    PipelineCase c;
    c.kind = kind;
    c.dropout = 0.2;
    c.seed = 11;
    const auto with_remat = run_all(c);
    expect_same(with_remat, run_all(c), "the same run twice");
    PipelineCase none = c;
    none.remat = false;
    expect_same(with_remat, run_all(none), "with and without recompute");
    PipelineCase other = c;
    other.seed = 12;
    EXPECT_NE(with_remat[0].losses, run_all(other)[0].losses) << "dropout is on";
  }
}

TEST(Pipeline, ImportedTorchCsvScheduleRunsAndEqualsThePlainLoop) {
  // A 1F1B schedule written as torch.distributed.pipelining writes it, with FSDP cells.
  schedule::ScheduleOptions so;
  so.kind = ScheduleKind::kOneFOneB;
  so.ranks = 2;
  so.micro_batches = 4;
  std::string csv = schedule::export_torch_csv(schedule::generate_schedule(so));
  std::string with_fsdp;
  int row = 0;
  for (size_t start = 0; start < csv.size();) {
    const size_t end = csv.find('\n', start);
    with_fsdp += std::to_string(row) + "UNSHARD," + csv.substr(start, end - start) + "," +
                 std::to_string(row) + "RESHARD," + std::to_string(row) + "REDUCE_GRAD\n";
    start = end + 1;
    ++row;
  }
  auto imported = schedule::import_torch_csv_report(with_fsdp, "test.csv");
  EXPECT_EQ(imported.unshard, 2);
  EXPECT_EQ(imported.reshard, 2);
  EXPECT_EQ(imported.reduce_grad, 2);
  EXPECT_NE(imported.note.find("test.csv"), std::string::npos) << imported.note;

  PipelineCase c;
  c.actions = imported.schedule;
  expect_equals_plain(c);
  auto options = user_model::pipeline_options(c);
  auto one = comm::make_local_transports(2);
  torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
  Pipeline pipe(*one[0], options, split_sequential(model, balance_by_parameters(model, 2)));
  EXPECT_EQ(pipe.schedule().kind, ScheduleKind::kImported);
  EXPECT_TRUE(pipe.schedule().has_comms()) << "a compute-only import is lowered";
}

TEST(Pipeline, BatchSplitAlongDimZeroEqualsTheDataSource) {
  PipelineCase c;
  c.steps = 2;
  const auto plain = user_model::plain_training(c.blocks, c.micro_batches, c.steps);
  std::vector<double> losses(2 * c.steps);
  auto errors = run_ranks(2, [&](comm::Transport& t) {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    Pipeline pipe(t, user_model::pipeline_options(c),
                  split_sequential(model, balance_by_parameters(model, 2)));
    for (int64_t step = 0; step < c.steps; ++step) {
      std::vector<at::Tensor> ids, targets;
      for (int i = 0; i < c.micro_batches; ++i) {
        auto [x, y] = user_model::data(step, i);
        ids.push_back(x);
        targets.push_back(y);
      }
      MicroBatch batch{{at::cat(ids)}, {at::cat(targets)}};
      losses[t.rank() * c.steps + step] = pipe.train_step(batch).loss;
    }
    // A batch whose dim 0 does not split into the micro-batches.
    MicroBatch bad{{at::zeros({7, 6}, at::kLong)}, {at::zeros({7, 6}, at::kLong)}};
    try {
      pipe.train_step(bad);
      ADD_FAILURE() << "no error for a batch of 7 rows";
    } catch (const PipelineError& e) {
      EXPECT_NE(std::string(e.what()).find("int64 [7, 6], whose dim 0 does not split into 4 "
                                           "micro-batches"),
                std::string::npos)
          << e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    for (int64_t s = 0; s < c.steps; ++s) {
      EXPECT_EQ(losses[r * c.steps + s], plain.losses[s]) << "rank " << r << " step " << s;
    }
  }
}

// StepMetrics::data_ms is the time in the data source: each of a rank's 4 calls sleeps 5 ms.
TEST(Pipeline, StepMetricsCountTheTimeInTheDataSource) {
  PipelineCase c;
  std::vector<StepMetrics> got(2);
  std::vector<int> calls(2, 0);
  auto errors = run_ranks(2, [&](comm::Transport& t) {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    Pipeline pipe(t, user_model::pipeline_options(c),
                  split_sequential(model, balance_by_parameters(model, 2)));
    got[t.rank()] = pipe.train_step([&](int64_t s, int64_t i) {
      ++calls[t.rank()];
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      auto [x, y] = user_model::data(s, i);
      return MicroBatch{{x}, {y}};
    });
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(calls[r], c.micro_batches) << "rank " << r;
    EXPECT_GE(got[r].data_ms, 5.0 * c.micro_batches) << "rank " << r;
    EXPECT_LT(got[r].data_ms, got[r].step_ms) << "rank " << r;
  }
}

// The last stage's rank sees every rank's compute actions and sends; the time blocked in
// receives is every rank's waits summed; the comm-aware simulation is the simulator run with
// the measured costs and the measured message delay (Note [Measured message delay]).
TEST(Pipeline, StepMetricsCarrySendsWaitsAndTheCommAwareSimulation) {
  remat::install_tracking_allocator();  // for the peak bytes
  PipelineCase c;
  c.steps = 2;
  std::vector<StepMetrics> last(2);
  std::vector<schedule::Schedule> plans(2);
  auto errors = run_ranks(2, [&](comm::Transport& t) {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    Pipeline pipe(t, user_model::pipeline_options(c),
                  split_sequential(model, balance_by_parameters(model, 2)));
    for (int64_t step = 0; step < c.steps; ++step) {
      last[t.rank()] = pipe.train_step([](int64_t s, int64_t i) {
        auto [x, y] = user_model::data(s, i);
        return MicroBatch{{x}, {y}};
      });
    }
    plans[t.rank()] = pipe.schedule();
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  const schedule::Schedule& plan = plans[1];
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    int computes = 0, sends = 0;
    for (const auto& a : plan.actions[r]) {
      if (schedule::is_compute(a.type)) ++computes;
      if (a.type == schedule::ActionType::kSendForward ||
          a.type == schedule::ActionType::kSendBackward) {
        ++sends;
      }
    }
    int got_computes = 0, got_sends = 0;
    double waited = 0;
    for (const auto& t : last[r].timeline) {
      if (schedule::is_compute(t.action.type)) {
        ++got_computes;
        EXPECT_GE(t.wait_us, 0);
        EXPECT_LE(t.start_us, t.end_us);
        // Note [Step trace]: what came from the other rank, with its bytes.
        EXPECT_EQ(t.bytes > 0, t.received);
      } else {
        ++got_sends;
        EXPECT_LE(t.start_us, t.end_us) << "a send: the call that issued it";
        EXPECT_GT(t.bytes, 0);
      }
      waited += t.wait_us;
    }
    EXPECT_EQ(got_computes, computes);
    EXPECT_EQ(got_sends, sends);
    // One stage per rank: rank 0 sends every micro-batch's activation, rank 1 its gradient.
    EXPECT_EQ(sends, c.micro_batches);
    if (r == 0) {
      EXPECT_NEAR(last[0].recv_wait_ms, waited / 1000.0, 1e-9);
    }
    // Rank 1 is the last stage's: the sum of both ranks' waits.
    if (r == 1) {
      double both = 0;
      for (const auto& t : last[0].timeline) both += t.wait_us;
      for (const auto& t : last[1].timeline) both += t.wait_us;
      EXPECT_NEAR(last[1].recv_wait_ms, both / 1000.0, 1e-6);
    }
  }
  const StepMetrics& m = last[1];
  EXPECT_EQ(m.measured.ranks.size(), 2u);
  schedule::CostModel with_comm = m.measured_costs;
  with_comm.comm = m.message_delay_ms;
  EXPECT_EQ(m.simulated_bubble_comm, schedule::simulate(plan, with_comm).bubble_ratio);
  EXPECT_EQ(m.simulated_bubble, schedule::simulate(plan, m.measured_costs).bubble_ratio);
  // The trace's prediction: each stage's own mean duration per action type, recomputed here
  // from the measured timeline, with the measured message delay.
  ASSERT_EQ(m.measured_stage_costs.size(), static_cast<size_t>(plan.stages_count));
  auto cost_of = [](const schedule::CostModel& costs, schedule::ActionType type) {
    switch (type) {
      case schedule::ActionType::kForward:
        return costs.forward;
      case schedule::ActionType::kBackward:
        return costs.backward_cost();
      case schedule::ActionType::kBackwardInput:
        return costs.backward_input;
      case schedule::ActionType::kBackwardWeight:
        return costs.backward_weight;
      default:
        return costs.recompute.value_or(0.0);
    }
  };
  std::map<std::pair<int, schedule::ActionType>, std::pair<double, int>> sums;
  for (const auto& rt : m.measured.ranks) {
    for (const auto& ta : rt.actions) {
      auto& sum = sums[{ta.action.stage, ta.action.type}];
      sum.first += ta.end - ta.start;
      sum.second += 1;
    }
  }
  std::set<std::pair<int, schedule::ActionType>> planned;  // (stage, type) of every compute
  int plan_computes = 0;
  for (const auto& list : plan.actions) {
    for (const auto& a : list) {
      if (!schedule::is_compute(a.type)) continue;
      planned.insert({a.stage, a.type});
      ++plan_computes;
    }
  }
  EXPECT_EQ(planned.size(), 6u) << "F, R and B on each of the 2 stages";
  EXPECT_EQ(sums.size(), planned.size());
  for (const auto& [key, sum] : sums) {
    EXPECT_NEAR(cost_of(m.measured_stage_costs[static_cast<size_t>(key.first)], key.second),
                sum.first / sum.second, 1e-9)
        << "stage " << key.first << " " << schedule::action_type_code(key.second);
  }
  EXPECT_NE(m.measured_stage_costs[0].forward, m.measured_stage_costs[1].forward);
  std::vector<schedule::CostModel> stage_with_comm = m.measured_stage_costs;
  for (schedule::CostModel& costs : stage_with_comm) costs.comm = m.message_delay_ms;
  EXPECT_EQ(m.simulated.makespan, schedule::simulate(plan, stage_with_comm).makespan);
  int predicted = 0;
  for (const auto& rt : m.simulated.ranks) {
    for (const auto& ta : rt.actions) {
      if (!schedule::is_compute(ta.action.type)) continue;
      ++predicted;
      EXPECT_NEAR(
          ta.end - ta.start,
          cost_of(m.measured_stage_costs[static_cast<size_t>(ta.action.stage)], ta.action.type),
          1e-9);
    }
  }
  EXPECT_EQ(predicted, plan_computes);
  EXPECT_GE(m.max_rank_peak_bytes, m.peak_bytes);
  EXPECT_GT(m.max_rank_peak_bytes, 0);
  // Each rank's start, peak and resident peak bytes, by rank, on the last stage's rank only.
  ASSERT_EQ(m.rank_peak_bytes.size(), 2u);
  ASSERT_EQ(m.rank_start_bytes.size(), 2u);
  ASSERT_EQ(m.rank_resident_peak_bytes.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const StepMetrics& own = last[static_cast<size_t>(r)];
    EXPECT_EQ(m.rank_peak_bytes[static_cast<size_t>(r)], own.peak_bytes);
    EXPECT_EQ(m.rank_start_bytes[static_cast<size_t>(r)], own.start_bytes);
    EXPECT_EQ(m.rank_resident_peak_bytes[static_cast<size_t>(r)], own.resident_peak_bytes);
    EXPECT_GT(own.resident_peak_bytes, own.start_bytes) << "the process holds its tensors";
  }
  EXPECT_EQ(m.max_rank_peak_bytes, std::max(m.rank_peak_bytes[0], m.rank_peak_bytes[1]));
  EXPECT_TRUE(last[0].rank_peak_bytes.empty());
  // Every rank's timeline, spans and step time, by rank (Note [Step trace]).
  ASSERT_EQ(m.rank_timelines.size(), 2u);
  ASSERT_EQ(m.rank_step_ms.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const StepMetrics& own = last[static_cast<size_t>(r)];
    ASSERT_EQ(m.rank_timelines[static_cast<size_t>(r)].size(), own.timeline.size());
    for (size_t i = 0; i < own.timeline.size(); ++i) {
      EXPECT_EQ(m.rank_timelines[static_cast<size_t>(r)][i].action, own.timeline[i].action);
      EXPECT_EQ(m.rank_timelines[static_cast<size_t>(r)][i].bytes, own.timeline[i].bytes);
    }
    EXPECT_EQ(m.rank_spans[static_cast<size_t>(r)].size(), own.spans.size());
  }
  // Rank 0's own step time; the last rank's step_ms is the slowest rank's.
  EXPECT_EQ(m.rank_step_ms[0], last[0].step_ms);
  EXPECT_EQ(m.step_ms, std::max(m.rank_step_ms[0], m.rank_step_ms[1]));
  EXPECT_TRUE(last[0].rank_timelines.empty());
}

TEST(Pipeline, EvaluateIsForwardOnlyInEvalModeAndEqualsThePlainForward) {
  PipelineCase c;
  c.kind = ScheduleKind::kZeroBubbleV;  // 4 stages, V layout: rank 0 holds the first and last
  torch::nn::Sequential reference = user_model::make_model(c.blocks, 7);
  reference->eval();
  double want = 0;
  {
    c10::NoGradGuard no_grad;
    for (int i = 0; i < 3; ++i) {
      auto [ids, targets] = user_model::data(5, i);
      want +=
          (user_model::loss_of(reference->forward<at::Tensor>(ids), targets) / 3.0).item<double>();
    }
  }
  std::vector<double> got(2);
  std::vector<int64_t> units(2), outputs(2);
  std::vector<bool> training_after(2);
  auto errors = run_ranks(2, [&](comm::Transport& t) {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    Pipeline pipe(t, user_model::pipeline_options(c),
                  split_sequential(model, balance_by_parameters(model, 4)));
    remat::reset_counters();
    EvalOptions eo;
    eo.micro_batches = 3;
    eo.step = 5;
    eo.keep_outputs = true;
    EvalResult r = pipe.evaluate(
        [](int64_t s, int64_t i) {
          auto [ids, targets] = user_model::data(s, i);
          return MicroBatch{{ids}, {targets}};
        },
        eo);
    got[t.rank()] = r.loss;
    units[t.rank()] = remat::counters().unit_calls;
    outputs[t.rank()] = static_cast<int64_t>(r.outputs.size());
    training_after[t.rank()] = pipe.stage(pipe.stages()[0]).module->is_training();
    EXPECT_EQ(pipe.step(), 0) << "evaluation is not a training step";
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], want) << "rank " << r << ": the loss is shared with every rank";
    EXPECT_EQ(units[r], 0) << "no checkpoint unit state in evaluation";
    EXPECT_TRUE(training_after[r]) << "train mode is restored";
  }
  EXPECT_EQ(outputs[0], 3) << "rank 0 holds the last stage under zb-v";
  EXPECT_EQ(outputs[1], 0);
}

// A stage that returns (hidden, mask) for the first micro-batches, then something else.
void expect_boundary_error(const std::function<Tensors(const Tensors&)>& late_output,
                           const std::string& sender_text, const std::string& receiver_text) {
  auto errors = run_ranks(2, [&](comm::Transport& t) {
    PipelineOptions o;
    o.schedule.kind = ScheduleKind::kOneFOneB;
    o.schedule.ranks = 2;
    o.schedule.micro_batches = 4;
    o.loss = [](const Tensors& out, const Tensors&) { return out.at(0).sum(); };
    o.optimizer = [](const std::vector<at::Tensor>& p) {
      return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.1));
    };
    auto first = std::make_shared<torch::nn::Module>();
    auto w = first->register_parameter("w", at::ones({3}));
    auto last = std::make_shared<torch::nn::Module>();
    auto v = last->register_parameter("v", at::ones({3}));
    int calls = 0;
    Pipeline pipe(t, o, [&](int s) {
      if (s == 0) {
        return make_stage(0, first, [&, w](const Tensors& in) -> Tensors {
          Tensors good{in.at(0) * w, at::ones({2}, at::kFloat)};
          return calls++ < 2 ? good : late_output(good);
        });
      }
      return make_stage(1, last, [v](const Tensors& in) -> Tensors { return {in.at(0) * v}; });
    });
    pipe.train_step([](int64_t, int64_t) { return MicroBatch{{at::ones({3})}, {}}; });
  });
  EXPECT_NE(errors[0].find(sender_text), std::string::npos) << "rank 0: " << errors[0];
  EXPECT_NE(errors[1].find(receiver_text), std::string::npos) << "rank 1: " << errors[1];
}

TEST(Pipeline, StageReturningAnotherNumberOfTensorsIsAnErrorOnBothSides) {
  expect_boundary_error(
      [](const Tensors& good) { return Tensors{good[0]}; },
      "stage 0 on rank 0 returned [float32 [3]] (1 tensor) for micro-batch 2 of step 0, but "
      "earlier micro-batches on its boundary to stage 1 carried [float32, float32] (2 tensors)",
      "stage 1 on rank 1 received [float32 [3]] (1 tensor) from stage 0 on rank 0 for "
      "micro-batch 2 of step 0, but earlier micro-batches on this boundary carried [float32, "
      "float32] (2 tensors)");
}

TEST(Pipeline, StageReturningAnotherDtypeIsAnErrorOnBothSides) {
  expect_boundary_error(
      [](const Tensors& good) {
        return Tensors{good[0], good[1].to(at::kDouble)};
      },
      "returned [float32 [3], float64 [2]] (2 tensors) for micro-batch 2 of step 0",
      "stage 1 on rank 1 received [float32 [3], float64 [2]] (2 tensors) from stage 0 on rank 0");
}

TEST(Pipeline, MisuseIsAClearError) {
  auto one_rank = comm::make_local_transports(1);
  PipelineOptions o;
  o.schedule.ranks = 1;
  auto module = std::make_shared<torch::nn::Module>();
  auto identity = [](const Tensors& in) { return in; };
  auto expect_error = [&](const PipelineOptions& opts, const StageFactory& f, const char* text) {
    try {
      Pipeline p(*one_rank[0], opts, f);
      ADD_FAILURE() << "no error, expected: " << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  auto good = [&](int s) { return make_stage(s, module, identity); };
  expect_error(o, good, "PipelineOptions::loss is not set");
  o.loss = [](const Tensors& out, const Tensors&) { return out.at(0).sum(); };
  expect_error(o, good, "PipelineOptions::optimizer is not set");
  o.optimizer = [](const std::vector<at::Tensor>& p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.1));
  };
  expect_error(
      o, [&](int) { return make_stage(3, module, identity); },
      "the stage factory was asked for stage 0 on rank 0 but returned stage 3");
  expect_error(
      o, [&](int s) { return make_stage(s, nullptr, identity); }, "stage 0 has no module");
  o.schedule.ranks = 2;
  expect_error(o, good, "schedule.ranks is 2 but the job has 1 ranks");
  o.schedule.ranks = 1;
  o.stage_remat[1] = remat::RematPolicy{};
  expect_error(o, good,
               "PipelineOptions::stage_remat names stage 1 but the schedule has 1 stages (0 to 0)");
  o.stage_remat.clear();
  // A loss that is not a scalar.
  o.loss = [](const Tensors& out, const Tensors&) { return out.at(0); };
  Pipeline p(*one_rank[0], o, good);
  try {
    p.train_step([](int64_t, int64_t) { return MicroBatch{{at::ones({3})}, {}}; });
    ADD_FAILURE() << "no error for a non-scalar loss";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a floating scalar, got float32 [3]"),
              std::string::npos)
        << e.what();
  }
}

// PipelineOptions::remat holds one policy for the stages of every rank: a misspelt pattern (here
// a SAVE path) is an error at the first step on every rank naming it and the nearest module
// path, not skipped on each stage (it was: the run recomputed those layers). A pattern that
// matches on one rank's stage only (the head, on the last) is no error.
TEST(Pipeline, RematPatternThatMatchesOnNoStageOfAnyRankIsAnError) {
  PipelineCase c;  // 2 ranks, 6 blocks
  const DataSource step_data = [](int64_t s, int64_t i) {
    auto [ids, targets] = user_model::data(s, i);
    return MicroBatch{{ids}, {targets}};
  };
  auto construct = [&](const remat::RematPolicy& policy) {
    return run_ranks(c.ranks, [&](comm::Transport& t) {
      torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
      PipelineOptions o = user_model::pipeline_options(c);
      o.remat = policy;
      const auto bounds = balance_by_parameters(model, stage_count(o));
      Pipeline pipe(t, o, split_sequential(model, bounds));  // sends nothing
      pipe.train_step(step_data);                            // checks over all ranks first
    });
  };
  remat::RematPolicy typo = user_model::pipeline_options(c).remat;
  typo.exclude = {{"block*.atn_in.1", true}};
  const auto errors = construct(typo);
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)],
              "PipelineOptions::remat: exclude[0] 'block*.atn_in.1' matches no module on any of "
              "the pipeline's 2 stages (paths are relative to each stage's module); the nearest "
              "module path is 'block0.attn_in.1'. Fix the pattern or remove it; a misspelt "
              "pattern would silently change what is recomputed")
        << "rank " << r;
  }
  remat::RematPolicy one_stage;
  one_stage.checkpoint = {"head", "embed"};  // the last stage's and the first stage's
  EXPECT_EQ(construct(one_stage), (std::vector<std::string>{"", ""}));
  // With an own policy on every stage, PipelineOptions::remat applies to none: not checked.
  EXPECT_EQ(run_ranks(c.ranks,
                      [&](comm::Transport& t) {
                        torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
                        PipelineOptions o = user_model::pipeline_options(c);
                        o.remat = typo;
                        o.stage_remat = {{0, {}}, {1, {}}};
                        Pipeline pipe(t, o,
                                      split_sequential(model, balance_by_parameters(model, 2)));
                      }),
            (std::vector<std::string>{"", ""}));
  // A stage's own policy applies to that stage alone.
  auto own = run_ranks(1, [&](comm::Transport& t) {
    PipelineCase one = c;
    one.ranks = 1;
    torch::nn::Sequential model = user_model::make_model(one.blocks, 7);
    PipelineOptions o = user_model::pipeline_options(one);
    o.stage_remat[0].checkpoint = {"blockz"};
    Pipeline pipe(t, o, split_sequential(model, {0, static_cast<int64_t>(model->size())}));
  });
  EXPECT_EQ(own[0],
            "PipelineOptions::stage_remat[0]: checkpoint[0] 'blockz' matches no module on stage 0 "
            "(paths are relative to each stage's module); the nearest module path is 'block0'. "
            "Fix the pattern or remove it; a misspelt pattern would silently change what is "
            "recomputed");
}

// Note [Data x pipeline]: replicas that build other stages (here another layer width) are an
// error on every replica at construction, naming the replicas and the pipeline rank.
TEST(Pipeline, ReplicasThatBuildOtherStagesAreAClearError) {
  auto job = comm::make_local_transports(2);  // 2 replicas of a 1-rank pipeline
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto data = comm::make_group(*job[static_cast<size_t>(r)], {0, 1});
        auto pipeline = comm::make_group(*job[static_cast<size_t>(r)], {r});
        PipelineOptions o;
        o.schedule.ranks = 1;
        o.loss = [](const Tensors& out, const Tensors&) { return out.at(0).sum(); };
        o.optimizer = [](const std::vector<at::Tensor>& p) {
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
        };
        o.data_group = data.get();
        auto linear = torch::nn::Linear(3, r == 0 ? 3 : 4);
        Pipeline p(*pipeline, o, [&](int s) {
          return make_stage(s, linear.ptr(), [linear](const Tensors& in) mutable {
            return Tensors{linear->forward(in[0])};
          });
        });
      } catch (const PipelineError& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[0].find("data parallelism: replica 1 sent other parameters than replica 0 "
                           "holds on pipeline rank 0 (2 tensors for 2); every replica must "
                           "build the same stages"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("data parallelism: replica 0 sent other parameters than replica 1 "
                           "holds on pipeline rank 0"),
            std::string::npos)
      << errors[1];
}

TEST(Pipeline, FixedArityModuleNamesTheCountItTakes) {
  struct TwoImpl : torch::nn::Module {
    at::Tensor forward(const at::Tensor& a, const at::Tensor& b) { return a + b; }
  };
  auto stage = make_stage(2, std::make_shared<TwoImpl>());
  EXPECT_TRUE(at::equal(stage.forward({at::ones({2}), at::ones({2})}).at(0), at::full({2}, 2.0)));
  try {
    stage.forward({at::ones({2})});
    FAIL() << "no error";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find("stage 2: the module's forward takes 2 tensors but the "
                                         "stage got 1"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pipemat::pp

namespace pipemat::pp {
namespace {

TEST(PipelineDocs, LibraryDocShowsTheExampleVerbatim) {
  auto read = [](const std::string& rel) {
    std::ifstream in(std::string(PIPEMAT_SOURCE_DIR) + "/" + rel);
    EXPECT_TRUE(in.is_open()) << rel;
    return std::string{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  };
  const std::string example = read("examples/pipeline_library/main.cpp");
  ASSERT_GT(example.size(), 1000u);
  EXPECT_NE(read("docs/library.md").find("```cpp\n" + example + "```"), std::string::npos)
      << "docs/library.md must hold examples/pipeline_library/main.cpp as is";
}

}  // namespace
}  // namespace pipemat::pp

namespace pipemat::pp {
namespace {

// bf16 crosses the boundary; stage 1 is an AnyModule, stage 0 a callable.
struct Bf16HeadImpl : torch::nn::Module {
  Bf16HeadImpl() : lin(register_module("lin", torch::nn::Linear(4, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return lin(x.to(at::kFloat)); }
  torch::nn::Linear lin;
};
TORCH_MODULE(Bf16Head);

TEST(Pipeline, Bfloat16BoundaryAnyModuleAndCallableStagesEqualAPlainLoop) {
  auto make = [] {
    static std::mutex init;  // ranks are threads: one seeded initialization at a time
    std::lock_guard<std::mutex> lock(init);
    at::manual_seed(3);
    auto first = torch::nn::Linear(5, 4);
    auto head = Bf16Head();
    return std::make_pair(first, head);
  };
  auto data = [](int64_t step, int64_t i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(step * 10 + i);
    return MicroBatch{{at::randn({6, 5}, gen)}, {at::randn({6, 3}, gen)}};
  };
  auto loss = [](const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); };
  // Plain loop.
  auto [pf, ph] = make();
  std::vector<at::Tensor> params = pf->parameters();
  for (const auto& p : ph->parameters()) params.push_back(p);
  torch::optim::SGD plain_opt(params, torch::optim::SGDOptions(0.1));
  std::vector<double> want;
  for (int64_t step = 0; step < 3; ++step) {
    plain_opt.zero_grad();
    double sum = 0;
    for (int64_t i = 0; i < 2; ++i) {
      MicroBatch b = data(step, i);
      at::Tensor l = loss(ph(pf(b.inputs[0]).to(at::kBFloat16)), b.targets[0]) / 2.0;
      sum += l.item<double>();
      l.backward();
    }
    plain_opt.step();
    want.push_back(sum);
  }
  std::vector<std::vector<double>> got(2);
  std::vector<std::vector<at::Tensor>> final_params(2);
  auto errors = run_ranks(2, [&](comm::Transport& t) {
    auto [f, h] = make();
    PipelineOptions o;
    o.schedule.kind = ScheduleKind::kOneFOneB;
    o.schedule.ranks = 2;
    o.schedule.micro_batches = 2;
    o.loss = [&](const Tensors& out, const Tensors& y) { return loss(out.at(0), y.at(0)); };
    o.optimizer = [](const std::vector<at::Tensor>& p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
    };
    Pipeline pipe(t, o, [&, f = f, h = h](int s) {
      if (s == 0) {
        return make_stage(0, f.ptr(), [impl = f.ptr()](const Tensors& in) -> Tensors {
          return {impl->forward(in.at(0)).to(at::kBFloat16)};
        });
      }
      return make_stage(1, torch::nn::AnyModule(h));
    });
    for (int64_t step = 0; step < 3; ++step) got[t.rank()].push_back(pipe.train_step(data).loss);
    final_params[t.rank()] = pipe.parameters();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], want) << "rank " << r;
  }
  ASSERT_EQ(final_params[0].size() + final_params[1].size(), params.size());
  for (size_t i = 0; i < final_params[0].size(); ++i) {
    EXPECT_TRUE(at::equal(final_params[0][i], params[i])) << "stage 0 parameter " << i;
  }
  for (size_t i = 0; i < final_params[1].size(); ++i) {
    EXPECT_TRUE(at::equal(final_params[1][i], params[final_params[0].size() + i]))
        << "stage 1 parameter " << i;
  }
}

}  // namespace
}  // namespace pipemat::pp
