// Checkpoints in global coordinates (Note [Checkpoint layout] in pipemat/pp/checkpoint.h): a run
// stopped on one layout and resumed on another trains bitwise as the uninterrupted run; a tied
// weight is stored once; the load reads only what a rank holds; a changed model, micro-batch
// count or damaged file is refused, naming what differs, and nothing is written.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/train/config.h"
#include "pipemat/train/train.h"
#include "text_config.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

class ReshardDir {
 public:
  ReshardDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "pipemat_reshard_" + std::string(info->test_suite_name()) + "_" +
                       info->name() + "_" + std::to_string(::getpid());
    std::replace(name.begin(), name.end(), '/', '_');
    path_ = fs::temp_directory_path() / name;
    fs::remove_all(path_);
    fs::create_directories(path_);
    std::ofstream text(path_ / "text.txt");
    // Deterministic text: the words of a small list picked by an LCG.
    const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to"};
    uint32_t x = 7;
    for (int i = 0; i < 6000; ++i) {
      x = x * 1664525u + 1013904223u;
      text << words[(x >> 16) % 10] << ((x >> 8) % 7 == 0 ? ".\n" : " ");
    }
  }
  ~ReshardDir() { fs::remove_all(path_); }
  std::string text() const { return (path_ / "text.txt").string(); }
  std::string sub(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// A layout of the same model and global batch.
struct ResumeLayout {
  ResumeLayout(const char* k, int r, int v = 1, std::vector<int64_t> layers = {}, int d = 1,
               bool s = false, int m = 4)
      : kind(k),
        ranks(r),
        virtual_stages(v),
        layers_per_stage(std::move(layers)),
        data(d),
        shard(s),
        micro_batches(m) {}
  const char* kind;
  int ranks;
  int virtual_stages;
  std::vector<int64_t> layers_per_stage;
  int data;
  bool shard;
  int micro_batches;
};

TrainConfig on_layout(TrainConfig c, const ResumeLayout& l) {
  c.schedule.kind = schedule::parse_schedule_kind(l.kind);
  c.schedule.ranks = l.ranks;
  c.schedule.virtual_stages = l.virtual_stages;
  c.partition.layers_per_stage = l.layers_per_stage;
  c.parallel.data = l.data;
  c.parallel.shard_optimizer = l.shard;
  c.schedule.micro_batches = l.micro_batches;
  return c;
}

// A tiny llama (4 blocks, or 8 for layouts of 8 stages), 4 steps with clipping that clips.
TrainConfig reshard_config(const ReshardDir& dir, int layers = 4, bool tied = false) {
  TrainConfig c = testing::llama_config(dir.text(), "1f1b", "selective");
  c.model.layers = layers;
  c.model.tie_embeddings = tied;
  c.training.steps = 4;
  c.training.clip_grad_norm = 0.05;
  c.training.eval_every = 0;
  return c;
}

std::map<std::string, at::Tensor> params_by_name(const TrainResult& r) {
  return std::map<std::string, at::Tensor>(r.params.begin(), r.params.end());
}

// Steps 3 and 4 and the final parameters of `resumed` against `whole`'s, bitwise.
void expect_same_second_half(const TrainResult& whole, const TrainResult& resumed,
                             const std::string& what) {
  ASSERT_EQ(whole.steps.size(), 4u) << what;
  ASSERT_EQ(resumed.steps.size(), 2u) << what;
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(resumed.steps[k].step, whole.steps[k + 2].step) << what;
    EXPECT_EQ(resumed.steps[k].loss, whole.steps[k + 2].loss) << what << ": step " << k + 2;
    EXPECT_EQ(resumed.steps[k].grad_norm, whole.steps[k + 2].grad_norm) << what;
  }
  const auto want = params_by_name(whole);
  const auto got = params_by_name(resumed);
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, value] : got) {
    ASSERT_TRUE(want.count(name)) << what << ": " << name;
    EXPECT_TRUE(at::equal(value, want.at(name))) << what << ": parameter " << name;
  }
}

// Two steps on `from` (a checkpoint after step 2 under `out`/first), then the rest on `to`.
TrainResult stop_and_resume(const TrainConfig& c, const ResumeLayout& from, const ResumeLayout& to,
                            const std::string& out, std::string* checkpoint = nullptr) {
  TrainConfig first = on_layout(c, from);
  first.checkpoint.dir = out + "/first";
  first.training.stop_after = 2;
  const TrainResult a = train_in_process(first, nullptr);
  EXPECT_EQ(a.final_checkpoint, first.checkpoint.dir + "/step-000002");
  if (checkpoint != nullptr) *checkpoint = a.final_checkpoint;
  TrainConfig second = on_layout(c, to);
  second.checkpoint.dir = out + "/second";
  second.checkpoint.resume = a.final_checkpoint;
  std::ostringstream talk;
  second.output.progress = true;
  TrainResult b = train_in_process(second, &talk);
  EXPECT_NE(talk.str().find("resumed from " + a.final_checkpoint + " after step 2"),
            std::string::npos)
      << talk.str();
  return b;
}

TEST(Reshard, ALlamaResumesOnAnotherLayoutBitwise) {
  ReshardDir dir;
  const TrainConfig c = reshard_config(dir);
  const TrainResult whole = train_in_process(on_layout(c, {"1f1b", 2}), nullptr);
  expect_same_second_half(whole, stop_and_resume(c, {"1f1b", 2}, {"1f1b", 4}, dir.sub("a")),
                          "2 ranks 1f1b -> 4 ranks 1f1b");
  expect_same_second_half(whole, stop_and_resume(c, {"1f1b", 4}, {"zb-v", 2}, dir.sub("b")),
                          "4 ranks 1f1b -> 2 ranks zb-v");
  expect_same_second_half(
      whole, stop_and_resume(c, {"1f1b", 2, 1, {1, 3}}, {"zb-h1", 2, 1, {3, 1}}, dir.sub("c")),
      "[1,3] 1f1b -> [3,1] zb-h1");
  expect_same_second_half(whole,
                          stop_and_resume(c, {"interleaved", 2, 2}, {"gpipe", 1}, dir.sub("d")),
                          "interleaved 2x2 -> 1 rank");
}

TEST(Reshard, EightVirtualStagesResumeOnTwoRanksBitwise) {
  ReshardDir dir;
  const TrainConfig c = reshard_config(dir, /*layers=*/8);
  const TrainResult whole = train_in_process(on_layout(c, {"zb-v", 4}), nullptr);
  expect_same_second_half(whole, stop_and_resume(c, {"zb-v", 4}, {"1f1b", 2}, dir.sub("a")),
                          "4 ranks zb-v (8 stages) -> 2 ranks 1f1b");
}

// The tied weight is stored once, by the first stage, and the checkpoint resumes where one rank
// holds both copies (zb-v) and where one stage holds the weight (one rank).
TEST(Reshard, ATiedWeightIsStoredOnceAndResumesOnAnyLayout) {
  ReshardDir dir;
  const TrainConfig c = reshard_config(dir, 4, /*tied=*/true);
  const TrainResult whole = train_in_process(on_layout(c, {"1f1b", 2}), nullptr);
  std::string checkpoint;
  expect_same_second_half(whole,
                          stop_and_resume(c, {"1f1b", 2}, {"zb-v", 2}, dir.sub("a"), &checkpoint),
                          "tied: 2 ranks 1f1b -> 2 ranks zb-v");
  expect_same_second_half(whole, stop_and_resume(c, {"1f1b", 2}, {"1f1b", 4}, dir.sub("b")),
                          "tied: 2 ranks -> 4 ranks");
  // One stage holds both uses of the weight, whose gradient then adds each micro-batch's two
  // uses first (Note [Random streams of a step], layout invariance): the same run to rounding.
  const TrainResult one = stop_and_resume(c, {"1f1b", 2}, {"1f1b", 1}, dir.sub("one"));
  ASSERT_EQ(one.steps.size(), 2u);
  EXPECT_NEAR(one.steps[0].loss, whole.steps[2].loss, 1e-5 * whole.steps[2].loss);
  EXPECT_NEAR(one.steps[1].loss, whole.steps[3].loss, 1e-5 * whole.steps[3].loss);
  const pp::CheckpointManifest m = pp::read_checkpoint_manifest(checkpoint);
  ASSERT_EQ(m.ties.size(), 1u);
  EXPECT_EQ(m.ties.begin()->second, "model.embed_tokens.weight");
  const pp::CheckpointTensor* embed = m.find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->stage, 0);
  ASSERT_EQ(embed->pieces.size(), 1u);
  EXPECT_EQ(embed->pieces[0].file, "rank-0.safetensors");
  EXPECT_EQ(m.find("lm_head.weight"), nullptr);
  // Its optimizer state once too, and nothing of it in the last rank's file.
  EXPECT_NE(m.find("model.embed_tokens.weight:exp_avg"), nullptr);
  for (const pp::CheckpointTensor& t : m.tensors) {
    if (t.name.rfind("model.embed_tokens.weight", 0) == 0) {
      for (const auto& piece : t.pieces) EXPECT_EQ(piece.file, "rank-0.safetensors") << t.name;
    }
  }
  // An untied model of the same shape does not load it: its head has no stored tensor.
  TrainConfig untied = on_layout(reshard_config(dir, 4, false), {"1f1b", 2});
  untied.checkpoint.resume = checkpoint;
  untied.checkpoint.dir = dir.sub("untied");
  try {
    train_in_process(untied, nullptr);
    ADD_FAILURE() << "an untied model resumed a tied checkpoint";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find("holds no tensor 'lm_head.weight' (stage 1's parameter "
                                         "'lm_head.weight')"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(
                  "model.tie_embeddings is true in the checkpoint's run but false here"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(pp::list_checkpoints(dir.sub("untied")).empty());
}

// Another data degree sums the replicas' gradients in another order, so the resumed run is
// compared with the same layout resumed from the same state written unsharded: 2 x 2 sharded ->
// 1 x 4 unsharded (8 micro-batches: the same global batch), and back.
TEST(Reshard, ADataDegreeChangeResumesAsTheNewLayoutsOwnRun) {
  ReshardDir dir;
  const TrainConfig c = reshard_config(dir);
  const ResumeLayout sharded{"1f1b", 2, 1, {}, 2, true, 4}, plain{"1f1b", 2, 1, {}, 2, false, 4};
  const ResumeLayout wide{"1f1b", 4, 1, {}, 1, false, 8};
  std::string from_sharded, from_plain;
  const TrainResult a = stop_and_resume(c, sharded, wide, dir.sub("a"), &from_sharded);
  const TrainResult b = stop_and_resume(c, plain, wide, dir.sub("b"), &from_plain);
  ASSERT_EQ(a.steps.size(), 2u);
  ASSERT_EQ(b.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) EXPECT_EQ(a.steps[k].loss, b.steps[k].loss) << k;
  const auto pa = params_by_name(a), pb = params_by_name(b);
  for (const auto& [name, value] : pa) EXPECT_TRUE(at::equal(value, pb.at(name))) << name;
  // Back: 1 x 4 -> 2 x 2 sharded equals 1 x 4 -> 2 x 2 unsharded (Note [Sharded optimizer]).
  TrainConfig back = on_layout(c, sharded);
  back.checkpoint.resume = from_sharded;
  back.checkpoint.dir = dir.sub("back");
  TrainConfig back_plain = on_layout(c, plain);
  back_plain.checkpoint.resume = from_sharded;
  back_plain.checkpoint.dir = dir.sub("back-plain");
  const TrainResult s = train_in_process(back, nullptr), p = train_in_process(back_plain, nullptr);
  ASSERT_EQ(s.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) EXPECT_EQ(s.steps[k].loss, p.steps[k].loss) << k;
}

// What a resume keeps is checked before anything trains; the error names what differs, and
// nothing is written.
TEST(Reshard, AChangedModelBatchOrDamagedFileIsRefusedNamingIt) {
  ReshardDir dir;
  const TrainConfig c = reshard_config(dir);
  TrainConfig first = on_layout(c, {"1f1b", 2});
  first.checkpoint.dir = dir.sub("first");
  first.training.stop_after = 2;
  const std::string from = train_in_process(first, nullptr).final_checkpoint;
  const auto refusal = [&](TrainConfig r, const std::string& out) {
    r.checkpoint.resume = from;
    r.checkpoint.dir = dir.sub(out);
    std::string error = "no error";
    try {
      train_in_process(r, nullptr);
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_TRUE(pp::list_checkpoints(dir.sub(out)).empty()) << out << " was written to";
    return error;
  };
  TrainConfig hidden = on_layout(c, {"1f1b", 4});
  hidden.model.hidden = 32;
  hidden.model.ffn = 48;
  std::string e = refusal(hidden, "hidden");
  EXPECT_NE(e.find("load_checkpoint: " + from +
                   ": tensor 'model.embed_tokens.weight' is F32 [256, 16] in the checkpoint but "
                   "F32 [256, 32] in this model (stage 0's parameter 'embed_tokens.weight')"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("model.hidden is 16 in the checkpoint's run but 32 here"), std::string::npos)
      << e;
  TrainConfig fewer = on_layout(c, {"1f1b", 2});
  fewer.model.layers = 3;
  e = refusal(fewer, "fewer");
  EXPECT_NE(e.find("holds tensor 'model.layers.3.input_layernorm.weight' (F32 [16]), which no "
                   "stage of this pipeline holds"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("model.layers is 4 in the checkpoint's run but 3 here"), std::string::npos) << e;
  TrainConfig more = on_layout(c, {"1f1b", 2});
  more.model.layers = 5;
  e = refusal(more, "more");
  EXPECT_NE(e.find("holds no tensor 'model.layers.4."), std::string::npos) << e;
  e = refusal(on_layout(c, {"1f1b", 2, 1, {}, 1, false, 2}), "batch");
  EXPECT_NE(e.find("was written with 4 micro-batches x 1 data replicas = 4 micro-batches per "
                   "step, this pipeline has 2 x 1 = 2; a resume keeps the global batch"),
            std::string::npos)
      << e;
  TrainConfig seed = on_layout(c, {"1f1b", 2});
  seed.training.seed = 5;
  e = refusal(seed, "seed");
  EXPECT_NE(e.find("checkpoint.resume: " + from +
                   " was written by a run with training.seed 0 but this run has 5; a resume keeps "
                   "training.seed"),
            std::string::npos)
      << e;
  TrainConfig batch = on_layout(c, {"1f1b", 2});
  batch.model.batch = 4;
  e = refusal(batch, "batch-size");
  EXPECT_NE(e.find("was written by a run with model.batch 2 but this run has 4"), std::string::npos)
      << e;
  // A flipped byte in a tensor of the last rank's file: a 4-rank resume (whose ranks 2 and 3
  // read that file) names the file and the tensor.
  const fs::path file = fs::path(from) / "rank-1.safetensors";
  const pp::CheckpointManifest m = pp::read_checkpoint_manifest(from);
  const pp::CheckpointTensor* norm = m.find("model.norm.weight");
  ASSERT_NE(norm, nullptr);
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The header's length, then the header: the tensor's offsets are in it.
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  const auto h = nlohmann::json::parse(bytes.substr(8, header));
  const int64_t at = 8 + static_cast<int64_t>(header) +
                     h.at("model.norm.weight").at("data_offsets")[0].get<int64_t>();
  bytes[static_cast<size_t>(at)] ^= 0x01;
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  e = refusal(on_layout(c, {"1f1b", 4}), "damaged");
  EXPECT_NE(e.find(file.string() + ": tensor 'model.norm.weight' is damaged or was replaced: its "
                                   "SHA-256 is "),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace pipemat::train
