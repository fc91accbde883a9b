// Runs that never silently corrupt, cross or lose what they write (docs/reliability.md, "Runs
// that stay their own"): one run id for the whole job, one job per checkpoint directory and
// metrics file, a damaged newest checkpoint named instead of skipped, a rank file that is not
// the one its rank wrote refused on resume, and a diverged run stopped before its checkpoint.

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>

#include "pipemat/core/error.h"
#include "pipemat/core/file_lock.h"
#include "pipemat/train/train.h"
#include "pipemat/weights/safetensors.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("pipemat-run-safety-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

// The zoo's 2-rank synthetic run, checkpointed after every step.
TrainConfig checkpointed(const fs::path& dir, int64_t steps) {
  TrainConfig c;
  c.model.kind = models::ModelKind::kRmsNormGemm;
  c.model.layers = 4;
  c.model.hidden = 16;
  c.model.tokens = 8;
  c.schedule.kind = schedule::ScheduleKind::kOneFOneB;
  c.schedule.ranks = 2;
  c.schedule.micro_batches = 2;
  c.training.steps = steps;
  c.training.lr = 0.05;
  c.checkpoint.dir = dir.string();
  c.checkpoint.every = 1;
  c.output.progress = true;
  c.output.reference_steps = 0;
  return c;
}

std::string run_id_of(const fs::path& step_dir) {
  std::ifstream in(step_dir / "manifest.json");
  return nlohmann::json::parse(in)["run"]["id"].get<std::string>();
}

template <typename E>
std::string error_of(const TrainConfig& c, std::ostream* out = nullptr) {
  try {
    train_in_process(c, out);
  } catch (const E& e) {
    return e.what();
  }
  return "(no error)";
}

// Job rank 0 makes the run id; the id printed (by the last stage's rank) is the manifests'.
TEST(RunSafety, TheRunIdPrintedIsTheManifestsOnEveryRank) {
  const fs::path dir = fresh_dir("run-id");
  std::ostringstream out;
  train_in_process(checkpointed(dir, 2), &out);
  std::smatch match;
  const std::string text = out.str();
  ASSERT_TRUE(std::regex_search(text, match, std::regex("run ([0-9a-f]{12}) \\(new\\)"))) << text;
  EXPECT_EQ(run_id_of(dir / "step-000001").substr(0, 12), match[1].str());
  EXPECT_EQ(run_id_of(dir / "step-000002").substr(0, 12), match[1].str());
  fs::remove_all(dir);
}

// Note [One job per file]: a second job on the same checkpoint.dir or output.metrics is refused
// before it changes anything, naming the holder; once the holder is gone the lock is taken.
TEST(RunSafety, ASecondJobOnOneDirectoryOrMetricsFileIsRefused) {
  const fs::path dir = fresh_dir("lock");
  fs::create_directories(dir);
  TrainConfig c = checkpointed(dir / "ck", 1);
  c.output.progress = false;
  {
    fs::create_directories(dir / "ck");
    FileLock holder((dir / "ck" / ".pipemat-lock").string(), "test", "pid 4242 on host, run abc");
    const std::string text = error_of<ConfigError>(c);
    EXPECT_NE(text.find("checkpoint.dir '" + (dir / "ck").string() +
                        "' is in use by another job: process " + std::to_string(::getpid()) +
                        " (pid 4242 on host, run abc) holds the lock"),
              std::string::npos)
        << text;
    EXPECT_FALSE(fs::exists(dir / "ck" / "step-000001")) << "the refused job wrote nothing";
  }
  c.output.metrics = (dir / "metrics.jsonl").string();
  {
    FileLock holder(c.output.metrics, "test");
    const std::string text = error_of<ConfigError>(c);
    EXPECT_NE(text.find("output.metrics '" + c.output.metrics + "' is in use by another job"),
              std::string::npos)
        << text;
  }
  train_in_process(c, nullptr);  // both locks free again
  EXPECT_TRUE(fs::exists(dir / "ck" / "step-000001" / "manifest.json"));
  std::ifstream metrics(c.output.metrics);
  std::string line;
  ASSERT_TRUE(std::getline(metrics, line));
  EXPECT_EQ(line.rfind("{\"step\":0,", 0), 0u) << line;
  fs::remove_all(dir);
}

// --resume latest: a damaged newest manifest stops the resume naming it and the step to name
// instead; an incomplete newer directory is passed over and said.
TEST(RunSafety, ResumeLatestNamesADamagedNewestCheckpointAndSaysWhatItSkipped) {
  const fs::path dir = fresh_dir("latest");
  TrainConfig c = checkpointed(dir, 3);
  train_in_process(c, nullptr);
  { std::ofstream(dir / "step-000003" / "manifest.json", std::ios::trunc) << "{\"step\": 3, "; }
  TrainConfig resume = c;
  resume.training.steps = 4;
  resume.checkpoint.resume = "latest";
  const std::string text = error_of<ConfigError>(resume);
  EXPECT_NE(text.find("checkpoint.resume: latest: the newest checkpoint " +
                      (dir / "step-000003").string() + " is damaged: "),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("--resume " + (dir / "step-000002").string()), std::string::npos) << text;

  fs::remove(dir / "step-000003" / "manifest.json");  // now an interrupted save
  std::ostringstream out;
  train_in_process(resume, &out);
  EXPECT_NE(out.str().find("resume latest: skipped " + (dir / "step-000003").string() +
                           " (incomplete: no manifest"),
            std::string::npos)
      << out.str();
  EXPECT_NE(out.str().find("resumed from " + (dir / "step-000002").string() + " after step 2"),
            std::string::npos)
      << out.str();
  fs::remove_all(dir);
}

// A flipped byte in the newest checkpoint's rank file: the resume fails on every rank with the
// file's name and the tensor whose bytes changed (from the rank that read it, not its peer's
// echo) and the checkpoint to name.
TEST(RunSafety, AFlippedByteInTheResumedRankFileIsAnErrorNamingAnOlderCheckpoint) {
  const fs::path dir = fresh_dir("flip");
  TrainConfig c = checkpointed(dir, 2);
  train_in_process(c, nullptr);
  const fs::path file = dir / "step-000002" / "rank-1.safetensors";
  const auto middle = static_cast<int64_t>(fs::file_size(file) / 2);
  std::string key;  // the tensor whose data holds the middle byte
  {
    const weights::SafetensorsFile f(file.string());
    for (const weights::TensorInfo& t : f.tensors()) {
      if (middle >= f.data_start() + t.begin && middle < f.data_start() + t.end) key = t.name;
    }
  }
  ASSERT_FALSE(key.empty()) << "the middle byte is in a tensor's data";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(middle);
    const int byte = f.get();
    f.seekp(middle);
    f.put(static_cast<char>(byte ^ 0x7f));
  }
  TrainConfig resume = c;
  resume.training.steps = 3;
  resume.checkpoint.resume = "latest";
  const std::string text = error_of<PipelineError>(resume);
  EXPECT_NE(text.find("load_checkpoint: " + file.string() + ": tensor '" + key +
                      "' is damaged or was replaced: its SHA-256 is "),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("to resume the newest complete one before it: --resume " +
                      (dir / "step-000001").string()),
            std::string::npos)
      << text;
  fs::remove_all(dir);
}

// A diverged run stops at the step whose loss is not finite, before that step's checkpoint;
// training.allow_non_finite lets it train on.
TEST(RunSafety, ADivergedRunStopsBeforeItsCheckpoint) {
  const fs::path dir = fresh_dir("diverged");
  TrainConfig c = checkpointed(dir, 6);
  c.training.lr = 1e6;
  c.output.progress = false;
  const std::string text = error_of<DivergedError>(c);
  std::smatch match;
  ASSERT_TRUE(std::regex_search(text, match,
                                std::regex("training diverged at step ([0-9]+) of 6: the loss is "
                                           "(-?nan|-?inf)")))
      << text;
  const int step = std::stoi(match[1].str());
  EXPECT_GE(step, 2) << "the first step's loss is computed before any update";
  const std::string last = (dir / ("step-00000" + std::to_string(step - 1))).string();
  EXPECT_NE(text.find("The last complete checkpoint is " + last), std::string::npos) << text;
  EXPECT_NE(
      text.find(
          "The weights were finite when the run started (every loaded tensor is "
          "checked for NaN and infinities), so the training itself diverged. Lower training.lr"),
      std::string::npos)
      << text;
  EXPECT_TRUE(fs::exists(fs::path(last) / "manifest.json"));
  EXPECT_FALSE(fs::exists(dir / ("step-00000" + std::to_string(step)))) << "nothing saved after";

  fs::remove_all(dir);
  c.training.allow_non_finite = true;
  const TrainResult r = train_in_process(c, nullptr);
  EXPECT_EQ(r.steps.size(), 6u);
  EXPECT_FALSE(std::isfinite(r.steps.back().loss));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pipemat::train
