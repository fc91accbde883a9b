// Checkpoints of a pipeline run (pp/checkpoint.h): a run stopped after k steps and resumed from
// its checkpoint into freshly built pipelines (other initial weights) gives every later loss and
// the final parameters of the straight run bitwise, with AdamW, an LR schedule and dropout under
// per-rank generators; a checkpoint (format 4: tensors by global name) loads on another stage
// split; incomplete, damaged and foreign checkpoints are refused, naming why, and change nothing.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "pipemat/comm/transport.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/weights/safetensors.h"
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

// An optimizer other than torch's SGD, Adam, AdamW, RMSprop and Adagrad: plain SGD whose step
// size shrinks with its own step count, kept in its own archive (save / load).
class CountingSgd : public torch::optim::Optimizer {
 public:
  explicit CountingSgd(const std::vector<at::Tensor>& params)
      : Optimizer({torch::optim::OptimizerParamGroup(params)},
                  std::make_unique<torch::optim::SGDOptions>(0.05)) {}
  at::Tensor step(LossClosure) override {
    at::NoGradGuard no_grad;
    ++steps_;
    for (auto& group : param_groups()) {
      const double lr = group.options().get_lr() / static_cast<double>(steps_);
      for (auto& p : group.params()) {
        if (p.grad().defined()) p.add_(p.grad(), -lr);
      }
    }
    return {};
  }
  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("steps", at::tensor({steps_}, at::kLong));
  }
  void load(torch::serialize::InputArchive& archive) override {
    at::Tensor t;
    archive.read("steps", t);
    steps_ = t.item<int64_t>();
  }

 private:
  int64_t steps_ = 0;
};

// Such an optimizer's state is its own archive of each rank (Note [Checkpoint layout]): a
// checkpoint of it resumes bitwise on the layout that wrote it and is refused, naming both
// layouts, on another.
TEST(Checkpoint, AnotherOptimizersStateResumesOnItsOwnLayout) {
  PipelineCase c;
  constexpr int64_t kSteps = 4, kStop = 2;
  const fs::path root = fresh_dir("other-optimizer");
  const auto make = [&](comm::Transport& t, const PipelineCase& k, uint64_t init) {
    torch::nn::Sequential model = user_model::make_model(k.blocks, init, k.dropout);
    auto options = user_model::pipeline_options(k);
    options.optimizer = [](const std::vector<at::Tensor>& params) {
      return std::make_unique<CountingSgd>(params);
    };
    return std::make_unique<Pipeline>(
        t, options, split_sequential(model, balance_by_parameters(model, stage_count(options))));
  };
  std::vector<double> straight, resumed;
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make(t, c, 7);
    for (int64_t s = 0; s < kSteps; ++s) {
      const double loss = p->train_step(batch_of).loss;
      if (t.rank() == 0) straight.push_back(loss);
    }
  });
  const CheckpointRun run = new_checkpoint_run();
  std::string dir;
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make(t, c, 7);
    for (int64_t s = 0; s < kStop; ++s) p->train_step(batch_of);
    const std::string d = save_checkpoint(*p, t, root.string(), run);
    if (t.rank() == 0) dir = d;
  });
  const CheckpointManifest m = read_checkpoint_manifest(dir);
  EXPECT_EQ(m.optimizer, "");
  ASSERT_NE(m.find("pipemat.optimizer.rank-0"), nullptr);
  ASSERT_NE(m.find("pipemat.optimizer.rank-1"), nullptr);
  EXPECT_EQ(m.find("pipemat.optimizer.rank-1")->pieces.at(0).file, "rank-1.safetensors");
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make(t, c, 1234);
    load_checkpoint(*p, t, dir);
    for (int64_t s = kStop; s < kSteps; ++s) {
      const double loss = p->train_step(batch_of).loss;
      if (t.rank() == 0) resumed.push_back(loss);
    }
  });
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], straight[2]);
  EXPECT_EQ(resumed[1], straight[3]);
  PipelineCase three = c;
  three.ranks = 3;
  const auto errors = user_model::run_ranks(3, [&](comm::Transport& t) {
    auto p = make(t, three, 1234);
    load_checkpoint(*p, t, dir);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("load_checkpoint: " + dir +
                             " holds the state of an optimizer other than torch's SGD, Adam, "
                             "AdamW, RMSprop or Adagrad, stored per rank: it resumes on the layout "
                             "that wrote it (2 ranks (1f1b, D=1)), not on 3 ranks (1f1b, D=1)"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  fs::remove_all(root);
}

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
  std::vector<std::map<std::string, at::Tensor>> saved_by_rank(2);
  const CheckpointRun run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string(), run);
    if (t.rank() == 0) good = dir;
    saved_by_rank[t.rank()] = params_of(*p);
    p->train_step(batch_of);
    const std::string second = save_checkpoint(*p, t, root.string(), run);
    if (t.rank() == 0) partial = second;
  });
  std::map<std::string, at::Tensor> saved = saved_by_rank[0];  // the parameters, by name
  saved.insert(saved_by_rank[1].begin(), saved_by_rank[1].end());
  // An interrupted save: its rank files (or some of them) exist, its manifest does not.
  fs::remove(fs::path(partial) / "manifest.json");
  fs::remove(fs::path(partial) / "rank-1.safetensors");
  EXPECT_EQ(latest_checkpoint(root.string()), good) << "the incomplete checkpoint is skipped";
  expect_refused(c, partial, "is not a complete checkpoint (no manifest.json");

  // A truncated rank file (rank 1's; only rank 1 reads it on this layout): the size is checked
  // against the manifest's record before its header is read; rank 0 names rank 1; nothing is
  // loaded anywhere.
  const fs::path damaged = root / "damaged";
  fs::copy(good, damaged);
  const auto whole = fs::file_size(damaged / "rank-1.safetensors");
  fs::resize_file(damaged / "rank-1.safetensors", whole / 2);
  expect_refused(c, damaged.string(),
                 "load_checkpoint: " + (damaged / "rank-1.safetensors").string() +
                     " is damaged or was replaced: it holds " + std::to_string(whole / 2) +
                     " bytes but " + (damaged / "manifest.json").string() + " recorded " +
                     std::to_string(whole) +
                     " when it was written; nothing was loaded. Load an older checkpoint",
                 1);
  // A missing rank file: rank 0's holds the generator state, which every rank reads.
  const fs::path missing = root / "missing";
  fs::copy(good, missing);
  fs::remove(missing / "rank-0.safetensors");
  expect_refused(c, missing.string(),
                 "load_checkpoint: " + (missing / "rank-0.safetensors").string() +
                     " is missing; the manifest puts tensors there");

  // Note [Checkpoint load planner]: another schedule kind and stage split (zb-v: 4 stages over
  // the 2 ranks) loads the same parameters by their global names.
  PipelineCase zbv = c;
  zbv.kind = ScheduleKind::kZeroBubbleV;
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, zbv, 99);
    const CheckpointLoad loaded = load_checkpoint(*p, t, good);
    EXPECT_EQ(p->step(), 1);
    EXPECT_EQ(loaded.from.schedule_kind, "1f1b");
    EXPECT_EQ(describe_layout(loaded.from), "2 ranks (1f1b, D=1)");
    EXPECT_EQ(describe_layout(*p), "2 ranks (zb-v, 4 virtual stages, D=1)");
    EXPECT_GT(loaded.tensor_bytes, 0);
    EXPECT_GT(loaded.bytes_read, loaded.tensor_bytes);  // the headers too
    for (const auto& [name, value] : params_of(*p)) {
      ASSERT_EQ(saved.count(name), 1u) << name;
      EXPECT_TRUE(at::equal(saved.at(name), value)) << name;
    }
  });
  // What a resume keeps (ConfigError on every rank, naming both values): the micro-batches of a
  // step, the seed, the optimizer's kind.
  PipelineCase other = c;
  other.micro_batches = 2;
  expect_refused(other, good,
                 "load_checkpoint: " + good +
                     " was written with 4 micro-batches x 1 data replicas = 4 micro-batches per "
                     "step, this pipeline has 2 x 1 = 2; a resume keeps the global batch (the "
                     "micro-batch count times the data degree)");
  PipelineCase reseeded = c;
  reseeded.seed = 6;
  expect_refused(reseeded, good,
                 "load_checkpoint: " + good +
                     " was written with seed 5 but this pipeline has seed 6; a resume keeps the "
                     "seed (PipelineOptions::seed)");
  // The manifest edited by hand to another optimizer.
  const fs::path foreign = root / "foreign";
  fs::copy(good, foreign);
  {
    std::ifstream in(foreign / "manifest.json");
    nlohmann::json m = nlohmann::json::parse(in);
    EXPECT_EQ(m["optimizer"], "AdamW");
    m["optimizer"] = "SGD";
    std::ofstream(foreign / "manifest.json") << m.dump();
  }
  expect_refused(c, foreign.string(),
                 "load_checkpoint: " + foreign.string() +
                     " holds the state of SGD but this pipeline's optimizer is AdamW");
  // Another model: fewer blocks (the checkpoint holds tensors no stage holds: every rank says
  // so), or more (the rank whose stage holds a block the checkpoint lacks names it).
  const CheckpointManifest m = read_checkpoint_manifest(good);
  std::string first_extra;  // the first tensor, by name, of a block the smaller model lacks
  for (const CheckpointTensor& t : m.tensors) {
    if (t.name.rfind("block4.", 0) == 0 || t.name.rfind("block5.", 0) == 0) {
      first_extra = t.name + "' (" + t.dtype + " [";
      for (size_t d = 0; d < t.shape.size(); ++d)
        first_extra += (d > 0 ? ", " : "") + std::to_string(t.shape[d]);
      first_extra += "])";
      break;
    }
  }
  ASSERT_FALSE(first_extra.empty());
  PipelineCase smaller = c;
  smaller.blocks = 4;
  expect_refused(smaller, good,
                 "load_checkpoint: " + good + " holds tensor '" + first_extra +
                     ", which no stage of this pipeline holds; it was written by another model "
                     "(a layer more, or other names: Note [Global names])");
  PipelineCase larger = c;
  larger.blocks = 8;
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, larger, 99);
    std::string lacking;  // the first parameter of this rank the checkpoint lacks
    for (int s : p->stages()) {
      for (const auto& item : p->stage(s).module->named_parameters()) {
        if (lacking.empty() && m.find(item.key()) == nullptr) {
          lacking =
              item.key() + "' (stage " + std::to_string(s) + "'s parameter '" + item.key() + "')";
        }
      }
    }
    try {
      load_checkpoint(*p, t, good);
      ADD_FAILURE() << "rank " << t.rank() << ": a model with 2 blocks more was loaded";
    } catch (const PipelineError& e) {
      const std::string want =
          lacking.empty() ? "rank 1 could not load its part of " + good
                          : "load_checkpoint: " + good + " holds no tensor '" + lacking +
                                "; it was written by another model (a layer fewer, or other "
                                "names: Note [Global names])";
      EXPECT_EQ(lacking.empty(), t.rank() == 0) << "the blocks added go to the last stage";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
          << "rank " << t.rank() << ": " << e.what() << "\n  expected: " << want;
    }
    EXPECT_EQ(p->step(), 0);
  });
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

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The tensor of the safetensors file `file` whose data holds the byte at `offset` of the file.
std::string tensor_at(const fs::path& file, int64_t offset) {
  const weights::SafetensorsFile f(file.string());
  for (const weights::TensorInfo& t : f.tensors()) {
    if (offset >= f.data_start() + t.begin && offset < f.data_start() + t.end) return t.name;
  }
  return "";
}

// load_stage_weights of the checkpoint `dir` into the two stages of a fresh copy of `c`'s model
// (split as a 2-rank pipeline splits it, with its global names): its error, or "(no error)".
std::string stage_weights_error(const PipelineCase& c, const std::string& dir) {
  torch::nn::Sequential model = user_model::make_model(c.blocks, 1, c.dropout);
  const StageFactory split = split_sequential(model, balance_by_parameters(model, 2));
  const PipelineStage first = split(0), second = split(1);
  try {
    load_stage_weights(dir, std::vector<const PipelineStage*>{&first, &second});
  } catch (const PipelineError& e) {
    return e.what();
  }
  return "(no error)";
}

// Note [Checkpoint load planner]: every piece a rank reads is checked against the SHA-256 the
// manifest recorded for it, and every file's header, size, run and step against the manifest, so
// a single flipped byte anywhere in a rank file (the header's length, its JSON, a tensor's name,
// the run it names, a parameter's data, the optimizer state's, the file's last byte) is refused
// before anything is loaded, naming the file and the tensor; so is a rank file of another run
// or of another step of the same run, even where the manifest was rewritten to that file's
// digests. load_stage_weights checks what it reads (parameters and buffers) the same way.
// (Formats 1 to 3: tests/e2e/legacy_checkpoints.sh.)
TEST(Checkpoint, AFlippedByteOrAnotherRunsRankFileIsRefused) {
  PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("verified"), other_root = fresh_dir("verified-other");
  std::string good, other, later;
  std::map<std::string, at::Tensor> saved1;
  const CheckpointRun run = new_checkpoint_run(), other_run = new_checkpoint_run();
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 7);
    p->train_step(batch_of);
    const std::string dir = save_checkpoint(*p, t, root.string(), run);
    if (t.rank() == 1) saved1 = params_of(*p);
    if (t.rank() == 0) good = dir;
    p->train_step(batch_of);  // the same run's step 2, elsewhere
    const std::string next = save_checkpoint(*p, t, (root / "later").string(), run);
    if (t.rank() == 0) later = next;
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
  // Note [Checkpoint layout]: the manifest records every file's size and SHA-256, and every
  // piece's key, range and SHA-256, as the files hold them.
  const fs::path file1 = fs::path(good) / "rank-1.safetensors";
  const nlohmann::json manifest = read_json(fs::path(good) / "manifest.json");
  EXPECT_EQ(manifest["format"], 4);
  EXPECT_EQ(manifest["files"].size(), 2u);
  for (const char* name : {"rank-0.safetensors", "rank-1.safetensors"}) {
    const std::string bytes = slurp(fs::path(good) / name);
    EXPECT_EQ(manifest["files"][name]["bytes"].get<uint64_t>(), bytes.size()) << name;
    EXPECT_EQ(manifest["files"][name]["sha256"].get<std::string>(), sha256_hex(bytes)) << name;
    const weights::SafetensorsFile f((fs::path(good) / name).string());
    EXPECT_EQ(f.metadata(),
              (std::map<std::string, std::string>{{"pipemat.run", run.id}, {"pipemat.step", "1"}}));
  }
  size_t pieces = 0;
  for (const auto& [name, t] : manifest["tensors"].items()) {
    for (const auto& piece : t["pieces"]) {
      const weights::SafetensorsFile f(
          (fs::path(good) / piece["file"].get<std::string>()).string());
      EXPECT_EQ(piece["key"], name) << "unsharded: one piece, under the tensor's name";
      EXPECT_EQ(piece["begin"], 0) << name;
      EXPECT_EQ(piece["sha256"].get<std::string>(), sha256_hex(f.read(piece["key"]))) << name;
      ++pieces;
    }
  }
  EXPECT_EQ(pieces, manifest["tensors"].size());
  EXPECT_EQ(manifest["tensors"]["pipemat.rng"]["pieces"][0]["file"], "rank-0.safetensors");

  // One byte flipped at each place: what load_checkpoint says on rank 1 (the text after
  // "load_checkpoint: <file> "; empty: in a tensor's data, which is named), and whether
  // load_stage_weights (parameters and buffers only) reads the damaged part.
  struct Flip {
    std::string what;
    int64_t offset;
    std::function<std::string(const std::string& file)> error;
    bool read_by_stage_weights;
  };
  const weights::SafetensorsFile header(file1.string());
  const std::string text = slurp(file1).substr(8, static_cast<size_t>(header.data_start() - 8));
  const int64_t size = static_cast<int64_t>(fs::file_size(file1));
  const weights::TensorInfo* param = nullptr;
  const weights::TensorInfo* state = nullptr;
  for (const weights::TensorInfo& t : header.tensors()) {
    const bool is_state = t.name.find(':') != std::string::npos;
    if (!is_state && param == nullptr) param = &t;
    if (state == nullptr && t.name.find(":exp_avg") != std::string::npos) state = &t;
  }
  ASSERT_NE(param, nullptr);
  ASSERT_NE(state, nullptr);
  const auto data_error = [&](const fs::path& file, const std::string& key) {
    return "load_checkpoint: " + file.string() + ": tensor '" + key +
           "' is damaged or was replaced: its SHA-256 is ";
  };
  std::string flipped_run = run.id;
  flipped_run[0] = static_cast<char>(flipped_run[0] ^ 0x5a);
  const size_t name_at = text.find("\"" + param->name + "\""), run_at = text.find(run.id);
  ASSERT_NE(name_at, std::string::npos);
  ASSERT_NE(run_at, std::string::npos);
  const std::vector<Flip> flips = {
      {"the header's length", 0,
       [](const std::string& file) {
         return "is damaged (not the file pipemat wrote): weights: " + file + ": ";
       },
       true},
      {"the header's first byte", 8,
       [](const std::string& file) {
         return "is damaged (not the file pipemat wrote): weights: " + file +
                ": the header is not valid JSON";
       },
       true},
      {"a parameter's name", 8 + static_cast<int64_t>(name_at) + 1,
       [&](const std::string&) {
         return "holds no tensor '" + param->name +
                "', which the manifest puts there; the file is damaged or was replaced";
       },
       true},
      {"the run it names", 8 + static_cast<int64_t>(run_at),
       [&](const std::string&) {
         return "is a file of run " + flipped_run +
                " step 1, but the manifest beside it is of run " + run.id +
                " step 1; a file of another run or step is never loaded";
       },
       true},
      {"a parameter's data", header.data_start() + (param->begin + param->end) / 2, nullptr, true},
      {"the optimizer state's data", header.data_start() + (state->begin + state->end) / 2, nullptr,
       false},
      {"the last byte", size - 1, nullptr, false},
  };
  for (const Flip& flip : flips) {
    SCOPED_TRACE(flip.what + " (offset " + std::to_string(flip.offset) + ")");
    ASSERT_GE(flip.offset, 0);
    const fs::path dir = root / ("flipped-" + std::to_string(flip.offset));
    fs::copy(good, dir);
    const fs::path file = dir / "rank-1.safetensors";
    std::string error;
    bool read_by_stage_weights = flip.read_by_stage_weights;
    if (flip.error) {
      error = "load_checkpoint: " + file.string() + " " + flip.error(file.string());
    } else {
      const std::string key = tensor_at(file, flip.offset);
      ASSERT_FALSE(key.empty());
      error = data_error(file, key);
      if (flip.offset == size - 1) read_by_stage_weights = key.find(':') == std::string::npos;
    }
    flip_byte(file, flip.offset);
    expect_refused(c, dir.string(), error, 1);
    const std::string loaded = stage_weights_error(c, dir.string());
    if (read_by_stage_weights) {
      EXPECT_NE(loaded.find(error), std::string::npos) << loaded << "\n  expected: " << error;
    } else {
      EXPECT_EQ(loaded, "(no error)");
    }
  }
  // The manifest edited by hand: a piece's recorded SHA-256 changed.
  const fs::path edited = root / "edited";
  fs::copy(good, edited);
  nlohmann::json me = read_json(edited / "manifest.json");
  me["tensors"][param->name]["pieces"][0]["sha256"] = std::string(64, '0');
  std::ofstream(edited / "manifest.json") << me.dump();
  expect_refused(
      c, edited.string(),
      data_error(edited / "rank-1.safetensors", param->name) +
          manifest["tensors"][param->name]["pieces"][0]["sha256"].get<std::string>().substr(0, 16) +
          "... but the manifest recorded 0000000000000000... when it was written; "
          "nothing was loaded. Load an older checkpoint",
      1);

  // Another run's rank file at the same step, copied in: it names its run.
  const fs::path crossed = root / "crossed";
  fs::copy(good, crossed);
  fs::copy_file(fs::path(other) / "rank-1.safetensors", crossed / "rank-1.safetensors",
                fs::copy_options::overwrite_existing);
  const std::string other_file = "load_checkpoint: " + (crossed / "rank-1.safetensors").string() +
                                 " is a file of run " + other_run.id +
                                 " step 1, but the manifest beside it is of run " + run.id +
                                 " step 1; a file of another run or step is never loaded";
  expect_refused(c, crossed.string(), other_file, 1);
  // ... and with the manifest rewritten to that file's record and its pieces' digests.
  nlohmann::json m = read_json(crossed / "manifest.json");
  const nlohmann::json theirs = read_json(fs::path(other) / "manifest.json");
  m["files"]["rank-1.safetensors"] = theirs["files"]["rank-1.safetensors"];
  for (auto& [name, t] : m["tensors"].items()) {
    if (t["pieces"][0]["file"] == "rank-1.safetensors") t = theirs["tensors"][name];
  }
  std::ofstream(crossed / "manifest.json") << m.dump();
  expect_refused(c, crossed.string(), other_file, 1);
  // The same run's rank file of step 2, copied into step 1: it names its step.
  const fs::path stepped = root / "stepped";
  fs::copy(good, stepped);
  fs::copy_file(fs::path(later) / "rank-1.safetensors", stepped / "rank-1.safetensors",
                fs::copy_options::overwrite_existing);
  expect_refused(c, stepped.string(),
                 "load_checkpoint: " + (stepped / "rank-1.safetensors").string() +
                     " is a file of run " + run.id +
                     " step 2, but the manifest beside it is of run " + run.id +
                     " step 1; a file of another run or step is never loaded",
                 1);

  // The intact checkpoint loads, with what it holds.
  on_ranks(2, [&](comm::Transport& t) {
    auto p = make_pipeline(t, c, 99);
    load_checkpoint(*p, t, good);
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
// load_stage_weights, naming the path; nothing is loaded anywhere. (The safetensors reader opens
// every file through core's open_input_file: Note [Safetensors checks].)
TEST(Checkpoint, AFifoOrADeviceInPlaceOfARankFileIsRefusedAtOnce) {
  const PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("fifo");
  const std::string good = saved_checkpoint(c, root);
  for (const std::string kind : {"fifo", "zero"}) {
    SCOPED_TRACE(kind);
    const fs::path copy = root / kind;
    fs::copy(good, copy);
    const fs::path bad = copy / "rank-1.safetensors";
    fs::remove(bad);
    if (kind == "fifo") {
      ASSERT_EQ(::mkfifo(bad.c_str(), 0600), 0);
    } else {
      fs::create_symlink("/dev/zero", bad);
    }
    const std::string want = "load_checkpoint: '" + bad.string() + "' is " +
                             (kind == "fifo" ? "a FIFO (named pipe)" : "a character device") +
                             "; expected a regular file";
    expect_refused(c, copy.string(), want, 1);
    const std::string loaded = stage_weights_error(c, copy.string());
    EXPECT_NE(loaded.find(want), std::string::npos) << loaded << "\n  expected: " << want;
  }
  fs::remove_all(root);
}

// Note [Non-finite values at load]: one NaN in a parameter of rank 1's file, or one infinity in
// the optimizer's state of rank 0's, is refused naming the checkpoint, the tensor by its global
// name and the index; with allow_non_finite the checkpoint loads.
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
  // split_sequential's stages name their tensors as the whole model does (Note [Global names]).
  const std::string nan_error = "load_checkpoint: " + dir + "/rank-1.safetensors: tensor '" + name +
                                "' holds NaN at index [1, 2] (shape [";
  expect_refused(c, dir, nan_error, 1);
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
  std::string inf_index, inf_name;
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
    for (int s : p.stages()) {
      for (const auto& item : p.stage(s).module->named_parameters()) {
        if (item.value().unsafeGetTensorImpl() == first.unsafeGetTensorImpl()) {
          inf_name = item.key();
        }
      }
    }
  });
  ASSERT_FALSE(inf_name.empty());
  expect_refused(c, inf_dir,
                 "load_checkpoint: " + inf_dir + "/rank-0.safetensors: tensor '" + inf_name +
                     ":exp_avg_sq' holds +Inf at index " + inf_index + " (shape [",
                 0);
  // load_stage_weights (generate, export) checks the parameters and buffers it reads, not the
  // optimizer state it does not load.
  EXPECT_NE(stage_weights_error(c, dir).find(nan_error), std::string::npos);
  EXPECT_EQ(stage_weights_error(c, inf_dir), "(no error)");
  fs::remove_all(root);
}

// Manifest fields are checked against the files record and the directory, and a mismatch
// names the field (before: an edited replica count read as a missing shard file, 2^40 as 0);
// the tensor index of format 4 is checked entry by entry (Note [Checkpoint layout]).
TEST(Checkpoint, ManifestFieldsThatDisagreeWithTheDirectoryAreNamed) {
  const PipelineCase c = dropout_case(ScheduleKind::kOneFOneB);
  const fs::path root = fresh_dir("fields");
  const std::string good = saved_checkpoint(c, root);
  // Made a sharded checkpoint of 2 replicas by hand: shard files beside the rank files, recorded.
  const fs::path sharded = root / "sharded";
  fs::copy(good, sharded);
  nlohmann::json m = read_json(sharded / "manifest.json");
  ASSERT_EQ(m["format"], 4);
  EXPECT_EQ(m["replicas"], 1);
  EXPECT_EQ(m["sharded"], false);
  m["replicas"] = 2;
  m["sharded"] = true;
  for (int r = 0; r < 2; ++r) {
    for (int d = 0; d < 2; ++d) {
      const std::string shard =
          "rank-" + std::to_string(r) + ".shard-" + std::to_string(d) + "-of-2.safetensors";
      std::ofstream(sharded / shard) << "shard";
      m["files"][shard] = m["files"]["rank-0.safetensors"];
    }
  }
  std::ofstream(sharded / "manifest.json") << m.dump();
  EXPECT_EQ(read_checkpoint_manifest(sharded.string()).replicas, 2);
  EXPECT_TRUE(read_checkpoint_manifest(sharded.string()).sharded);
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
  const auto damaged = [&](const std::string& what) {
    return "load_checkpoint: " + manifest + ": " + what + "; the manifest is damaged";
  };
  for (const int replicas : {1, 3}) {
    nlohmann::json edited = m;
    edited["replicas"] = replicas;
    EXPECT_EQ(error_of(edited), damaged("field 'replicas' is " + std::to_string(replicas) +
                                        " but field 'files' records the optimizer shards of 2 "
                                        "replicas (rank-0.shard-0-of-2.safetensors)"));
  }
  // Shard files recorded for a checkpoint that says it is not sharded.
  nlohmann::json unsharded = m;
  unsharded["sharded"] = false;
  EXPECT_EQ(error_of(unsharded), damaged("field 'sharded' is false but field 'files' records the "
                                         "optimizer shards of 2 replicas "
                                         "(rank-0.shard-0-of-2.safetensors)"));
  nlohmann::json huge = m;
  huge["replicas"] = int64_t{1} << 40;
  EXPECT_EQ(error_of(huge),
            damaged("field 'replicas' is 1099511627776; expected an integer from 1 to 65536"));
  // The files record edited to 3 replicas too: the directory holds the shards of 2.
  nlohmann::json both = m;
  both["replicas"] = 3;
  for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
    if (it.key().find(".shard-") == std::string::npos) continue;
    both["files"].erase(it.key());
  }
  for (int r = 0; r < 2; ++r) {
    for (int d = 0; d < 3; ++d) {
      both["files"]["rank-" + std::to_string(r) + ".shard-" + std::to_string(d) +
                    "-of-3.safetensors"] = m["files"]["rank-0.safetensors"];
    }
  }
  EXPECT_EQ(error_of(both), damaged("field 'replicas' is 3 but " + sharded.string() +
                                    " holds the optimizer shards of 2 replicas "
                                    "(rank-0.shard-0-of-2.safetensors)"));
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
  EXPECT_EQ(error_of(ranks), damaged("field 'world_size' is 3 but field 'files' records the rank "
                                     "files of 2 ranks"));
  nlohmann::json one = m;
  one["world_size"] = 1;
  one["stage_to_rank"] = std::vector<int>(m["stage_to_rank"].size(), 0);
  one["files"].erase("rank-1.safetensors");
  one["files"].erase("rank-1.shard-0-of-2.safetensors");
  one["files"].erase("rank-1.shard-1-of-2.safetensors");
  for (auto& [name, t] : one["tensors"].items()) t["pieces"][0]["file"] = "rank-0.safetensors";
  EXPECT_EQ(error_of(one), damaged("field 'world_size' is 1 but " + sharded.string() +
                                   " holds rank files of 2 ranks (up to rank-1.safetensors)"));

  // Format 4's index: every tensor's dtype, shape and pieces, and the ties.
  const std::string name = m["tensors"].begin().key();  // the first tensor by name
  const nlohmann::json entry = m["tensors"][name];
  const int64_t numel = entry["pieces"][0]["end"].get<int64_t>();
  ASSERT_GT(numel, 1);
  const std::string where = "tensor '" + name + "'";
  const auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json edited = m;
    edit(edited);
    return error_of(edited);
  };
  EXPECT_EQ(with([](nlohmann::json& e) { e.erase("tensors"); }),
            damaged("field 'tensors' is missing; expected the index of every tensor"));
  EXPECT_EQ(with([&](nlohmann::json& e) { e["tensors"][name]["dtype"] = "F8"; }),
            damaged(where + " has the dtype 'F8', which safetensors does not have (F64, F32, F16, "
                            "BF16, I64, I32, I16, I8, U8, BOOL)"));
  EXPECT_EQ(with([&](nlohmann::json& e) { e["tensors"][name].erase("shape"); }),
            damaged(where + " has no shape (an array of at most 16 sizes)"));
  EXPECT_EQ(with([&](nlohmann::json& e) { e["tensors"][name]["stage"] = 2; }),
            damaged(where + ": field 'stage' is 2; expected an integer from -1 to 1"));
  EXPECT_EQ(
      with([&](nlohmann::json& e) { e["tensors"][name]["pieces"] = nlohmann::json::array(); }),
      damaged(where + " has no pieces"));
  EXPECT_EQ(with([&](nlohmann::json& e) {
              e["tensors"][name]["pieces"][0]["file"] = "rank-7.safetensors";
            }),
            damaged(where + " lies in rank-7.safetensors, which field 'files' does not record"));
  EXPECT_EQ(with([&](nlohmann::json& e) { e["tensors"][name]["pieces"][0]["sha256"] = "00"; }),
            damaged(where + " has a piece without a key or a SHA-256"));
  EXPECT_EQ(with([&](nlohmann::json& e) { e["tensors"][name]["pieces"][0]["begin"] = 1; }),
            damaged(where + "'s pieces do not cover its " + std::to_string(numel) +
                    " elements once, in order (a piece starts at 1, expected 0)"));
  EXPECT_EQ(with([&](nlohmann::json& e) { e["tensors"][name]["pieces"][0]["end"] = numel - 1; }),
            damaged(where + "'s pieces cover " + std::to_string(numel - 1) + " of its " +
                    std::to_string(numel) + " elements"));
  EXPECT_EQ(with([&](nlohmann::json& e) {
              nlohmann::json twice = e["tensors"][name]["pieces"][0];
              e["tensors"][name]["pieces"].push_back(twice);
            }),
            damaged(where + "'s pieces do not cover its " + std::to_string(numel) +
                    " elements once, in order (a piece starts at 0, expected " +
                    std::to_string(numel) + ")"));
  EXPECT_EQ(with([](nlohmann::json& e) { e.erase("ties"); }),
            damaged("field 'ties' is missing; expected an object (empty without tied weights)"));
  EXPECT_EQ(with([](nlohmann::json& e) { e["ties"]["embedding"] = "lm_head.weight"; }),
            damaged("field 'ties' maps 'embedding' to \"lm_head.weight\", which is no tensor of "
                    "the index"));
  EXPECT_EQ(with([](nlohmann::json& e) { e.erase("sharded"); }),
            damaged("field 'sharded' is missing; expected true or false"));
  EXPECT_EQ(with([](nlohmann::json& e) { e["sharded"] = "yes"; }),
            damaged("field 'sharded' is \"yes\"; expected true or false"));
  EXPECT_EQ(with([](nlohmann::json& e) { e.erase("optimizer"); }),
            damaged("field 'optimizer' is missing"));
  EXPECT_EQ(with([](nlohmann::json& e) { e["format"] = 5; }),
            "load_checkpoint: " + manifest +
                " is of format 5; this pipemat reads formats 1 to 4 (it was written by a newer "
                "pipemat)");
  fs::remove_all(root);
}

}  // namespace
}  // namespace pipemat::pp
