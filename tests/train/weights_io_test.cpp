// Weights in and out as safetensors files: `pipemat export` of a 2-rank checkpoint holds its
// parameters bitwise, training.init_from starts from them bitwise, export -> init_from -> export
// is byte-identical, a file that does not fit the model is one error listing every tensor, and
// generate samples the same bytes from the file as from the checkpoint.

#include <gtest/gtest.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/models/llama.h"
#include "pipemat/train/generate.h"
#include "pipemat/train/train.h"
#include "pipemat/train/weights.h"
#include "pipemat/weights/safetensors.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

class WeightFiles : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() /
           ("pipemat_weight_files_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // Text for the gpt: words of a small list, deterministic.
    std::ofstream text(dir_ / "text.txt", std::ios::binary);
    uint32_t x = 3;
    const char* list[] = {"the", "cat", "sat", "on", "a", "mat", "and", "ran", "to", "see"};
    for (size_t bytes = 0; bytes < 40000;) {
      x = x * 1664525u + 1013904223u;
      const std::string word = std::string(list[(x >> 16) % 10]) + ((x >> 8) % 7 ? " " : ".\n");
      text << word;
      bytes += word.size();
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A 2-rank run of model `kind` (gpt, or a zoo kind), 2 steps, saving into `ck`.
  TrainConfig config(const std::string& kind, const std::string& ck) const {
    TrainConfig c;
    c.model.kind = models::parse_model_kind(kind).value();
    c.model.layers = 4;
    c.model.hidden = 16;
    c.model.heads = 2;
    c.model.ffn = 32;
    c.model.tokens = 8;
    c.model.seq_len = 16;
    c.model.batch = 2;
    if (kind == "gpt" || kind == "llama") c.data.path = (dir_ / "text.txt").string();
    c.data.validation = 0.25;
    c.schedule.kind = schedule::ScheduleKind::kOneFOneB;
    c.schedule.ranks = 2;
    c.schedule.micro_batches = 2;
    c.training.steps = 2;
    c.training.optimizer = OptimizerKind::kAdamW;
    c.training.lr = 0.01;
    c.checkpoint.dir = ck;
    c.output.progress = false;
    return c;
  }

  // A step that changes no parameter: SGD with a learning rate below float32's smallest.
  static void no_change(TrainConfig& c) {
    c.training.steps = 1;
    c.training.optimizer = OptimizerKind::kSgd;
    c.training.lr = 1e-300;
    c.training.weight_decay = 0;
    c.training.clip_grad_norm = 0;
  }

  static std::string bytes_of(const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }

  static std::string slurp(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  static void expect_params_equal(const TrainResult& a, const TrainResult& b) {
    std::map<std::string, at::Tensor> theirs(b.params.begin(), b.params.end());
    ASSERT_EQ(a.params.size(), theirs.size());
    for (const auto& [name, t] : a.params) {
      ASSERT_TRUE(theirs.count(name)) << name;
      EXPECT_TRUE(at::equal(t, theirs[name])) << name;
    }
  }

  fs::path dir_;
};

TEST_P(WeightFiles, ExportHoldsTheCheckpointAndInitFromStartsFromItBitwise) {
  const TrainConfig c = config(GetParam(), (dir_ / "ck").string());
  const TrainResult trained = train_in_process(c, nullptr);
  const std::string ck = (dir_ / "ck" / "step-000002").string();
  const std::string file = (dir_ / "model.safetensors").string();
  const ExportSummary summary = export_weights(ck, file);
  EXPECT_EQ(summary.tensors, static_cast<int64_t>(trained.params.size()));
  EXPECT_EQ(summary.step, 2);
  EXPECT_EQ(summary.ranks, 2);
  EXPECT_EQ(summary.kind, GetParam());
  EXPECT_EQ(summary.bytes, static_cast<int64_t>(fs::file_size(file)));

  // Every parameter under its single-process name, float32, its bytes.
  const weights::SafetensorsFile read(file);
  ASSERT_EQ(read.tensors().size(), trained.params.size());
  const WeightNameMap map = weight_name_map(c.model.kind);  // the llama's: Hugging Face's
  for (const auto& [name, t] : trained.params) {
    const weights::TensorInfo* info = read.find(map(name));
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->dtype, weights::Dtype::kF32) << name;
    EXPECT_EQ(info->shape, t.sizes().vec()) << name;
    EXPECT_EQ(read.read(map(name)), bytes_of(t)) << name;
  }
  if (GetParam() == "llama") {
    EXPECT_NE(read.find("model.layers.3.self_attn.q_proj.weight"), nullptr);
    EXPECT_NE(read.find("model.embed_tokens.weight"), nullptr);
    EXPECT_NE(read.find("lm_head.weight"), nullptr);
    // The Hugging Face LlamaConfig next to it.
    EXPECT_EQ(summary.config_json, (dir_ / "config.json").string());
    const std::string json = slurp(dir_ / "config.json");
    for (const char* field :
         {"\"architectures\": [\n    \"LlamaForCausalLM\"\n  ]", "\"hidden_size\": 16",
          "\"intermediate_size\": 32", "\"num_hidden_layers\": 4", "\"num_attention_heads\": 2",
          "\"max_position_embeddings\": 16", "\"tie_word_embeddings\": false",
          "\"vocab_size\": 256", "\"torch_dtype\": \"float32\""}) {
      EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
    }
  } else {
    EXPECT_TRUE(summary.config_json.empty());
  }
  EXPECT_EQ(read.metadata().at(kKindKey), GetParam());
  EXPECT_EQ(read.metadata().at("format"), "pt");

  // init_from: the pipeline and the reference start from exactly these parameters.
  TrainConfig from = config(GetParam(), (dir_ / "ck2").string());
  no_change(from);
  from.training.init_from = file;
  const TrainResult started = train_in_process(from, nullptr);
  expect_params_equal(started, trained);
  TrainConfig reference = from;
  reference.checkpoint.dir.clear();
  expect_params_equal(train_reference(reference, nullptr), trained);

  // export -> init_from -> export: the same bytes.
  // A llama's second export writes config.json again, beside the first (Note [Export never
  // destroys]: only when told to).
  export_weights((dir_ / "ck2" / "step-000001").string(), (dir_ / "again.safetensors").string(),
                 /*overwrite=*/true);
  EXPECT_EQ(slurp(dir_ / "again.safetensors"), slurp(file));
  // And from a directory with an index, split in two files.
  fs::create_directories(dir_ / "sharded");
  std::vector<std::string> keep;
  std::vector<weights::TensorBytes> first, second;
  std::string index = R"({"weight_map":{)";
  keep.reserve(read.tensors().size());
  for (size_t i = 0; i < read.tensors().size(); ++i) {
    const weights::TensorInfo& t = read.tensors()[i];
    keep.push_back(read.read(t.name));
    const bool one = i % 2 == 0;
    (one ? first : second).push_back({t.name, t.dtype, t.shape, keep.back()});
    index += (i ? "," : "") + ("\"" + t.name + "\":\"") + (one ? "a" : "b") + ".safetensors\"";
  }
  index += "}}";
  weights::write_safetensors_file((dir_ / "sharded" / "a.safetensors").string(), first,
                                  read.metadata());
  weights::write_safetensors_file((dir_ / "sharded" / "b.safetensors").string(), second);
  std::ofstream(dir_ / "sharded" / weights::kIndexFile) << index;
  from.training.init_from = (dir_ / "sharded").string();
  from.checkpoint.dir = (dir_ / "ck3").string();
  expect_params_equal(train_in_process(from, nullptr), trained);
}

TEST_P(WeightFiles, OtherDtypesAreConvertedAndResumeWins) {
  const TrainConfig c = config(GetParam(), (dir_ / "ck").string());
  const TrainResult trained = train_in_process(c, nullptr);
  const std::string file = (dir_ / "model.safetensors").string();
  export_weights((dir_ / "ck" / "step-000002").string(), file);
  // The same values as float64: init_from converts them to the parameters' float32, exactly.
  const weights::SafetensorsFile read(file);
  std::vector<at::Tensor> keep;
  std::vector<weights::TensorBytes> wide;
  std::vector<weights::TensorBytes> narrow;  // bfloat16: the parameters get its values
  TrainResult rounded;
  keep.reserve(2 * read.tensors().size());
  for (const weights::TensorInfo& t : read.tensors()) {
    at::Tensor f = at::empty(t.shape, at::kFloat);
    read.read(t.name, f.data_ptr());
    keep.push_back(f.to(at::kDouble).contiguous());
    wide.push_back(
        {t.name, weights::Dtype::kF64, t.shape,
         std::string_view(static_cast<const char*>(keep.back().data_ptr()), keep.back().nbytes())});
    keep.push_back(f.to(at::kBFloat16).contiguous());
    narrow.push_back(
        {t.name, weights::Dtype::kBF16, t.shape,
         std::string_view(static_cast<const char*>(keep.back().data_ptr()), keep.back().nbytes())});
    // TrainResult names the parameters as the model does (the llama's file: Hugging Face's).
    rounded.params.emplace_back(GetParam() == "llama" ? models::llama_own_name(t.name) : t.name,
                                keep.back().to(at::kFloat));
  }
  const std::string f64 = (dir_ / "f64.safetensors").string();
  weights::write_safetensors_file(f64, wide, read.metadata());
  TrainConfig from = config(GetParam(), (dir_ / "ck2").string());
  no_change(from);
  from.training.init_from = f64;
  expect_params_equal(train_in_process(from, nullptr), trained);
  const std::string bf16 = (dir_ / "bf16.safetensors").string();
  weights::write_safetensors_file(bf16, narrow);
  from.training.init_from = bf16;
  from.checkpoint.dir = (dir_ / "ck3").string();
  expect_params_equal(train_in_process(from, nullptr), rounded);

  // A run that resumes loads its checkpoint, not init_from's file (here: the seed's weights).
  TrainConfig seed = config(GetParam(), (dir_ / "seed").string());
  no_change(seed);
  const TrainResult seeded = train_in_process(seed, nullptr);
  TrainConfig resumed = seed;
  resumed.training.steps = 2;
  resumed.training.init_from = file;
  resumed.checkpoint.resume = (dir_ / "seed" / "step-000001").string();
  const TrainResult after = train_in_process(resumed, nullptr);
  std::map<std::string, at::Tensor> seeded_params(seeded.params.begin(), seeded.params.end());
  for (const auto& [name, t] : after.params) {
    EXPECT_TRUE(at::equal(t, seeded_params.at(name))) << name;  // lr 1e-300: nothing moved
  }
}

TEST_P(WeightFiles, AFileThatDoesNotFitTheModelIsOneErrorListingEveryTensor) {
  const TrainConfig c = config(GetParam(), (dir_ / "ck").string());
  train_in_process(c, nullptr);
  const std::string file = (dir_ / "model.safetensors").string();
  export_weights((dir_ / "ck" / "step-000002").string(), file);
  const weights::SafetensorsFile read(file);
  // Drop the first tensor, give the second another shape, add one the model does not have.
  std::vector<std::string> keep;
  std::vector<weights::TensorBytes> tensors;
  keep.reserve(read.tensors().size() + 1);
  const std::string dropped = read.tensors()[0].name;
  const weights::TensorInfo& reshaped = read.tensors()[1];
  for (size_t i = 1; i < read.tensors().size(); ++i) {
    const weights::TensorInfo& t = read.tensors()[i];
    keep.push_back(read.read(t.name));
    std::vector<int64_t> shape = t.shape;
    if (i == 1) shape = {t.numel()};
    tensors.push_back({t.name, t.dtype, shape, keep.back()});
  }
  keep.push_back(std::string(8, '\0'));
  tensors.push_back({"zz.extra", weights::Dtype::kF32, {2}, keep.back()});
  const std::string bad = (dir_ / "bad.safetensors").string();
  weights::write_safetensors_file(bad, tensors);
  TrainConfig from = config(GetParam(), (dir_ / "ck2").string());
  from.training.init_from = bad;
  std::string error;
  try {
    train_in_process(from, nullptr);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto shape_text = [](const std::vector<int64_t>& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  };
  const std::string expected =
      "training.init_from: " + bad + " does not hold the parameters of this model (" +
      std::to_string(read.tensors().size()) + " tensors); 1 missing: " + dropped + " " +
      shape_text(read.tensors()[0].shape) +
      "; 1 not in the model: zz.extra; 1 of another "
      "shape: " +
      reshaped.name + " ([" + std::to_string(reshaped.numel()) + "] in the file, the model's " +
      shape_text(reshaped.shape) +
      "). The file's names must be the model's (pipemat export writes them)";
  EXPECT_NE(error.find(expected), std::string::npos) << error;
}

// model.vocab: a text model of 1000 ids exports embedding and head of 1000 rows (a llama's
// config.json says vocab_size 1000, and model.from reads it back), and init_from of that file
// starts the pipeline and the single process from exactly its parameters.
TEST_P(WeightFiles, AVocabularyOf1000GoesOutAndBackIn) {
  if (GetParam() == "transformer") {
    GTEST_SKIP() << "the zoo's transformer has no vocabulary (model.vocab is gpt's and llama's)";
  }
  TrainConfig c = config(GetParam(), (dir_ / "ck").string());
  c.model.vocab = 1000;
  train_in_process(c, nullptr);
  const std::string file = (dir_ / "v" / "model.safetensors").string();
  export_weights((dir_ / "ck" / "step-000002").string(), file);
  const weights::SafetensorsFile read(file);
  const bool llama = GetParam() == "llama";
  for (const char* name : {llama ? "model.embed_tokens.weight" : "embed.tok.weight",
                           llama ? "lm_head.weight" : "head.out.weight"}) {
    ASSERT_NE(read.find(name), nullptr) << name;
    EXPECT_EQ(read.find(name)->shape, (std::vector<int64_t>{1000, 16})) << name;
  }
  if (llama) {
    EXPECT_NE(slurp(dir_ / "v" / "config.json").find("\"vocab_size\": 1000"), std::string::npos);
    const TrainConfig from_file = parse_config(
        "data: {path: t.txt}\nmodel: {kind: llama, from: \"" + (dir_ / "v").string() + "\"}\n",
        "x.yaml");
    EXPECT_EQ(from_file.model.vocab, 1000);
  }
  TrainConfig from = config(GetParam(), (dir_ / "ck2").string());
  from.model.vocab = 1000;
  no_change(from);
  from.training.init_from = file;
  const TrainResult started = train_in_process(from, nullptr);
  const weights::WeightSource source(file);
  const WeightNameMap map = weight_name_map(from.model.kind);
  for (const auto& [name, t] : started.params)
    EXPECT_EQ(source.read(map(name)), bytes_of(t)) << name;
  TrainConfig reference = from;
  reference.checkpoint.dir.clear();
  expect_params_equal(train_reference(reference, nullptr), started);
}

INSTANTIATE_TEST_SUITE_P(Kinds, WeightFiles, ::testing::Values("gpt", "transformer", "llama"),
                         [](const ::testing::TestParamInfo<std::string>& kind) {
                           return kind.param;
                         });

// A tied llama has no lm_head.weight, but a Hugging Face file may store the head beside the
// embedding: it is read when it holds the embedding's bytes, one error naming it otherwise.
class TiedLlamaWeights : public WeightFiles {};

TEST_F(TiedLlamaWeights, AHeadBesideTheEmbeddingIsReadOnlyWhenItIsTheEmbedding) {
  TrainConfig c = config("llama", (dir_ / "ck").string());
  c.model.tie_embeddings = true;
  c.schedule.ranks = 1;  // a tied llama is one stage
  const TrainResult trained = train_in_process(c, nullptr);
  const std::string file = (dir_ / "model.safetensors").string();
  export_weights((dir_ / "ck" / "step-000002").string(), file);
  const weights::SafetensorsFile read(file);
  ASSERT_EQ(read.find("lm_head.weight"), nullptr);
  const weights::TensorInfo* embed = read.find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  auto with_head = [&](const std::string& name, bool flip) {
    std::vector<std::string> keep;
    std::vector<weights::TensorBytes> tensors;
    keep.reserve(read.tensors().size() + 1);
    for (const weights::TensorInfo& t : read.tensors()) {
      keep.push_back(read.read(t.name));
      tensors.push_back({t.name, t.dtype, t.shape, keep.back()});
    }
    keep.push_back(read.read(embed->name));
    if (flip) keep.back()[5] ^= 1;
    tensors.push_back({"lm_head.weight", embed->dtype, embed->shape, keep.back()});
    const std::string out = (dir_ / name).string();
    weights::write_safetensors_file(out, tensors, read.metadata());
    return out;
  };
  TrainConfig from = config("llama", (dir_ / "ck2").string());
  from.model.tie_embeddings = true;
  from.schedule.ranks = 1;
  no_change(from);
  from.training.init_from = with_head("same.safetensors", false);
  expect_params_equal(train_in_process(from, nullptr), trained);
  // A llama's second export writes config.json again, beside the first (Note [Export never
  // destroys]: only when told to).
  export_weights((dir_ / "ck2" / "step-000001").string(), (dir_ / "again.safetensors").string(),
                 /*overwrite=*/true);
  EXPECT_EQ(slurp(dir_ / "again.safetensors"), slurp(file));

  from.training.init_from = with_head("other.safetensors", true);
  from.checkpoint.dir = (dir_ / "ck3").string();
  std::string error;
  try {
    train_in_process(from, nullptr);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("; 1 not in the model: lm_head.weight."), std::string::npos) << error;
}

// Note [Tied weights]: a tied llama on 2 ranks (the last stage holds a copy of the embedding).
// Export writes the weight once (no lm_head), init_from loads it into both copies (on 2 ranks
// and on 1), and a run stopped after step 2 resumes bitwise.
TEST_F(TiedLlamaWeights, AcrossStagesTheWeightIsWrittenOnceAndLoadsIntoBothCopies) {
  TrainConfig c = config("llama", (dir_ / "ck").string());
  c.model.tie_embeddings = true;
  c.training.steps = 4;
  c.checkpoint.dir.clear();
  const TrainResult whole = train_in_process(c, nullptr);
  c.checkpoint.dir = (dir_ / "ck").string();
  c.training.stop_after = 2;
  const TrainResult first = train_in_process(c, nullptr);
  const std::string ck = (dir_ / "ck" / "step-000002").string();
  const std::string file = (dir_ / "model.safetensors").string();
  const ExportSummary summary = export_weights(ck, file);
  EXPECT_EQ(summary.tensors, 2 + 4 * 9);  // embedding, norm, 4 blocks of 9: no head
  const weights::SafetensorsFile read(file);
  EXPECT_EQ(read.find("lm_head.weight"), nullptr);
  ASSERT_NE(read.find("model.embed_tokens.weight"), nullptr);
  int64_t copies = 0;
  for (const auto& [name, t] : first.params) {
    if (name != "embed_tokens.weight") continue;
    ++copies;
    EXPECT_EQ(read.read("model.embed_tokens.weight"), bytes_of(t));
  }
  EXPECT_EQ(copies, 2);
  EXPECT_NE(slurp(dir_ / "config.json").find("\"tie_word_embeddings\": true"), std::string::npos);

  // init_from into both copies: 2 ranks, and one stage.
  for (const int ranks : {2, 1}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    TrainConfig from = config("llama", (dir_ / ("from" + std::to_string(ranks))).string());
    from.model.tie_embeddings = true;
    from.schedule.ranks = ranks;
    no_change(from);
    from.training.init_from = file;
    const TrainResult loaded = train_in_process(from, nullptr);
    std::map<std::string, at::Tensor> want(first.params.begin(), first.params.end());
    for (const auto& [name, t] : loaded.params) EXPECT_TRUE(at::equal(t, want.at(name))) << name;
  }

  // Resumed after step 2: steps 3 and 4 as the uninterrupted run's, bitwise.
  c.training.stop_after = 0;
  c.checkpoint.resume = "latest";
  const TrainResult second = train_in_process(c, nullptr);
  ASSERT_EQ(second.steps.size(), 2u);
  for (size_t k = 0; k < 2; ++k) EXPECT_EQ(second.steps[k].loss, whole.steps[k + 2].loss);
  ASSERT_EQ(second.params.size(), whole.params.size());
  for (size_t k = 0; k < whole.params.size(); ++k) {
    EXPECT_EQ(second.params[k].first, whole.params[k].first);
    EXPECT_TRUE(at::equal(second.params[k].second, whole.params[k].second))
        << whole.params[k].first;
  }
}

TEST(WeightNames, TheLlamasAreHuggingFacesAndOnlyItsInvFreqBufferIsIgnored) {
  const WeightNameMap llama = weight_name_map(models::ModelKind::kLlama);
  EXPECT_EQ(llama("embed_tokens.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(llama("layers.1.self_attn.q_proj.weight"), "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(llama("norm.weight"), "model.norm.weight");
  EXPECT_EQ(llama("lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(weight_name_map(models::ModelKind::kGpt)("blocks.0.ln1.weight"), "blocks.0.ln1.weight");
  EXPECT_TRUE(ignored_weight_name(models::ModelKind::kLlama, "model.rotary_emb.inv_freq"));
  EXPECT_TRUE(ignored_weight_name(models::ModelKind::kLlama,
                                  "model.layers.3.self_attn.rotary_emb.inv_freq"));
  EXPECT_FALSE(ignored_weight_name(models::ModelKind::kLlama, "model.layers.0.mlp.inv_freq"));
  EXPECT_FALSE(ignored_weight_name(models::ModelKind::kLlama, "rotary_emb.inv_freq"));
  EXPECT_FALSE(ignored_weight_name(models::ModelKind::kLlama, "model.foo.rotary_emb.inv_freq"));
  EXPECT_FALSE(ignored_weight_name(models::ModelKind::kLlama,
                                   "model.layers.x.self_attn.rotary_emb.inv_freq"));
  EXPECT_FALSE(ignored_weight_name(models::ModelKind::kGpt, "model.rotary_emb.inv_freq"));
}

TEST(WeightFilesGenerate, TheExportedFileSamplesTheCheckpointsBytes) {
  const fs::path dir =
      fs::temp_directory_path() / ("pipemat_weight_files_generate_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream text(dir / "text.txt", std::ios::binary);
    for (int i = 0; i < 2000; ++i) text << "the cat sat on the mat " << i % 7 << "\n";
  }
  for (const models::ModelKind kind : {models::ModelKind::kGpt, models::ModelKind::kLlama}) {
    SCOPED_TRACE(to_string(kind));
    TrainConfig c;
    c.model.kind = kind;
    c.model.layers = 4;
    c.model.hidden = 16;
    c.model.heads = 2;
    c.model.ffn = 32;
    c.model.seq_len = 16;
    c.model.batch = 2;
    c.data.path = (dir / "text.txt").string();
    c.data.validation = 0.25;
    c.schedule.kind = schedule::ScheduleKind::kOneFOneB;
    c.schedule.ranks = 2;
    c.schedule.micro_batches = 2;
    c.training.steps = 2;
    c.checkpoint.dir = (dir / "ck").string();
    c.output.progress = false;
    train_in_process(c, nullptr);
    const std::string ck = (dir / "ck" / "step-000002").string();
    const std::string file = (dir / (std::string(to_string(kind)) + ".safetensors")).string();
    export_weights(ck, file);
    SampleOptions o;
    o.tokens = 64;
    o.prompt = "the cat";
    o.seed = 4;
    const GenerateResult from_ck = generate_text(ck, o);
    const GenerateResult from_file = generate_text(file, o);
    EXPECT_EQ(from_file.text, from_ck.text);
    EXPECT_EQ(from_file.text.size(), 64u);
    EXPECT_EQ(from_file.step, -1);
    EXPECT_EQ(from_file.model, from_ck.model);
    fs::remove_all(dir / "ck");
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pipemat::train
