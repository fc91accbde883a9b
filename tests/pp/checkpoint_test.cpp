// Checkpoints of a pipeline run (pp/checkpoint.h): a run stopped after k steps and resumed from
// its checkpoint into freshly built pipelines (other initial weights) gives every later loss and
// the final parameters of the straight run bitwise, with AdamW, an LR schedule and dropout under
// per-rank generators; incomplete, damaged and foreign checkpoints are refused, naming why,
// and change nothing.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include <sys/stat.h>
#include <unistd.h>

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

// One directory per test process: test runs that share the machine never share one.
fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("pipemat-checkpoint-test-" + name + "-" + std::to_string(::getpid()));
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
  const CheckpointRun run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    for (int64_t s = 0; s < kSteps; ++s) straight[t.rank()].push_back(p->train_step(batch_of).loss);
    straight_params[t.rank()] = params_of(*p);
  });
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    for (int64_t s = 0; s < kStop; ++s) p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string(), run);
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

// Expects load_checkpoint to fail with `text` and to leave the parameters alone: on every rank,
// or (failing >= 0) on rank `failing` with `text` and on the other with the PeerFailedError
// naming that rank (Note [Checkpoint agreement]).
void expect_refused(const PipelineCase& c, const std::string& dir, const std::string& text,
                    int failing = -1) {
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 99);
    const auto before = params_of(*p);
    try {
      load_checkpoint(*p, t, dir);
      ADD_FAILURE() << "rank " << t.rank() << ": no error for " << dir;
    } catch (const Error& e) {  // ConfigError for a foreign manifest, else PipelineError
      const bool echo = failing >= 0 && t.rank() != failing;
      if (failing >= 0) {
        EXPECT_EQ(dynamic_cast<const PeerFailedError*>(&e) != nullptr, echo) << e.what();
      }
      const std::string want =
          echo ? "rank " + std::to_string(failing) + " could not load its part of " + dir : text;
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
          << "rank " << t.rank() << ": " << e.what() << "\n  expected: " << want;
    }
    EXPECT_EQ(p->step(), 0);
    for (const auto& [name, value] : params_of(*p)) EXPECT_TRUE(at::equal(before.at(name), value));
  });
}

TEST(Checkpoint, IncompleteDamagedAndForeignCheckpointsAreRefusedAndChangeNothing) {
  PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("bad");
  std::string good, partial;
  const CheckpointRun run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string(), run);
    p->train_step(batch_of);
    const std::string second = save_checkpoint(*p, t, root.string(), run);
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
      // The size is checked first: a truncated file is not even digested.
      const std::string want = t.rank() == 1 ? "rank-1.pt is damaged or was replaced: it holds "
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

// Flips one byte of `file` at `offset`.
void flip_byte(const fs::path& file, std::streamoff offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char byte = 0;
  f.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x5a);
  f.seekp(offset);
  f.write(&byte, 1);
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Note [Verified checkpoints]: a single flipped byte anywhere in a rank file (the archive's
// header, a tensor's data, its end) is refused before anything is loaded, naming the file and
// the digests; so is a rank file of another run at the same step, even where the manifest was
// rewritten to its digest; a checkpoint of format 1 (no digests) still loads.
TEST(Checkpoint, AFlippedByteOrAnotherRunsRankFileIsRefused) {
  PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("verified"), other_root = fresh_dir("verified-other");
  std::string good, other;
  std::map<std::string, at::Tensor> saved1;
  const CheckpointRun run = new_checkpoint_run(), other_run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string(), run);
    if (t.rank() == 1) saved1 = params_of(*p);
    if (t.rank() == 0) good = dir;
  });
  on_ranks(2, [&](comm::Transport& t) {  // another run (another seed) at the same step
    auto p = make_pipeline(t, c, 8);
    p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, other_root.string(), other_run);
    if (t.rank() == 0) other = dir;
  });
  // Ranks that save as two runs (each made its own): refused, the checkpoint left incomplete.
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    try {
      save_checkpoint(*p, t, (root / "split").string(), new_checkpoint_run());
      ADD_FAILURE() << "rank " << t.rank() << ": two runs in one checkpoint were accepted";
    } catch (const PipelineError& e) {
      EXPECT_NE(std::string(e.what()).find(t.rank() == 0 ? "save_checkpoint: rank 1 saved "
                                                         : "could not write the manifest"),
                std::string::npos)
          << e.what();
    }
  });
  EXPECT_FALSE(fs::exists(root / "split" / "step-000001" / "manifest.json"));
  const nlohmann::json manifest = read_json(fs::path(good) / "manifest.json");
  EXPECT_EQ(manifest["format"], 2);
  EXPECT_EQ(manifest["files"]["rank-1.pt"]["bytes"].get<uint64_t>(),
            fs::file_size(fs::path(good) / "rank-1.pt"));
  EXPECT_EQ(manifest["files"]["rank-0.pt"]["sha256"].get<std::string>().size(), 64u);
  const auto size = static_cast<std::streamoff>(fs::file_size(fs::path(good) / "rank-1.pt"));
  int refused = 0;
  for (const std::streamoff offset :
       {std::streamoff{0}, std::streamoff{100}, size / 3, size / 2, size - 200, size - 1}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    const fs::path flipped = root / ("flipped-" + std::to_string(offset));
    fs::copy(good, flipped);
    flip_byte(flipped / "rank-1.pt", offset);
    expect_refused(c, flipped.string(),
                   (flipped / "rank-1.pt").string() + " is damaged or was replaced: its SHA-256 is",
                   1);
    // load_stage_weights checks the digests too.
    torch::nn::Sequential model = user_model::make_model(c.blocks, 1, c.dropout);
    const StageFactory split = split_sequential(model, balance_by_parameters(model, 2));
    const PipelineStage first = split(0), second = split(1);
    try {
      load_stage_weights(flipped.string(), {first.module.get(), second.module.get()});
      ADD_FAILURE() << "load_stage_weights loaded a flipped byte";
    } catch (const PipelineError& e) {
      EXPECT_NE(std::string(e.what()).find("is damaged or was replaced"), std::string::npos)
          << e.what();
      ++refused;
    }
  }
  EXPECT_EQ(refused, 6);

  // Another run's rank file at the same step, copied in.
  const fs::path crossed = root / "crossed";
  fs::copy(good, crossed);
  fs::copy_file(fs::path(other) / "rank-1.pt", crossed / "rank-1.pt",
                fs::copy_options::overwrite_existing);
  expect_refused(c, crossed.string(),
                 (crossed / "rank-1.pt").string() + " is damaged or was replaced", 1);
  // ... and with the manifest rewritten to that file's digest: the rank file names its run.
  nlohmann::json m = read_json(crossed / "manifest.json");
  m["files"]["rank-1.pt"] = read_json(fs::path(other) / "manifest.json")["files"]["rank-1.pt"];
  std::ofstream(crossed / "manifest.json") << m.dump();
  expect_refused(c, crossed.string(),
                 (crossed / "rank-1.pt").string() + " is a rank file of run " +
                     read_json(fs::path(other) / "manifest.json")["run"]["id"].get<std::string>() +
                     ", but the manifest beside it is of run " + m["run"]["id"].get<std::string>(),
                 1);

  // Format 1 (no digests) loads, with what it holds.
  const fs::path old = root / "format-1";
  fs::copy(good, old);
  nlohmann::json m1 = read_json(old / "manifest.json");
  m1["format"] = 1;
  m1.erase("files");
  std::ofstream(old / "manifest.json") << m1.dump();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 99);
    load_checkpoint(*p, t, old.string());
    EXPECT_EQ(p->step(), 1);
    if (t.rank() == 1) {
      for (const auto& [name, value] : params_of(*p))
        EXPECT_TRUE(at::equal(saved1.at(name), value));
    }
  });
  fs::remove_all(root);
  fs::remove_all(other_root);
}

// A damaged newest manifest is never skipped in silence: latest_checkpoint names it.
TEST(Checkpoint, ADamagedNewestManifestIsNamedNotSkipped) {
  PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("damaged-manifest");
  const CheckpointRun run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    for (int i = 0; i < 2; ++i) {
      p->train_step(batch_of);
      save_checkpoint(*p, t, root.string(), run);
    }
  });
  const fs::path newest = root / "step-000002" / "manifest.json";
  std::string text;
  {
    std::ifstream in(newest);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  nlohmann::json string_step = nlohmann::json::parse(text);
  string_step["step"] = "2";
  const std::vector<std::pair<std::string, std::string>> damages = {
      {"truncated", text.substr(0, text.size() / 2)},
      {"empty", ""},
      {"a string step", string_step.dump()}};
  for (const auto& [what, content] : damages) {
    SCOPED_TRACE(what);
    std::ofstream(newest, std::ios::trunc) << content;
    const auto entries = list_checkpoints(root.string());
    ASSERT_EQ(entries.size(), 2u);
    EXPECT_TRUE(entries[0].complete);
    EXPECT_TRUE(entries[1].damaged);
    EXPECT_FALSE(entries[1].complete);
    try {
      latest_checkpoint(root.string());
      ADD_FAILURE() << "a damaged newest manifest was skipped";
    } catch (const PipelineError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("the newest checkpoint under " + root.string() + " is damaged"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find(newest.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find("the newest complete one before it is " + (root / "step-000001").string()),
                std::string::npos)
          << msg;
    }
  }
  // A UTF-8 byte order mark before intact JSON damages nothing: the checkpoint is the newest.
  std::ofstream(newest, std::ios::trunc) << "\xEF\xBB\xBF" + text;
  EXPECT_EQ(latest_checkpoint(root.string()), (root / "step-000002").string());
  fs::remove_all(root);
}

// Note [Checkpoint runs]: keep_last prunes only the run's own checkpoints, never the one just
// written; another run's complete checkpoint is never overwritten or removed; a resumed run
// continues its run's id and replaces its own checkpoint at a step it passes again.
TEST(Checkpoint, RunsPruneOnlyTheirOwnCheckpointsAndNeverTheNewest) {
  PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("runs");
  const CheckpointRun a = new_checkpoint_run("digest-a");
  const CheckpointRun b = new_checkpoint_run("digest-b");
  ASSERT_EQ(a.id.size(), 32u);
  ASSERT_NE(a.id, b.id);
  std::map<std::string, at::Tensor> a_step6;
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    for (int s = 1; s <= 6; ++s) {
      p->train_step(batch_of);
      if (s == 3 || s == 6) save_checkpoint(*p, t, root.string(), a);
    }
    a_step6[std::to_string(t.rank())] = params_of(*p).begin()->second;
  });
  const auto steps_of = [&] {
    std::vector<std::string> out;
    for (const CheckpointEntry& e : list_checkpoints(root.string())) {
      out.push_back(fs::path(e.dir).filename().string() + (e.complete ? "" : "?") + ":" +
                    (e.run_id == a.id   ? "a"
                     : e.run_id == b.id ? "b"
                                        : e.run_id));
    }
    return out;
  };
  EXPECT_EQ(steps_of(), (std::vector<std::string>{"step-000003:a", "step-000006:a"}));
  const CheckpointManifest m = read_checkpoint_manifest((root / "step-000006").string());
  EXPECT_EQ(m.run_id, a.id);
  EXPECT_EQ(m.config_digest, "digest-a");
  EXPECT_EQ(resumed_run((root / "step-000003").string()).id, a.id);
  // Run b saves steps 1 and 2 with keep_last 1 (its step 1 goes, a's stay); its step 3 would
  // overwrite a's and is refused on every rank.
  std::vector<std::string> refused(2);
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 8);
    for (int s = 1; s <= 3; ++s) {
      p->train_step(batch_of);
      try {
        save_checkpoint(*p, t, root.string(), b, 1);
      } catch (const PipelineError& e) {
        refused[t.rank()] = e.what();
      }
    }
  });
  EXPECT_NE(refused[0].find("step-000003 holds a complete checkpoint of another run (run " + a.id +
                            "); this run (" + b.id + ") never overwrites it"),
            std::string::npos)
      << refused[0];
  EXPECT_NE(refused[1].find("save_checkpoint: rank 0 refused to save into"), std::string::npos)
      << refused[1];
  EXPECT_EQ(steps_of(),
            (std::vector<std::string>{"step-000002:b", "step-000003:a", "step-000006:a"}));
  EXPECT_EQ(latest_checkpoint(root.string(), b.id), (root / "step-000002").string());
  EXPECT_EQ(latest_checkpoint(root.string(), a.id), (root / "step-000006").string());
  // Run a resumes from step 3 and saves steps 5 and 6 with keep_last 1: the one just written is
  // always kept (step 6 of before is older in this run's history and goes), b's stays.
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 9);
    load_checkpoint(*p, t, (root / "step-000003").string());
    const CheckpointRun resumed = resumed_run((root / "step-000003").string());
    p->train_step(batch_of);
    p->train_step(batch_of);
    save_checkpoint(*p, t, root.string(), resumed, 1);
    if (t.rank() == 0) {
      EXPECT_EQ(fs::exists(root / "step-000005" / "manifest.json"), true);
    }
    p->train_step(batch_of);
    save_checkpoint(*p, t, root.string(), resumed, 1);  // replaces a's old step 6
    EXPECT_TRUE(at::equal(params_of(*p).begin()->second, a_step6[std::to_string(t.rank())]))
        << "the resumed run's step 6 equals the first one's bitwise";
  });
  EXPECT_EQ(steps_of(), (std::vector<std::string>{"step-000002:b", "step-000006:a"}));
  // An incomplete checkpoint counts as such, and removal takes the manifest first.
  fs::remove(root / "step-000002" / "manifest.json");
  EXPECT_EQ(steps_of(), (std::vector<std::string>{"step-000002?:", "step-000006:a"}));
  remove_checkpoint((root / "step-000006").string());
  EXPECT_FALSE(fs::exists(root / "step-000006"));
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 9);
    EXPECT_THROW(save_checkpoint(*p, t, root.string(), CheckpointRun{}), ConfigError);
  });
  fs::remove_all(root);
}

// A checkpoint saved after one step, with its directory.
std::string saved_checkpoint(const PipelineCase& c, const fs::path& root,
                             const std::function<void(Pipeline&, int rank)>& before_save = {}) {
  std::string dir;
  const CheckpointRun run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    if (before_save) before_save(*p, t.rank());
    const std::string saved = save_checkpoint(*p, t, root.string(), run);
    if (t.rank() == 0) dir = saved;
  });
  return dir;
}

// Note [Opening an input file]: a FIFO or a link to /dev/zero in place of a rank file is
// refused at once (before, the open or the read blocked forever), by load_checkpoint and by
// load_stage_weights, naming the path; nothing is loaded anywhere.
TEST(Checkpoint, AFifoOrADeviceInPlaceOfARankFileIsRefusedAtOnce) {
  const PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("fifo");
  const std::string good = saved_checkpoint(c, root);
  for (const std::string kind : {"fifo", "zero"}) {
    SCOPED_TRACE(kind);
    const fs::path copy = root / kind;
    fs::copy(good, copy);
    const fs::path bad = copy / "rank-1.pt";
    fs::remove(bad);
    if (kind == "fifo") {
      ASSERT_EQ(::mkfifo(bad.c_str(), 0600), 0);
    } else {
      fs::create_symlink("/dev/zero", bad);
    }
    const std::string want = "'" + bad.string() + "' is " +
                             (kind == "fifo" ? "a FIFO (named pipe)" : "a character device");
    expect_refused(c, copy.string(), want, 1);
    torch::nn::Sequential model = user_model::make_model(c.blocks, 1, c.dropout);
    const StageFactory split = split_sequential(model, balance_by_parameters(model, 2));
    const PipelineStage first = split(0), second = split(1);
    try {
      load_stage_weights(copy.string(), {first.module.get(), second.module.get()});
      ADD_FAILURE() << "load_stage_weights read " << bad;
    } catch (const PipelineError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  fs::remove_all(root);
}

// Note [Non-finite values at load]: one NaN in a parameter, or one infinity in the optimizer's
// state, of rank 1's file is refused naming the file, the tensor and the index; with
// allow_non_finite the checkpoint loads.
TEST(Checkpoint, ANonFiniteTensorIsRefusedNamingTheFileTheTensorAndTheIndex) {
  const PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("nan");
  std::string name;
  int stage = -1;
  const std::string dir = saved_checkpoint(c, root / "a", [&](Pipeline& p, int rank) {
    if (rank != 1) return;
    stage = p.stages().front();
    for (const auto& item : p.stage(stage).module->named_parameters()) {
      if (item.value().dim() != 2) continue;
      name = item.key();
      at::NoGradGuard no_grad;
      item.value()[1][2] = std::numeric_limits<float>::quiet_NaN();
      break;
    }
  });
  ASSERT_FALSE(name.empty());
  const std::string file = (fs::path(dir) / "rank-1.pt").string();
  expect_refused(c, dir,
                 "load_checkpoint: " + file + ": tensor 'params/" + std::to_string(stage) + "/" +
                     name + "' holds NaN at index [1, 2] (shape [",
                 1);
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 99);
    load_checkpoint(*p, t, dir, /*allow_non_finite=*/true);
    EXPECT_EQ(p->step(), 1);
    if (t.rank() == 1) {
      EXPECT_TRUE(std::isnan(p->stage(stage).module->named_parameters()[name][1][2].item<float>()));
    }
  });
  // An infinity in the optimizer's state: AdamW's second moment of rank 0's first parameter, at
  // its flat element 3.
  std::string inf_index;
  const std::string inf_dir = saved_checkpoint(c, root / "b", [&](Pipeline& p, int rank) {
    if (rank != 0) return;
    at::NoGradGuard no_grad;
    const at::Tensor& first = p.optimizer().param_groups().at(0).params().at(0);
    auto* adam = dynamic_cast<torch::optim::AdamWParamState*>(
        p.optimizer().state().at(first.unsafeGetTensorImpl()).get());
    ASSERT_NE(adam, nullptr) << "the case trains with AdamW";
    adam->exp_avg_sq().view({-1})[3] = std::numeric_limits<float>::infinity();
    inf_index = "[";
    for (int64_t d = 0; d + 1 < first.dim(); ++d) inf_index += "0, ";
    inf_index += "3]";
    ASSERT_GT(first.size(-1), 3) << "element 3 is in the first row";
  });
  expect_refused(c, inf_dir, "holds +Inf at index " + inf_index + " (shape [", 0);
  // load_stage_weights (generate, export) checks the parameters and buffers it reads, not the
  // optimizer state it does not load.
  const auto stage_weights_error = [&](const std::string& from) {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 1, c.dropout);
    const StageFactory split = split_sequential(model, balance_by_parameters(model, 2));
    const PipelineStage first = split(0), second = split(1);
    try {
      load_stage_weights(from, {first.module.get(), second.module.get()});
    } catch (const PipelineError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(stage_weights_error(dir).find("load_checkpoint: " + file + ": tensor 'params/" +
                                          std::to_string(stage) + "/" + name +
                                          "' holds NaN at index [1, 2] (shape ["),
            std::string::npos);
  EXPECT_EQ(stage_weights_error(inf_dir), "(no error)");
  fs::remove_all(root);
}

// Manifest fields are checked against the files record and the directory, and a mismatch
// names the field (before: an edited replica count read as a missing shard file, 2^40 as 0).
TEST(Checkpoint, ManifestFieldsThatDisagreeWithTheDirectoryAreNamed) {
  const PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("fields");
  const std::string good = saved_checkpoint(c, root);
  // Made a sharded checkpoint of 2 replicas by hand: shard files beside the rank files, recorded.
  const fs::path sharded = root / "sharded";
  fs::copy(good, sharded);
  nlohmann::json m = read_json(sharded / "manifest.json");
  m["format"] = 3;
  m["replicas"] = 2;
  for (int r = 0; r < 2; ++r) {
    for (int d = 0; d < 2; ++d) {
      const std::string shard =
          "rank-" + std::to_string(r) + ".shard-" + std::to_string(d) + "-of-2.pt";
      std::ofstream(sharded / shard) << "shard";
      m["files"][shard] = m["files"]["rank-0.pt"];
    }
  }
  std::ofstream(sharded / "manifest.json") << m.dump();
  EXPECT_EQ(read_checkpoint_manifest(sharded.string()).replicas, 2);
  const auto error_of = [&](const nlohmann::json& edited) {
    std::ofstream(sharded / "manifest.json") << edited.dump();
    try {
      read_checkpoint_manifest(sharded.string());
    } catch (const PipelineError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string manifest = (sharded / "manifest.json").string();
  for (const int replicas : {1, 3}) {
    nlohmann::json edited = m;
    edited["replicas"] = replicas;
    EXPECT_EQ(error_of(edited), "load_checkpoint: " + manifest + ": field 'replicas' is " +
                                    std::to_string(replicas) +
                                    " but field 'files' records the optimizer shards of 2 "
                                    "replicas (rank-0.shard-0-of-2.pt); the manifest is damaged");
  }
  nlohmann::json huge = m;
  huge["replicas"] = int64_t{1} << 40;
  EXPECT_EQ(error_of(huge), "load_checkpoint: " + manifest +
                                ": field 'replicas' is 1099511627776; expected an integer from 1 "
                                "to 65536; the manifest is damaged");
  // The files record edited to 3 replicas too: the directory holds the shards of 2.
  nlohmann::json both = m;
  both["replicas"] = 3;
  for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
    if (it.key().find(".shard-") == std::string::npos) continue;
    both["files"].erase(it.key());
  }
  for (int r = 0; r < 2; ++r) {
    for (int d = 0; d < 3; ++d) {
      both["files"]["rank-" + std::to_string(r) + ".shard-" + std::to_string(d) + "-of-3.pt"] =
          m["files"]["rank-0.pt"];
    }
  }
  EXPECT_EQ(error_of(both), "load_checkpoint: " + manifest + ": field 'replicas' is 3 but " +
                                sharded.string() +
                                " holds the optimizer shards of 2 replicas "
                                "(rank-0.shard-0-of-2.pt); the manifest is damaged");
  // A field twice (Note [Strict JSON]): an error, not the last one.
  {
    std::string text = m.dump();
    text.insert(1, "\"step\": 7, ");
    std::ofstream(sharded / "manifest.json") << text;
    try {
      read_checkpoint_manifest(sharded.string());
      ADD_FAILURE() << "a manifest with 'step' twice was read";
    } catch (const PipelineError& e) {
      EXPECT_NE(std::string(e.what()).find("load_checkpoint: " + manifest +
                                           " is not valid JSON: key 'step' appears twice"),
                std::string::npos)
          << e.what();
    }
  }
  nlohmann::json ranks = m;
  ranks["world_size"] = 3;
  EXPECT_EQ(error_of(ranks), "load_checkpoint: " + manifest +
                                 ": field 'world_size' is 3 but field 'files' records the rank "
                                 "files of 2 ranks; the manifest is damaged");
  nlohmann::json one = m;
  one["world_size"] = 1;
  one["stage_to_rank"] = std::vector<int>(m["stage_to_rank"].size(), 0);
  one["files"].erase("rank-1.pt");
  one["files"].erase("rank-1.shard-0-of-2.pt");
  one["files"].erase("rank-1.shard-1-of-2.pt");
  EXPECT_EQ(error_of(one), "load_checkpoint: " + manifest + ": field 'world_size' is 1 but " +
                               sharded.string() +
                               " holds rank files of 2 ranks (up to rank-1.pt); the manifest is "
                               "damaged");
  fs::remove_all(root);
}

}  // namespace
}  // namespace pipemat::pp
