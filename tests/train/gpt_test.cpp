// Training the main job's model: the text data source, the byte-level GPT through the pipeline
// against the same model trained in one process (dropout on, every schedule, none / full /
// selective remat), the loss curve, and sampling from a checkpoint with `generate_text`.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/dropout.h"
#include "pipemat/models/gpt.h"
#include "pipemat/train/generate.h"
#include "pipemat/train/loss_curve.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/text_data.h"
#include "pipemat/train/train.h"
#include "pipemat/weights/safetensors.h"
#include "text_config.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name =
        "pipemat_gpt_" + std::string(info->name()) + "_" + std::to_string(::getpid());
    std::replace(name.begin(), name.end(), '/', '_');  // parameterized test names
    path_ = fs::temp_directory_path() / name;
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Deterministic English-like text: words from a small list picked by an LCG, in lines.
std::string words(size_t bytes, uint32_t seed = 1) {
  const char* list[] = {"the", "cat",  "sat", "on",  "a",   "mat", "and", "dog", "ran", "to",
                        "see", "what", "it",  "was", "not", "fun", "but", "we",  "all", "laughed"};
  std::string text;
  uint32_t x = seed;
  while (text.size() < bytes) {
    x = x * 1664525u + 1013904223u;
    text += list[(x >> 16) % 20];
    text += ((x >> 8) % 9 == 0) ? ".\n" : " ";
  }
  text.resize(bytes);
  return text;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

// ---- text data ---------------------------------------------------------------------------

TEST(TextData, SplitIsEveryTwentiethBlockAtFivePercent) {
  TempDir dir;
  const std::string text = words(40 * kSplitBlock + 100);  // 41 blocks, the last short
  write(dir.path() / "a.txt", text);
  const TextCorpus c = load_text((dir.path() / "a.txt").string(), 0.05, 33);
  // Blocks 19 and 39 ((i + 1) * 0.05 crosses an integer) are validation.
  EXPECT_EQ(c.validation, text.substr(19 * kSplitBlock, kSplitBlock) +
                              text.substr(39 * kSplitBlock, kSplitBlock));
  EXPECT_EQ(c.train.size(), text.size() - 2 * kSplitBlock);
  EXPECT_EQ(c.train.substr(0, 19 * kSplitBlock), text.substr(0, 19 * kSplitBlock));
  EXPECT_EQ(c.files, (std::vector<std::string>{(dir.path() / "a.txt").string()}));
}

TEST(TextData, DirectoryReadsTextFilesInOrderSkippingBinaryAndLinks) {
  TempDir dir;
  fs::create_directories(dir.path() / "sub");
  write(dir.path() / "b.txt", words(3 * kSplitBlock, 2));
  write(dir.path() / "sub" / "a.txt", words(3 * kSplitBlock, 3));
  write(dir.path() / "b.dat", std::string("\x00\x01\x02index", 8));
  fs::create_symlink(dir.path() / "b.txt", dir.path() / "c.u8");
  const TextCorpus c = load_text(dir.path().string(), 0.25, 10);
  EXPECT_EQ(c.files, (std::vector<std::string>{(dir.path() / "b.txt").string(),
                                               (dir.path() / "sub" / "a.txt").string()}));
  EXPECT_EQ(c.skipped_binary, 1);
  EXPECT_EQ(c.train.size() + c.validation.size(), 6u * kSplitBlock);
  EXPECT_EQ(c.validation.size(), 1u * kSplitBlock);  // blocks 3: floor(4 * 0.25) > floor(3 * 0.25)
}

// Issue 44, finding 10: /dev/zero read until memory ran out, a FIFO blocked forever; both are
// refused by a stat before any open (the test would hang on the FIFO otherwise), as is a file
// inside a directory that is a FIFO (skipped: only regular files are read there).
TEST(TextData, DevicesAndFifosAreRefusedBeforeReading) {
  EXPECT_EQ(error_of([] { load_text("/dev/zero", 0.05, 10); }),
            "data.path: '/dev/zero' is a character device; expected a regular file (copy the data "
            "into a file and give its path)");
  TempDir dir;
  const std::string fifo = (dir.path() / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { load_text(fifo, 0.05, 10); }),
            "data.path: '" + fifo +
                "' is a FIFO (named pipe); expected a regular file (copy the data into a file and "
                "give its path)");
  write(dir.path() / "a.txt", words(4 * kSplitBlock));
  EXPECT_EQ(load_text(dir.path().string(), 0.25, 10).files,
            (std::vector<std::string>{(dir.path() / "a.txt").string()}));
}

// Issue 44, finding 10: schedule.csv was read to its end whatever it was: /dev/zero until memory
// ran out, a FIFO forever.
TEST(ScheduleCsv, DevicesFifosAndDirectoriesAreRefusedNamingTheKey) {
  TrainConfig c;
  c.schedule_csv = "/dev/zero";
  EXPECT_EQ(error_of([&] { resolve_schedule(c); }),
            "schedule.csv: '/dev/zero' is a character device; expected a regular file (copy the "
            "data into a file and give its path)");
  TempDir temp;
  const fs::path dir = temp.path();
  const std::string fifo = (dir / "pipe.csv").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  c.schedule_csv = fifo;
  EXPECT_EQ(error_of([&] { resolve_schedule(c); }),
            "schedule.csv: '" + fifo +
                "' is a FIFO (named pipe); expected a regular file (copy the data into a file and "
                "give its path)");
  c.schedule_csv = dir.string();
  EXPECT_EQ(error_of([&] { resolve_schedule(c); }),
            "schedule.csv: '" + dir.string() +
                "' is a directory; expected a regular file (copy the data into a file and give "
                "its path)");
}

// Issue 44, finding 9: a misspelt pattern of the config's policy matched nothing on each stage
// and was skipped; the whole model is on every rank here, so it is checked against all stages.
TEST(ModelRun, RematPatternThatMatchesOnNoStageNamesItsKeyAndTheNearestPath) {
  TrainConfig c;
  c.model.kind = models::ModelKind::kRmsNormGemm;
  c.model.layers = 4;
  c.model.hidden = 8;
  c.model.tokens = 4;
  c.remat.policy = models::RematPolicyKind::kCustom;
  c.remat.custom.checkpoint = {"layers.*"};
  c.remat.custom.exclude = {{"layers.*.gemn", true}};
  EXPECT_EQ(error_of([&] { make_model_run(c, 2); }),
            "remat.exclude[0].path: 'layers.*.gemn' matches no module on any of the model's 2 "
            "stages (paths are relative to each stage's module); the nearest module path is "
            "'layers.0.gemm'. Fix the pattern or remove it");
  c.remat.custom.exclude = {{"layers.*.gemm", true}};
  c.remat.custom.checkpoint = {"layers.3"};  // on one stage only: stage-relative "layers.3"
  EXPECT_NE(error_of([&] { make_model_run(c, 2); }).find("remat.checkpoint[0]: 'layers.3' "),
            std::string::npos);
  c.remat.custom.checkpoint = {"layers.1"};  // the second layer of each stage
  EXPECT_EQ(error_of([&] { make_model_run(c, 2); }), "no error");
}

TEST(TextData, BadPathsAreClearErrors) {
  TempDir dir;
  const std::string missing = (dir.path() / "none").string();
  EXPECT_EQ(error_of([&] { load_text(missing, 0.05, 10); }),
            "data.path: '" + missing +
                "' does not exist; give a text file or a directory of "
                "text files");
  write(dir.path() / "empty.txt", "");
  const std::string empty = (dir.path() / "empty.txt").string();
  EXPECT_EQ(error_of([&] { load_text(empty, 0.05, 10); }), "data.path: '" + empty + "' is empty");
  write(dir.path() / "bin", std::string("abc\0def", 7));
  const std::string bin = (dir.path() / "bin").string();
  EXPECT_EQ(error_of([&] { load_text(bin, 0.05, 10); }),
            "data.path: '" + bin +
                "' is binary (a NUL byte at offset 3); give a text file or a "
                "directory of text files");
  fs::create_directories(dir.path() / "only-binary");
  write(dir.path() / "only-binary" / "x.dat", std::string("\0\0", 2));
  const std::string only = (dir.path() / "only-binary").string();
  EXPECT_EQ(error_of([&] { load_text(only, 0.05, 10); }),
            "data.path: '" + only + "' holds no text files (1 binary files skipped)");
  write(dir.path() / "small.txt", words(2 * kSplitBlock));
  const std::string small = (dir.path() / "small.txt").string();
  EXPECT_EQ(
      error_of([&] { load_text(small, 0.05, 10); }),
      "data.path: '" + small +
          "' has 8192 bytes: 8192 for training and 0 for validation "
          "(4096-byte blocks, data.validation 0.05), but a window needs 10 (model.seq_len + 1); "
          "give more text or a shorter model.seq_len");
}

TEST(TextData, WindowsAreNextByteTargetsAndDeterministic) {
  const std::string text = words(5000);
  auto [ids, next] = text_windows(text, 3, 16, 7, 2, 1);
  EXPECT_EQ(ids.sizes(), (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(ids.scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(ids.narrow(1, 1, 15), next.narrow(1, 0, 15)));
  // Every row is a substring of the text.
  for (int64_t b = 0; b < 3; ++b) {
    std::string row;
    for (int64_t j = 0; j < 16; ++j) row.push_back(static_cast<char>(ids[b][j].item<int64_t>()));
    EXPECT_NE(text.find(row), std::string::npos) << row;
  }
  auto [again, again_next] = text_windows(text, 3, 16, 7, 2, 1);
  EXPECT_TRUE(at::equal(ids, again));
  EXPECT_FALSE(at::equal(ids, text_windows(text, 3, 16, 7, 2, 2).first));
  EXPECT_FALSE(at::equal(ids, text_windows(text, 3, 16, 7, 3, 1).first));
  EXPECT_FALSE(at::equal(ids, text_windows(text, 3, 16, 8, 2, 1).first));
}

// ---- the GPT through the pipeline ----------------------------------------------------------

TrainConfig gpt_config(const std::string& text_path, const std::string& kind,
                       const std::string& policy) {
  TrainConfig c = testing::text_config(text_path, kind, policy);
  c.model.kind = models::ModelKind::kGpt;
  c.model.layers = 4;
  c.model.hidden = 16;
  c.model.heads = 2;
  c.model.ffn = 32;
  c.model.dropout = 0.2;
  return c;
}

struct GptCase {
  std::string kind;
  std::string policy;
};

class GptGrid : public ::testing::TestWithParam<GptCase> {};

TEST_P(GptGrid, DropoutRunEqualsTheSingleProcessTrainingBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  const TrainConfig c =
      gpt_config((dir.path() / "text.txt").string(), GetParam().kind, GetParam().policy);
  const TrainResult ref = testing::expect_pipeline_equals_reference(c);
  std::map<std::string, at::Tensor> want(ref.params.begin(), ref.params.end());
  EXPECT_TRUE(want.count("blocks.3.attn.qkv.weight"));  // global block numbering
  EXPECT_TRUE(want.count("embed.tok.weight"));
  EXPECT_TRUE(want.count("head.out.weight"));
}

INSTANTIATE_TEST_SUITE_P(Schedules, GptGrid,
                         ::testing::Values(GptCase{"gpipe", "selective"}, GptCase{"1f1b", "none"},
                                           GptCase{"1f1b", "full"}, GptCase{"1f1b", "selective"},
                                           GptCase{"interleaved", "selective"},
                                           GptCase{"zb-h1", "selective"}, GptCase{"zb-h2", "full"},
                                           GptCase{"zb-v", "selective"}, GptCase{"zb-v", "none"}),
                         [](const ::testing::TestParamInfo<GptCase>& test) {
                           std::string n = test.param.kind + "_" + test.param.policy;
                           for (auto& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

// model.vocab: a vocabulary of 1000 and of 32,000 ids (the text's bytes are the first 256) sizes
// the embedding and the head, and the pipeline still equals the single process bitwise, in fp32
// and bf16, on 1f1b and zb-v (2 ranks) and on 2 replicas x 2 stages, sharded.
TEST(GptVocab, AnyVocabularyEqualsTheSingleProcessBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  for (const int64_t vocab : {int64_t{1000}, int64_t{32000}}) {
    for (const char* kind : {"1f1b", "zb-v"}) {
      for (const bool bf16 : {false, true}) {
        SCOPED_TRACE(std::to_string(vocab) + " " + kind + (bf16 ? " bf16" : " fp32"));
        TrainConfig c = gpt_config((dir.path() / "text.txt").string(), kind, "selective");
        c.model.vocab = vocab;
        if (bf16) c.training.precision = pp::Precision::kBFloat16;
        const TrainResult ref = testing::expect_pipeline_equals_reference(c);
        std::map<std::string, at::Tensor> got(ref.params.begin(), ref.params.end());
        EXPECT_EQ(got.at("embed.tok.weight").sizes(), (std::vector<int64_t>{vocab, 16}));
        EXPECT_EQ(got.at("head.out.weight").sizes(), (std::vector<int64_t>{vocab, 16}));
        // Small initial weights give near-uniform logits: the first loss is about ln(vocab).
        EXPECT_NEAR(ref.steps.at(0).loss, std::log(static_cast<double>(vocab)), 0.1);
      }
    }
  }
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "zb-v", "selective");
  c.model.vocab = 1000;
  c.parallel.data = 2;
  c.parallel.shard_optimizer = true;
  testing::expect_pipeline_equals_reference(c);
}

// Note [Mixed precision]: the GPT with dropout, AdamW, clipping and validation under bf16
// (fused attention, remat's SAVE regions on the GEMMs, pre-triggered replay) equals the single
// process bitwise under 1F1B and ZB-V.
TEST(GptBf16, DropoutRunEqualsTheSingleProcessTrainingBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  for (const char* kind : {"1f1b", "zb-v"}) {
    SCOPED_TRACE(kind);
    TrainConfig c = gpt_config((dir.path() / "text.txt").string(), kind, "selective");
    c.training.precision = pp::Precision::kBFloat16;
    testing::expect_pipeline_equals_reference(c);
  }
}

// Note [Data x pipeline]: 2 replicas of the 2-rank GPT pipeline (4 ranks as threads) with
// dropout, AdamW, clipping, warmup and cosine decay, and validation equal the single process
// that combines the replicas' gradients in replica order, bitwise; zb-v splits every backward.
class GptDataGrid : public ::testing::TestWithParam<GptCase> {};

TEST_P(GptDataGrid, TwoReplicasEqualTheSingleProcessOnTheGlobalBatchBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c =
      gpt_config((dir.path() / "text.txt").string(), GetParam().kind, GetParam().policy);
  c.parallel.data = 2;
  const TrainResult ref = testing::expect_pipeline_equals_reference(c);
  ASSERT_FALSE(ref.steps.empty());
  // The global batch is both replicas' micro-batches: one replica alone trains another model.
  c.parallel.data = 1;
  const TrainResult one = train_reference(c, nullptr);
  EXPECT_NE(one.steps[0].loss, ref.steps[0].loss);
}

INSTANTIATE_TEST_SUITE_P(Schedules, GptDataGrid,
                         ::testing::Values(GptCase{"1f1b", "selective"},
                                           GptCase{"zb-h1", "selective"},
                                           GptCase{"zb-v", "selective"}),
                         [](const ::testing::TestParamInfo<GptCase>& test) {
                           std::string n = test.param.kind + "_" + test.param.policy;
                           for (auto& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

// Note [Data x pipeline]: replica 0 writes the checkpoints (one file per pipeline rank), every
// replica resumes from them, and 2 replicas stopped after step 2 and resumed train bitwise as
// the uninterrupted run (validation shared between the replicas included); the checkpoint also
// resumes with one replica (the same pipeline) that runs the same micro-batches per step (twice
// its micro-batches), and is refused naming both counts when the global batch would change.
TEST(GptData, ReplicasCheckpointAndResumeBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "zb-h1", "selective");
  c.parallel.data = 2;
  c.training.steps = 4;
  const TrainResult whole = train_in_process(c, nullptr);
  ASSERT_EQ(whole.steps.size(), 4u);
  c.checkpoint.dir = (dir.path() / "ck").string();
  c.training.stop_after = 2;
  const TrainResult first = train_in_process(c, nullptr);
  ASSERT_EQ(first.steps.size(), 2u);
  EXPECT_EQ(first.final_checkpoint, c.checkpoint.dir + "/step-000002");
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(first.final_checkpoint))
    files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"manifest.json", "rank-0.safetensors",
                                             "rank-1.safetensors"}));

  c.training.stop_after = 0;
  c.checkpoint.resume = "latest";
  const TrainResult second = train_in_process(c, nullptr);
  ASSERT_EQ(second.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(second.steps[k].step, whole.steps[k + 2].step);
    EXPECT_EQ(second.steps[k].loss, whole.steps[k + 2].loss) << "step " << k + 2;
  }
  ASSERT_EQ(second.validation.size(), 1u);  // after step 4 (eval_every 2: step 2 ran before)
  EXPECT_EQ(second.validation[0].second, whole.validation.back().second);
  std::map<std::string, at::Tensor> want(whole.params.begin(), whole.params.end());
  ASSERT_EQ(second.params.size(), want.size());
  for (const auto& [name, value] : second.params)
    EXPECT_TRUE(at::equal(value, want[name])) << "parameter " << name;

  // One replica resumes the same checkpoint with the same global batch (8 micro-batches): its
  // steps go on from step 2. With its 4 micro-batches (half the global batch) it is refused.
  c.parallel.data = 1;
  c.checkpoint.resume = first.final_checkpoint;
  c.checkpoint.dir = (dir.path() / "ck1").string();
  try {
    train_in_process(c, nullptr);
    ADD_FAILURE() << "one replica of 4 micro-batches resumed a checkpoint of 2 x 4";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "load_checkpoint: " + first.final_checkpoint +
                  " was written with 4 micro-batches x 2 data replicas = 8 micro-batches per "
                  "step, this pipeline has 4 x 1 = 4; a resume keeps the global batch (the "
                  "micro-batch count times the data degree)"),
              std::string::npos)
        << e.what();
  }
  c.schedule.micro_batches = 8;
  const TrainResult single = train_in_process(c, nullptr);
  ASSERT_EQ(single.steps.size(), 2u);
  EXPECT_EQ(single.steps[0].step, 2);
  EXPECT_EQ(single.steps[1].step, 3);
}

// Note [Sharded optimizer]: a sharded checkpoint holds every replica's shard, so 2 sharded
// replicas stopped after step 2 and resumed sharded, or resumed unsharded, train bitwise as the
// uninterrupted unsharded run, and so do sharded replicas resumed from an unsharded checkpoint;
// 3 replicas (other slices) resume a sharded checkpoint of 2 replicas sharded as they do
// unsharded (the same micro-batches per step: 2 x 6 = 3 x 4). A damaged or missing shard file is
// an error naming it (and the damaged tensor).
TEST(GptData, ShardedCheckpointsResumeShardedOrNotBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "zb-v", "selective");
  c.parallel.data = 2;
  c.training.steps = 4;
  const TrainResult whole = train_in_process(c, nullptr);
  ASSERT_EQ(whole.steps.size(), 4u);
  std::map<std::string, at::Tensor> want(whole.params.begin(), whole.params.end());
  // The second half of a run resumed from `from`, with or without sharding, equals `whole`'s.
  auto expect_resumes = [&](const std::string& from, bool shard, const std::string& out) {
    TrainConfig r = c;
    r.parallel.shard_optimizer = shard;
    r.checkpoint.resume = from;
    r.checkpoint.dir = (dir.path() / out).string();
    const TrainResult second = train_in_process(r, nullptr);
    ASSERT_EQ(second.steps.size(), 2u);
    for (size_t k = 0; k < 2; ++k)
      EXPECT_EQ(second.steps[k].loss, whole.steps[k + 2].loss) << out << ": step " << k + 2;
    ASSERT_EQ(second.params.size(), want.size());
    for (const auto& [name, value] : second.params)
      EXPECT_TRUE(at::equal(value, want[name])) << out << ": parameter " << name;
  };
  auto first_half = [&](bool shard, const std::string& out, int micro_batches = 4) {
    TrainConfig r = c;
    r.parallel.shard_optimizer = shard;
    r.schedule.micro_batches = micro_batches;
    r.checkpoint.dir = (dir.path() / out).string();
    r.training.stop_after = 2;
    const TrainResult first = train_in_process(r, nullptr);
    EXPECT_EQ(first.steps.size(), 2u);
    EXPECT_EQ(first.final_checkpoint, r.checkpoint.dir + "/step-000002");
    return first.final_checkpoint;
  };
  const std::string sharded = first_half(true, "sharded");
  // Note [Checkpoint layout]: each rank's file holds no optimizer state; each replica wrote its
  // shard (its pieces of each parameter's state, "<name>:<field>@<begin>"), and the manifest
  // indexes every piece.
  const std::string manifest = slurp(fs::path(sharded) / "manifest.json");
  EXPECT_NE(manifest.find("\"format\": 4"), std::string::npos) << manifest;
  EXPECT_NE(manifest.find("\"replicas\": 2"), std::string::npos) << manifest;
  EXPECT_NE(manifest.find("\"sharded\": true"), std::string::npos) << manifest;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(sharded)) files.push_back(e.path().filename());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{
                       "manifest.json", "rank-0.safetensors", "rank-0.shard-0-of-2.safetensors",
                       "rank-0.shard-1-of-2.safetensors", "rank-1.safetensors",
                       "rank-1.shard-0-of-2.safetensors", "rank-1.shard-1-of-2.safetensors"}));
  for (const std::string& name : files) {
    if (name == "manifest.json") continue;
    EXPECT_NE(manifest.find("\"" + name + "\""), std::string::npos) << name;
    const weights::SafetensorsFile f((fs::path(sharded) / name).string());
    bool optimizer = false;
    for (const weights::TensorInfo& t : f.tensors())
      optimizer = optimizer || t.name.find(':') != std::string::npos;
    EXPECT_EQ(optimizer, name.find(".shard-") != std::string::npos) << name;
  }
  expect_resumes(sharded, true, "sharded-sharded");
  expect_resumes(sharded, false, "sharded-plain");
  expect_resumes(first_half(false, "plain"), true, "plain-sharded");

  // 3 replicas of 4 micro-batches resume 2 sharded replicas of 6 (another replica count, so
  // other slices): compared with 3 unsharded replicas from the same state.
  const std::string sharded6 = first_half(true, "sharded-6", 6);
  auto three = [&](bool shard, const std::string& out) {
    TrainConfig r = c;
    r.parallel.data = 3;
    r.parallel.shard_optimizer = shard;
    r.checkpoint.resume = sharded6;
    r.checkpoint.dir = (dir.path() / out).string();
    return train_in_process(r, nullptr);
  };
  const TrainResult a = three(true, "three-sharded"), b = three(false, "three-plain");
  ASSERT_EQ(a.steps.size(), 2u);
  ASSERT_EQ(b.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) EXPECT_EQ(a.steps[k].loss, b.steps[k].loss) << "step " << k + 2;
  std::map<std::string, at::Tensor> b_params(b.params.begin(), b.params.end());
  for (const auto& [name, value] : a.params)
    EXPECT_TRUE(at::equal(value, b_params[name])) << "3 replicas: parameter " << name;

  // A shard file with one byte flipped (its last: in a tensor's data), or gone: the resume fails
  // naming it.
  auto resume_error = [&](const std::string& from) {
    TrainConfig r = c;
    r.parallel.shard_optimizer = true;
    r.checkpoint.resume = from;
    r.checkpoint.dir = (dir.path() / "broken-out").string();
    try {
      train_in_process(r, nullptr);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const fs::path broken = dir.path() / "broken";
  fs::copy(sharded, broken, fs::copy_options::recursive);
  const fs::path shard = broken / "rank-1.shard-1-of-2.safetensors";
  const auto last = static_cast<std::streamoff>(fs::file_size(shard) - 1);
  std::string key;  // the tensor whose data ends the file
  {
    const weights::SafetensorsFile f(shard.string());
    for (const weights::TensorInfo& t : f.tensors()) {
      if (f.data_start() + t.end == last + 1) key = t.name;
    }
  }
  ASSERT_NE(key.find(':'), std::string::npos) << "optimizer state: " << key;
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(last);
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 1);
    f.seekp(last);
    f.write(&byte, 1);
  }
  std::string error = resume_error(broken.string());
  EXPECT_NE(error.find("load_checkpoint: " + shard.string() + ": tensor '" + key +
                       "' is damaged or was replaced: its SHA-256 is "),
            std::string::npos)
      << error;
  fs::remove(shard);
  error = resume_error(broken.string());
  EXPECT_NE(error.find("load_checkpoint: " + shard.string() +
                       " is missing; the manifest puts tensors there"),
            std::string::npos)
      << error;
}

// Note [Mixed precision]: a bf16 run stopped after step 2 and resumed trains bitwise as the
// uninterrupted one (the state is float32; the autocast regions open per forward).
TEST(GptBf16, StopAndResumeBitwise) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "zb-v", "selective");
  c.training.precision = pp::Precision::kBFloat16;
  c.training.steps = 4;
  const TrainResult whole = train_in_process(c, nullptr);
  ASSERT_EQ(whole.steps.size(), 4u);
  c.checkpoint.dir = (dir.path() / "ck").string();
  c.training.stop_after = 2;
  ASSERT_EQ(train_in_process(c, nullptr).steps.size(), 2u);
  c.training.stop_after = 0;
  c.checkpoint.resume = "latest";
  const TrainResult second = train_in_process(c, nullptr);
  ASSERT_EQ(second.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(second.steps[k].loss, whole.steps[k + 2].loss) << "step " << k + 2;
  }
  std::map<std::string, at::Tensor> want(whole.params.begin(), whole.params.end());
  ASSERT_EQ(second.params.size(), want.size());
  for (const auto& [name, value] : second.params) {
    EXPECT_EQ(value.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(at::equal(value, want[name])) << "parameter " << name;
  }
}

TEST(Gpt, DropoutIsOnAndTheLossFalls) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "1f1b", "selective");
  const TrainResult with_dropout = train_in_process(c, nullptr);
  c.model.dropout = 0;
  const TrainResult without = train_in_process(c, nullptr);
  EXPECT_NE(with_dropout.steps[0].loss, without.steps[0].loss);
  // The first loss is about ln 256 = 5.545 (a near-uniform prediction), then it falls.
  EXPECT_NEAR(without.steps[0].loss, std::log(256.0), 0.1);
  EXPECT_LT(without.steps[2].loss, without.steps[0].loss);
}

TEST(Gpt, SelectiveRematSavesTheProjectionsAndReplaysTheRest) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "1f1b", "selective");
  c.training.steps = 1;
  c.remat.stages.assign(2, models::StageRemat::named(models::RematPolicyKind::kSelective));
  const TrainResult r = train_in_process(c, nullptr);
  const remat::RematCounters& k = r.last.remat;
  // Selective on both stages by name: 4 blocks x 4 micro-batches are checkpoint units, each
  // replayed once; each replay skips the two SAVE regions (qkv, mlp.up): 32 calls in the
  // forward, 32 skipped in replays.
  EXPECT_EQ(k.unit_calls, 16);
  EXPECT_EQ(k.replays, 16);
  EXPECT_EQ(k.save_calls, 32);
  EXPECT_EQ(k.save_skips, 32);
}

std::vector<models::StageRemat> named(const std::vector<models::RematPolicyKind>& kinds) {
  std::vector<models::StageRemat> stages;
  for (models::RematPolicyKind kind : kinds) stages.push_back(models::StageRemat::named(kind));
  return stages;
}

// Note [Replays that cannot lower a peak]: remat.policy selective on 1F1B with pre-triggered
// recompute runs the last stage without a checkpoint, says so, and trains exactly as
// remat.stages [selective, none] does (the bytes a checkpoint holds from its replay to the
// backward: Profile.CandidatesComeFromTheModuleTree). Lazy recompute, which replays unit by unit,
// keeps every stage's.
TEST(Gpt, TheLastStageOf1F1BRunsWithoutAReplayThatCannotLowerItsPeak) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "1f1b", "selective");
  c.training.steps = 2;
  c.output.progress = true;
  std::ostringstream talk;
  const TrainResult dropped = train_in_process(c, &talk);
  EXPECT_NE(talk.str().find(
                "\nremat: selective on every stage but 1, which runs without a checkpoint: each "
                "of its forwards is followed by its own pre-triggered replay, so a replay would "
                "lower no peak (remat.stages gives every stage its policy by hand)\n"),
            std::string::npos)
      << talk.str();
  c.output.progress = false;
  TrainConfig by_hand = c;
  by_hand.remat.stages =
      named({models::RematPolicyKind::kSelective, models::RematPolicyKind::kNone});
  const TrainResult first_only = train_in_process(by_hand, nullptr);
  TrainConfig both = c;
  both.remat.stages =
      named({models::RematPolicyKind::kSelective, models::RematPolicyKind::kSelective});
  const TrainResult checkpointed = train_in_process(both, nullptr);
  ASSERT_EQ(dropped.steps.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(dropped.steps[s].loss, first_only.steps[s].loss) << s;
    EXPECT_EQ(dropped.steps[s].loss, checkpointed.steps[s].loss) << s;
  }
  EXPECT_EQ(dropped.last.remat.unit_calls, first_only.last.remat.unit_calls);
  EXPECT_EQ(dropped.last.remat.replays, first_only.last.remat.replays);
  EXPECT_EQ(checkpointed.last.remat.replays, 16);  // 4 blocks x 4 micro-batches
  EXPECT_LT(dropped.last.remat.replays, 16);

  TrainConfig lazy = c;
  lazy.schedule.recompute = schedule::RecomputeMode::kLazy;
  EXPECT_EQ(train_in_process(lazy, nullptr).last.remat.replays, 16);
}

// remat.stages: a policy per model stage. Selective on the first stage and none on the last:
// only the first stage's blocks are units and replay, and the run still equals the reference.
TEST(Gpt, PerStagePoliciesReplayOnlyWhereAsked) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "1f1b", "selective");
  c.remat.stages = named({models::RematPolicyKind::kSelective, models::RematPolicyKind::kNone});
  const TrainResult pipe = train_in_process(c, nullptr);
  const TrainResult ref = train_reference(c, nullptr);
  ASSERT_EQ(pipe.steps.size(), 3u);
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(pipe.steps[s].loss, ref.steps[s].loss) << s;
  std::map<std::string, at::Tensor> want(ref.params.begin(), ref.params.end());
  for (const auto& [name, value] : pipe.params) EXPECT_TRUE(at::equal(value, want[name])) << name;

  const std::vector<int64_t> bounds = models::partition_gpt(
      models::build_gpt(models::gpt_shape(c.model), c.training.seed), c.partition, 2);
  const int64_t first_blocks = bounds[1] - bounds[0];
  ASSERT_GE(first_blocks, 1);
  ASSERT_LT(first_blocks, 4);
  const remat::RematCounters& k = pipe.last.remat;  // the last step, summed over the ranks
  EXPECT_EQ(k.unit_calls, first_blocks * 4);        // 4 micro-batches
  EXPECT_EQ(k.replays, first_blocks * 4);
  EXPECT_EQ(k.save_calls, first_blocks * 4 * 2);  // qkv and mlp.up
  EXPECT_EQ(k.save_skips, first_blocks * 4 * 2);

  // A stage's own lists: only its first block is a unit, with mlp.up saved.
  c.remat.stages = {models::StageRemat::of({"blocks.0"}, {{"blocks.0.mlp.up", true}}),
                    models::StageRemat::named(models::RematPolicyKind::kNone)};
  const TrainResult own = train_in_process(c, nullptr);
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(own.steps[s].loss, ref.steps[s].loss) << s;
  const remat::RematCounters& o = own.last.remat;
  EXPECT_EQ(o.unit_calls, 4);
  EXPECT_EQ(o.replays, 4);
  EXPECT_EQ(o.save_calls, 4);
  EXPECT_EQ(o.save_skips, 4);

  // zb-v has 4 model stages on 2 ranks: one name per stage.
  c.schedule.kind = schedule::ScheduleKind::kZeroBubbleV;
  c.remat.stages = named({models::RematPolicyKind::kFull, models::RematPolicyKind::kNone,
                          models::RematPolicyKind::kSelective, models::RematPolicyKind::kNone});
  const TrainResult v = train_in_process(c, nullptr);
  const TrainResult v_ref = train_reference(c, nullptr);
  for (size_t s = 0; s < 3; ++s) EXPECT_EQ(v.steps[s].loss, v_ref.steps[s].loss) << s;
  c.remat.stages = named({models::RematPolicyKind::kFull, models::RematPolicyKind::kNone});
  try {
    train_in_process(c, nullptr);
    ADD_FAILURE() << "two names for four stages were taken";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "remat.stages: 2 entries for 4 model stages (schedule.ranks x chunks per rank); "
              "give one policy per stage, e.g. [selective, selective, selective, selective]");
  }
}

// ---- loss curve, checkpoints and samples -------------------------------------------------

TEST(LossCurve, SvgHasOnePointPerStepAndEvaluation) {
  const std::string svg =
      render_loss_svg({{1, 5.5}, {2, 4.0}, {3, 3.0}}, {{2, 4.2}, {3, 3.3}}, "a <title>");
  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("a &lt;title&gt;"), std::string::npos);
  const std::regex polyline("<polyline[^>]*points=\"([^\"]*)\"");
  std::vector<size_t> points;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), polyline);
       it != std::sregex_iterator(); ++it) {
    const std::string p = (*it)[1];
    points.push_back(static_cast<size_t>(std::count(p.begin(), p.end(), ',')));
  }
  EXPECT_EQ(points, (std::vector<size_t>{3, 2}));
  EXPECT_NE(svg.find(">validation</text>"), std::string::npos);
}

TEST(Generate, SamplesTheRequestedBytesFromATrainedCheckpoint) {
  TempDir dir;
  write(dir.path() / "text.txt", words(16 * kSplitBlock));
  TrainConfig c = gpt_config((dir.path() / "text.txt").string(), "zb-v", "selective");
  c.checkpoint.dir = (dir.path() / "ck").string();
  c.sample.tokens = 37;
  c.sample.prompt = "the cat";
  const TrainResult r = train_in_process(c, nullptr);
  EXPECT_EQ(r.sample.size(), 37u);  // sampled by the training run from its final checkpoint
  const std::string ck = (dir.path() / "ck" / "step-000003").string();
  SampleOptions o;
  o.tokens = 37;
  o.prompt = "the cat";
  const GenerateResult g = generate_text(ck, o);
  EXPECT_EQ(g.text, r.sample);  // the same checkpoint, prompt and seed: the same bytes
  EXPECT_EQ(g.step, 3);
  o.tokens = 300;  // longer than seq_len: the context slides
  o.seed = 5;
  o.top_k = 0;
  EXPECT_EQ(generate_text(ck, o).text.size(), 300u);
  o.top_k = 1;  // greedy: deterministic whatever the seed
  const std::string greedy = generate_text(ck, o).text;
  o.seed = 6;
  EXPECT_EQ(generate_text(ck, o).text, greedy);
}

TEST(Generate, ACheckpointOfAnotherModelIsAClearError) {
  TempDir dir;
  TrainConfig zoo;
  zoo.model.layers = 2;
  zoo.model.hidden = 8;
  zoo.model.tokens = 4;
  zoo.schedule.ranks = 2;
  zoo.schedule.micro_batches = 2;
  zoo.training.steps = 1;
  zoo.checkpoint.dir = (dir.path() / "ck").string();
  zoo.output.progress = false;
  train_in_process(zoo, nullptr);
  const std::string ck = (dir.path() / "ck" / "step-000001").string();
  EXPECT_EQ(error_of([&] { generate_text(ck, SampleOptions{}); }),
            "generate: " + ck +
                " is a checkpoint of model.kind rmsnorm-gemm; pipemat generate "
                "samples text from gpt and llama checkpoints only");
  const std::string none = (dir.path() / "ck").string();
  EXPECT_EQ(error_of([&] { generate_text(none, SampleOptions{}); }),
            "load_checkpoint: " + none +
                " is not a complete checkpoint (no manifest.json; a save "
                "that was interrupted leaves none): give a step-NNNNNN directory that has one "
                "(--resume latest and pp::latest_checkpoint() pick the newest)");
}

TEST(LrSchedule, WarmupThenCosineToMinLr) {
  TrainingOptions t;
  t.steps = 11;
  t.lr = 1.0;
  t.warmup = 2;
  t.lr_decay = LrDecay::kCosine;
  t.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(lr_at(t, 0), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(t, 1), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(t, 2), 1.0);  // the cosine starts at lr
  EXPECT_DOUBLE_EQ(lr_at(t, 6), 0.1 + 0.45 * (1 + std::cos(M_PI * 4 / 8)));
  EXPECT_DOUBLE_EQ(lr_at(t, 10), 0.1);  // the last step: min_lr
  t.lr_decay = LrDecay::kNone;
  EXPECT_DOUBLE_EQ(lr_at(t, 10), 1.0);
}

}  // namespace
}  // namespace pipemat::train
