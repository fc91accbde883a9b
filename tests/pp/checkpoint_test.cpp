// Checkpoints of a pipeline run (pp/checkpoint.h): a run stopped after k steps and resumed from
// its checkpoint into freshly built pipelines (other initial weights) gives every later loss and
// the final parameters of the straight run bitwise, with AdamW, an LR schedule and dropout under
// per-rank generators; incomplete, damaged and foreign checkpoints are refused, naming why,
// and change nothing.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/pp/pipeline.h"
#include "user_model.h"
#include "user_pipeline.h"

namespace pipemat::pp {
namespace {

namespace fs = std::filesystem;
using schedule::ScheduleKind;
using user_model::PipelineCase;

void on_ranks(int ranks, const std::function<void(comm::Transport&)>& body) {
  const auto errors = user_model::run_ranks(ranks, body);
  for (int r = 0; r < ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
}

MicroBatch batch_of(int64_t step, int64_t i) {
  auto [ids, targets] = user_model::data(step, i);
  return MicroBatch{{ids}, {targets}};
}

std::unique_ptr<Pipeline> make_pipeline(comm::Transport& t, const PipelineCase& c, uint64_t init) {
  torch::nn::Sequential model = user_model::make_model(c.blocks, init, c.dropout);
  const auto options = user_model::pipeline_options(c);
  return std::make_unique<Pipeline>(
      t, options, split_sequential(model, balance_by_parameters(model, stage_count(options))));
}

std::map<std::string, at::Tensor> params_of(const Pipeline& p) {
  std::map<std::string, at::Tensor> out;
  for (int s : p.stages()) {
    for (const auto& item : p.stage(s).module->named_parameters()) {
      out[item.key()] = item.value().detach().clone();
    }
  }
  return out;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("pipemat-checkpoint-test-" + name);
  fs::remove_all(dir);
  return dir;
}

PipelineCase dropout_case(ScheduleKind kind) {
  PipelineCase c;
  c.kind = kind;
  c.dropout = 0.1;
  c.seed = 5;
  return c;
}

class Resume : public ::testing::TestWithParam<ScheduleKind> {};

TEST_P(Resume, StoppedAndResumedRunEqualsTheStraightRunBitwise) {
  const PipelineCase c = dropout_case(GetParam());
  constexpr int64_t kSteps = 6, kStop = 3;
  const fs::path root = fresh_dir(schedule::to_string(GetParam()));
  std::vector<std::vector<double>> straight(2), resumed(2);
  std::vector<std::map<std::string, at::Tensor>> straight_params(2), resumed_params(2);
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    for (int64_t s = 0; s < kSteps; ++s) straight[t.rank()].push_back(p->train_step(batch_of).loss);
    straight_params[t.rank()] = params_of(*p);
  });
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    for (int64_t s = 0; s < kStop; ++s) p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string());
    EXPECT_EQ(fs::path(dir).filename().string(), "step-000003");
  });
  // A new "process": other initial weights, a fresh optimizer and generator.
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 1234);
    load_checkpoint(*p, t, latest_checkpoint(root.string()));
    EXPECT_EQ(p->step(), kStop);
    for (int64_t s = kStop; s < kSteps; ++s)
      resumed[t.rank()].push_back(p->train_step(batch_of).loss);
    resumed_params[t.rank()] = params_of(*p);
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(resumed[r].size(), static_cast<size_t>(kSteps - kStop));
    for (int64_t s = kStop; s < kSteps; ++s) {
      EXPECT_EQ(resumed[r][s - kStop], straight[r][s]) << "step " << s;
    }
    ASSERT_EQ(resumed_params[r].size(), straight_params[r].size());
    for (const auto& [name, value] : straight_params[r]) {
      EXPECT_TRUE(at::equal(resumed_params[r].at(name), value)) << name;
    }
  }
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Schedules, Resume,
                         ::testing::Values(ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleV),
                         [](const auto& test) {
                           return test.param == ScheduleKind::kOneFOneB ? "OneFOneB" : "ZbV";
                         });

// Expects load_checkpoint to fail with `text` on every rank and to leave the parameters alone.
void expect_refused(const PipelineCase& c, const std::string& dir, const std::string& text) {
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 99);
    const auto before = params_of(*p);
    try {
      load_checkpoint(*p, t, dir);
      ADD_FAILURE() << "rank " << t.rank() << ": no error for " << dir;
    } catch (const Error& e) {  // ConfigError for a foreign manifest, else PipelineError
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos)
          << "rank " << t.rank() << ": " << e.what();
    }
    EXPECT_EQ(p->step(), 0);
    for (const auto& [name, value] : params_of(*p)) EXPECT_TRUE(at::equal(before.at(name), value));
  });
}

TEST(Checkpoint, IncompleteDamagedAndForeignCheckpointsAreRefusedAndChangeNothing) {
  PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("bad");
  std::string good, partial;
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string());
    p->train_step(batch_of);
    const std::string second = save_checkpoint(*p, t, root.string());
    if (t.rank() == 0) {
      good = dir;
      partial = second;
    }
  });
  // An interrupted save: its rank files (or some of them) exist, its manifest does not.
  fs::remove(fs::path(partial) / "manifest.json");
  fs::remove(fs::path(partial) / "rank-1.pt");
  EXPECT_EQ(latest_checkpoint(root.string()), good) << "the incomplete checkpoint is skipped";
  expect_refused(c, partial, "is not a complete checkpoint (no manifest.json");

  // A truncated rank file (rank 1's) and a missing one (rank 0's): the rank that has it says
  // what is wrong, the other names that rank's file; nothing is loaded anywhere.
  const fs::path damaged = root / "damaged";
  fs::copy(good, damaged);
  fs::resize_file(damaged / "rank-1.pt", fs::file_size(damaged / "rank-1.pt") / 2);
  expect_refused(c, damaged.string(), "rank-1.pt");
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 99);
    try {
      load_checkpoint(*p, t, damaged.string());
    } catch (const PipelineError& e) {
      const std::string what = e.what();
      const std::string want = t.rank() == 1 ? "rank-1.pt cannot be read (truncated or damaged)"
                                             : "rank 1 could not load its part of";
      EXPECT_NE(what.find(want), std::string::npos) << "rank " << t.rank() << ": " << what;
    }
  });
  const fs::path missing = root / "missing";
  fs::copy(good, missing);
  fs::remove(missing / "rank-0.pt");
  expect_refused(c, missing.string(), "rank-0.pt");

  // The manifest of another pipeline: another schedule kind.
  const fs::path foreign = root / "foreign";
  fs::copy(good, foreign);
  {
    std::ifstream in(foreign / "manifest.json");
    nlohmann::json m = nlohmann::json::parse(in);
    m["schedule_kind"] = "zb-v";
    std::ofstream(foreign / "manifest.json") << m.dump();
  }
  expect_refused(c, foreign.string(),
                 "schedule_kind is \"zb-v\" in the checkpoint but \"1f1b\" in this pipeline");
  // Another schedule shape: other micro-batches.
  PipelineCase other = c;
  other.micro_batches = 2;
  expect_refused(other, good, "micro_batches is 4 in the checkpoint but 2 in this pipeline");
  // Another model: fewer blocks (its parameters are a subset of the checkpoint's).
  PipelineCase smaller = c;
  smaller.blocks = 4;
  // Rank 0's parameters are a subset ("written by another model"), rank 1's have other names
  // ("has no parameter"): each names its file.
  expect_refused(smaller, good, good + "/rank-");
  fs::remove_all(root);
}

}  // namespace
}  // namespace pipemat::pp
