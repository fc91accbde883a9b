// Training the Llama (model.kind llama): through the pipeline against the same model trained in
// one process (every schedule kind, none / full / selective remat, fp32 and bf16, two data
// replicas), a tied head, its config keys' errors, and model.from reading a Hugging Face
// config.json.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/train/config.h"
#include "pipemat/train/generate.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/plan.h"
#include "pipemat/train/text_data.h"
#include "pipemat/train/train.h"
#include "text_config.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the temp dir, removed at the end of the test.
class LlamaDir {
 public:
  LlamaDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name =
        "pipemat_llama_" + std::string(info->name()) + "_" + std::to_string(::getpid());
    std::replace(name.begin(), name.end(), '/', '_');
    path_ = fs::temp_directory_path() / name;
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~LlamaDir() { fs::remove_all(path_); }
  std::string file(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
    return (path_ / name).string();
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

// Lines of counted words: text with a structure a few steps can start to learn.
std::string counting_text(size_t bytes) {
  const char* words[] = {"one", "two", "three", "four", "five", "six", "seven", "eight"};
  std::string text;
  for (uint32_t i = 0; text.size() < bytes; ++i) {
    text += words[i % 8];
    text += (i % 5 == 4) ? ".\n" : " ";
  }
  text.resize(bytes);
  return text;
}

struct LlamaCase {
  std::string kind;
  std::string policy;
  bool bf16 = false;
};

class LlamaGrid : public ::testing::TestWithParam<LlamaCase> {};

TEST_P(LlamaGrid, PipelineEqualsTheSingleProcessTrainingBitwise) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, GetParam().kind, GetParam().policy);
  if (GetParam().bf16) c.training.precision = pp::Precision::kBFloat16;
  const TrainResult ref = testing::expect_pipeline_equals_reference(c);
  std::map<std::string, at::Tensor> want(ref.params.begin(), ref.params.end());
  // Global block numbering and the Hugging Face module names.
  EXPECT_TRUE(want.count("layers.3.self_attn.k_proj.weight"));
  EXPECT_EQ(want.count("embed_tokens.weight"), 1u);
  EXPECT_EQ(want.count("lm_head.weight"), 1u);
  EXPECT_EQ(want.count("norm.weight"), 1u);
  EXPECT_EQ(want.size(), 3u + 4u * 9u);
  // k_proj of 2 key/value heads of size 4: [8, 16].
  EXPECT_EQ(want["layers.0.self_attn.k_proj.weight"].sizes(), (std::vector<int64_t>{8, 16}));
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, LlamaGrid,
    ::testing::Values(LlamaCase{"1f1b", "none"}, LlamaCase{"1f1b", "full"},
                      LlamaCase{"1f1b", "selective"}, LlamaCase{"zb-v", "none"},
                      LlamaCase{"zb-v", "full"}, LlamaCase{"zb-v", "selective"},
                      LlamaCase{"gpipe", "selective"}, LlamaCase{"interleaved", "selective"},
                      LlamaCase{"zb-h1", "selective"}, LlamaCase{"zb-h2", "full"},
                      LlamaCase{"1f1b", "none", true}, LlamaCase{"1f1b", "full", true},
                      LlamaCase{"1f1b", "selective", true}, LlamaCase{"zb-v", "none", true},
                      LlamaCase{"zb-v", "full", true}, LlamaCase{"zb-v", "selective", true}),
    [](const ::testing::TestParamInfo<LlamaCase>& test) {
      std::string n = test.param.kind + "_" + test.param.policy + (test.param.bf16 ? "_bf16" : "");
      std::replace(n.begin(), n.end(), '-', '_');
      return n;
    });

// model.vocab 1000, tied and untied (tied in one stage), fp32 and bf16: the embedding and the head
// have 1000 rows and the pipeline equals the single process bitwise.
TEST(LlamaVocab, AVocabularyOf1000EqualsTheSingleProcessBitwise) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    TrainConfig c = testing::llama_config(text, "zb-v", "selective");
    c.model.vocab = 1000;
    if (bf16) c.training.precision = pp::Precision::kBFloat16;
    const TrainResult ref = testing::expect_pipeline_equals_reference(c);
    std::map<std::string, at::Tensor> got(ref.params.begin(), ref.params.end());
    EXPECT_EQ(got.at("embed_tokens.weight").sizes(), (std::vector<int64_t>{1000, 16}));
    EXPECT_EQ(got.at("lm_head.weight").sizes(), (std::vector<int64_t>{1000, 16}));
  }
  TrainConfig tied = testing::llama_config(text, "1f1b", "none");
  tied.model.vocab = 1000;
  tied.model.tie_embeddings = true;
  tied.schedule.ranks = 1;
  testing::expect_pipeline_equals_reference(tied);
}

// Note [Tied weights]: a tied llama across stages (the last stage holds a copy of the embedding)
// equals the single process bitwise under every schedule kind, on 2 and 4 ranks, with vocabularies
// of 1000 and 32,000, fp32 and bf16, 2 x 2 data x pipeline with and without a sharded
// optimizer; the copies end equal (expect_pipeline_equals_reference checks a name held twice).
struct TiedCase {
  std::string kind;
  int ranks = 2;
  int64_t vocab = 1000;
  bool bf16 = false;
  int data = 1;
  bool sharded = false;
};

// The case in ctest's and gtest's listings (not its bytes).
void PrintTo(const TiedCase& t, std::ostream* os) {
  *os << t.kind << " on " << t.ranks << " ranks, vocab " << t.vocab << (t.bf16 ? ", bf16" : "")
      << (t.data > 1 ? ", " + std::to_string(t.data) + " replicas" : "")
      << (t.sharded ? ", sharded" : "");
}

class LlamaTied : public ::testing::TestWithParam<TiedCase> {};

TEST_P(LlamaTied, CopiesAcrossStagesEqualTheSingleProcessBitwise) {
  const TiedCase& t = GetParam();
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, t.kind, t.kind == "zb-v" ? "selective" : "none");
  c.model.tie_embeddings = true;
  c.model.vocab = t.vocab;
  c.schedule.ranks = t.ranks;
  c.model.layers = t.ranks * c.schedule.virtual_stages * (t.kind == "zb-v" ? 2 : 1);
  c.parallel.data = t.data;
  c.parallel.shard_optimizer = t.sharded;
  if (t.bf16) c.training.precision = pp::Precision::kBFloat16;
  const TrainResult ref = testing::expect_pipeline_equals_reference(c);
  // One weight under one name, held by the first and the last stage; no head of its own.
  int64_t embeddings = 0;
  for (const auto& [name, value] : ref.params) {
    EXPECT_NE(name, "lm_head.weight");
    if (name == "embed_tokens.weight") {
      ++embeddings;
      EXPECT_EQ(value.sizes(), (std::vector<int64_t>{t.vocab, 16}));
    }
  }
  EXPECT_EQ(embeddings, 2);
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, LlamaTied,
    ::testing::Values(TiedCase{"gpipe"}, TiedCase{"1f1b"}, TiedCase{"interleaved"},
                      TiedCase{"zb-h1"}, TiedCase{"zb-h2"}, TiedCase{"zb-v"}, TiedCase{"1f1b", 4},
                      TiedCase{"zb-v", 4}, TiedCase{"interleaved", 4},
                      TiedCase{"1f1b", 2, 1000, true}, TiedCase{"zb-v", 2, 1000, true},
                      TiedCase{"1f1b", 2, 32000}, TiedCase{"zb-v", 2, 32000, true},
                      TiedCase{"1f1b", 2, 1000, false, 2},
                      TiedCase{"1f1b", 2, 1000, false, 2, true},
                      TiedCase{"zb-v", 2, 1000, true, 2, true}),
    [](const ::testing::TestParamInfo<TiedCase>& test) {
      const TiedCase& p = test.param;
      std::string n = p.kind + "_" + std::to_string(p.ranks) + "ranks_vocab" +
                      std::to_string(p.vocab) + (p.bf16 ? "_bf16" : "") +
                      (p.data > 1 ? "_data" + std::to_string(p.data) : "") +
                      (p.sharded ? "_sharded" : "");
      std::replace(n.begin(), n.end(), '-', '_');
      return n;
    });

// Note [Data x pipeline]: 2 replicas of the 2-rank llama pipeline equal the single process that
// combines their gradients, bitwise (zb-v: every backward split).
TEST(LlamaData, TwoReplicasEqualTheSingleProcessBitwise) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "zb-v", "selective");
  c.parallel.data = 2;
  testing::expect_pipeline_equals_reference(c);
}

// Selective remat: 4 blocks x 4 micro-batches are units, each replayed once; each replay skips
// the five SAVE regions (q, k, v, gate, up).
TEST(Llama, SelectiveRematSavesTheFiveGemmsAndReplaysTheRest) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "1f1b", "selective");
  c.training.steps = 1;
  // Both stages by name (remat.policy alone leaves the last stage of 1F1B without a checkpoint).
  c.remat.stages.assign(2, models::StageRemat::named(models::RematPolicyKind::kSelective));
  const TrainResult r = train_in_process(c, nullptr);
  const remat::RematCounters& k = r.last.remat;
  EXPECT_EQ(k.unit_calls, 16);
  EXPECT_EQ(k.replays, 16);
  EXPECT_EQ(k.save_calls, 80);
  EXPECT_EQ(k.save_skips, 80);
}

// A tied head (one stage: embedding and head share the weight): no lm_head parameter, the first
// loss about ln 256, and the loss falls.
TEST(Llama, TiedEmbeddingsTrainInOneStage) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "1f1b", "selective");
  c.schedule.ranks = 1;
  c.model.tie_embeddings = true;
  c.training.steps = 4;
  c.training.lr_decay = LrDecay::kNone;
  c.training.eval_every = 0;
  const TrainResult r = train_in_process(c, nullptr);
  std::map<std::string, at::Tensor> params(r.params.begin(), r.params.end());
  EXPECT_EQ(params.count("lm_head.weight"), 0u);
  EXPECT_EQ(params.size(), 2u + 4u * 9u);
  ASSERT_EQ(r.steps.size(), 4u);
  EXPECT_NEAR(r.steps[0].loss, std::log(256.0), 0.1);
  EXPECT_LT(r.steps[3].loss, r.steps[0].loss);
}

// `pipemat plan` on the llama: a block's SAVE leaves are the five GEMMs of the selective policy
// (o_proj and down_proj are plain members), so with 5 leaves tried the profile holds none, full
// and the 31 sets, and the uniform selective row is one of them.
TEST(Llama, PlanProfilesTheFiveSaveLeavesOfABlock) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "1f1b", "selective");
  c.training.eval_every = 0;
  c.training.threads = 1;
  PlanOptions options;
  options.budget_bytes = {int64_t{1} << 40};
  options.repeats = 1;
  options.warmup = 0;
  options.max_save_leaves = 5;
  const PlanReport r = run_plan(c, options);
  ASSERT_EQ(r.problem.layers.size(), 6u);  // per stage: "stage s" and its 2 blocks
  EXPECT_EQ(r.problem.layers[1].layer, "layers.0");
  EXPECT_EQ(r.problem.layers[1].candidates.size(), 33u);
  std::vector<std::string> policies;
  for (const UniformPrediction& u : r.uniform) policies.push_back(u.policy);
  EXPECT_EQ(policies, (std::vector<std::string>{"none", "full", "selective"}));
  EXPECT_TRUE(r.result.best.fits());
}

// Note [Split by cost]: partition.layers_per_stage auto with a head that costs several blocks
// (vocab 4000 over hidden 16): every rank trains the split rank 0 chose and printed, with the
// losses of the same split given by hand, bitwise; the printed parameter split is the default's.
TEST(LlamaCostSplit, AutoTrainsTheSplitItPrintsAsIfGivenByHand) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "1f1b", "selective");
  c.model.layers = 6;
  c.model.vocab = 4000;
  c.training.eval_every = 0;
  c.training.steps = 2;
  c.training.threads = 1;
  c.output.progress = true;
  c.output.loss_svg.clear();
  c.partition.by_cost = true;
  std::ostringstream out;
  const TrainResult automatic = train_in_process(c, &out);
  const std::smatch m = [&] {
    std::smatch found;
    const std::string text_out = out.str();
    static const std::regex line(
        R"(split by cost: \[(\d+), (\d+)\] layers per stage, predicted step [0-9.]+ ms; )"
        R"(parameter split \[(\d+), (\d+)\]: [0-9.]+ ms \([0-9.]+x\))");
    EXPECT_TRUE(std::regex_search(text_out, found, line)) << text_out;
    return found;
  }();
  ASSERT_EQ(m.size(), 5u);
  const std::vector<int64_t> chosen = {std::stoll(m[1]), std::stoll(m[2])};
  EXPECT_EQ(chosen[0] + chosen[1], 6);
  // The parameter split of 6 blocks with a 4000 x 16 embedding and head: 3 and 3.
  EXPECT_EQ(std::stoll(m[3]), 3);
  EXPECT_EQ(std::stoll(m[4]), 3);
  TrainConfig by_hand = c;
  by_hand.partition.by_cost = false;
  by_hand.partition.layers_per_stage = chosen;
  by_hand.output.progress = false;
  const TrainResult given = train_in_process(by_hand, nullptr);
  ASSERT_EQ(automatic.steps.size(), 2u);
  ASSERT_EQ(given.steps.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(automatic.steps[s].loss, given.steps[s].loss) << "step " << s;
    EXPECT_EQ(automatic.steps[s].grad_norm, given.steps[s].grad_norm) << "step " << s;
  }
}

// Rank 0's failure to choose ends every rank with its message (no rank waits for a split).
TEST(LlamaCostSplit, RankZerosErrorEndsEveryRank) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "1f1b", "selective");
  c.training.eval_every = 0;
  c.partition.by_cost = true;
  c.remat.policy = models::RematPolicyKind::kCustom;  // not through the config's checks
  c.remat.custom.checkpoint = {"layers.*"};
  try {
    train_in_process(c, nullptr);
    ADD_FAILURE() << "auto with a custom remat policy trained";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("partition.layers_per_stage auto profiles the layers "
                                         "under remat.policy none, full or selective"),
              std::string::npos)
        << e.what();
  }
}

// The sample after training and `pipemat generate` from a llama checkpoint of a zb-v run (the
// embedding and the head on rank 0, in two stages).
TEST(Llama, SamplesFromItsCheckpoint) {
  LlamaDir dir;
  const std::string text = dir.file("text.txt", counting_text(16 * kSplitBlock));
  TrainConfig c = testing::llama_config(text, "zb-v", "selective");
  c.checkpoint.dir = dir.path() + "/ck";
  c.sample.tokens = 37;
  c.sample.prompt = "one two";
  const TrainResult r = train_in_process(c, nullptr);
  EXPECT_EQ(r.sample.size(), 37u);
  SampleOptions o;
  o.tokens = 37;
  o.prompt = "one two";
  const GenerateResult g = generate_text(dir.path() + "/ck/step-000003", o);
  EXPECT_EQ(g.text, r.sample);  // the same checkpoint, prompt and seed: the same bytes
  // 16,016 parameters: embedding and head 2 x 256 x 16, final norm 16, and per block q and o
  // 2 x 16 x 16, k and v 2 x 16 x 8, gate, up and down 3 x 16 x 24, two norms 2 x 16.
  EXPECT_EQ(
      g.model,
      "llama: 4 blocks, hidden 16, 4 heads (2 key/value), ffn 24, 16.0k parameters, seq_len 16");
  o.tokens = 40;  // longer than seq_len: the context slides
  EXPECT_EQ(generate_text(dir.path() + "/ck/step-000003", o).text.size(), 40u);
}

// ---- config keys -------------------------------------------------------------------------

std::string config_error(const std::string& yaml) {
  try {
    parse_config(yaml, "x.yaml");
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(LlamaConfig, ChecksNameTheKey) {
  const std::string base = "data: {path: t.txt}\nmodel:\n  kind: llama\n";
  EXPECT_EQ(config_error(base + "  hidden: 64\n  heads: 8\n  kv_heads: 3\n"),
            "x.yaml:6: model.kv_heads: heads 8 is not a multiple of kv_heads 3; expected "
            "model.heads % model.kv_heads == 0 (every key/value head serves an equal group of "
            "query heads)");
  EXPECT_EQ(config_error(base + "  hidden: 24\n  heads: 8\n"),
            "x.yaml:5: model.heads: the head size model.hidden / model.heads = 3 is odd; the "
            "rotary embedding rotates pairs of a head's features");
  EXPECT_EQ(config_error(base + "  dropout: 0.1\n"),
            "x.yaml:4: model.dropout: llama has no dropout; expected 0");
  EXPECT_EQ(
      config_error(base + "  rope_theta: 0\n"),
      "x.yaml:4: model.rope_theta: '0' is out of range; expected a number in (0, 1000000000000]");
  EXPECT_EQ(config_error(base + "  norm_eps: -1\n"),
            "x.yaml:4: model.norm_eps: '-1' is out of range; expected a number in (0, 1]");
  EXPECT_EQ(config_error("model: {kind: llama}\n"),
            "x.yaml:1: model.kind: llama trains on text and needs data.path, a text file or a "
            "directory of text files (e.g. /usr/share/games/fortunes)");
  EXPECT_EQ(config_error(base + "sample: {tokens: 5}\n"),
            "x.yaml:4: sample.tokens: the sample is drawn from the final checkpoint and needs "
            "checkpoint.dir");
  const TrainConfig ok = parse_config(base + "  heads: 4\n  kv_heads: 1\n", "x.yaml");
  EXPECT_EQ(ok.model.kv_heads, 1);
  EXPECT_EQ(ok.model.rope_theta, 10000.0);
  EXPECT_EQ(ok.model.norm_eps, 1e-5);
  EXPECT_FALSE(ok.model.tie_embeddings);
}

// ---- model.from --------------------------------------------------------------------------

const char* const kHfConfig = R"({
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 48,
  "intermediate_size": 128,
  "num_hidden_layers": 3,
  "num_attention_heads": 6,
  "num_key_value_heads": 2,
  "rope_theta": 500000.0,
  "rms_norm_eps": 1e-05,
  "vocab_size": 256,
  "tie_word_embeddings": true,
  "max_position_embeddings": 64,
  "hidden_act": "silu",
  "attention_bias": false,
  "mlp_bias": false,
  "rope_scaling": null,
  "torch_dtype": "bfloat16"
})";

std::string with_field(const std::string& json, const std::string& field,
                       const std::string& value) {
  const auto at = json.find("\"" + field + "\"");
  const auto end = json.find_first_of(",\n}", json.find(':', at));
  return json.substr(0, json.find(':', at) + 2) + value + json.substr(end);
}

TEST(LlamaFrom, ReadsAHuggingFaceConfigJson) {
  LlamaDir dir;
  dir.file("config.json", kHfConfig);
  const std::string yaml =
      "data: {path: t.txt}\nmodel: {kind: llama, seq_len: 256, from: \"" + dir.path() + "\"}\n";
  // seq_len given above max_position_embeddings is an error naming it; the default is capped.
  EXPECT_EQ(config_error(yaml),
            "x.yaml:2: model.seq_len: 256 is longer than max_position_embeddings 64 of " +
                dir.path() + "/config.json");
  const TrainConfig c = parse_config(
      "data: {path: t.txt}\nmodel: {kind: llama, from: \"" + dir.path() + "\"}\n", "x.yaml");
  EXPECT_EQ(c.model.layers, 3);
  EXPECT_EQ(c.model.hidden, 48);
  EXPECT_EQ(c.model.ffn, 128);
  EXPECT_EQ(c.model.heads, 6);
  EXPECT_EQ(c.model.kv_heads, 2);
  EXPECT_EQ(c.model.rope_theta, 500000.0);
  EXPECT_EQ(c.model.norm_eps, 1e-5);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.model.seq_len, 64);
  EXPECT_EQ(c.model.vocab, 256);
  EXPECT_EQ(c.model.from, "");      // resolved: the run's config holds the keys themselves
  EXPECT_EQ(c.data.tokenizer, "");  // no tokenizer in the directory: bytes
  // A tokenizer beside config.json is the run's, unless data.tokenizer names one.
  dir.file("tokenizer.json", "{}");
  EXPECT_EQ(
      parse_config("data: {path: t.txt}\nmodel: {kind: llama, from: \"" + dir.path() + "\"}\n",
                   "x.yaml")
          .data.tokenizer,
      dir.path());
  EXPECT_EQ(
      parse_config("data: {path: t.txt, tokenizer: mine.json}\nmodel: {kind: llama, from: \"" +
                       dir.path() + "\"}\n",
                   "x.yaml")
          .data.tokenizer,
      "mine.json");
  std::filesystem::remove(dir.path() + "/tokenizer.json");
  // Without the optional fields: LlamaConfig's defaults (kv_heads = heads, eps 1e-6, untied,
  // max_position_embeddings 2048).
  dir.file("config.json", R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256})");
  const TrainConfig d = parse_config(
      "data: {path: t.txt}\nmodel: {kind: llama, from: \"" + dir.path() + "\"}\n", "x.yaml");
  EXPECT_EQ(d.model.kv_heads, 4);
  EXPECT_EQ(d.model.norm_eps, 1e-6);
  EXPECT_EQ(d.model.rope_theta, 10000.0);
  EXPECT_FALSE(d.model.tie_embeddings);
  EXPECT_EQ(d.model.seq_len, 128);
  // Any vocabulary that holds the bytes: vocab_size sets model.vocab.
  dir.file("config.json", with_field(kHfConfig, "vocab_size", "32000"));
  EXPECT_EQ(
      parse_config("data: {path: t.txt}\nmodel: {kind: llama, from: \"" + dir.path() + "\"}\n",
                   "x.yaml")
          .model.vocab,
      32000);
  dir.file("config.json", R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256})");
  EXPECT_EQ(config_error("data: {path: t.txt}\nmodel: {kind: llama, seq_len: 4096, from: \"" +
                         dir.path() + "\"}\n"),
            "x.yaml:2: model.seq_len: 4096 is longer than max_position_embeddings 2048 of " +
                dir.path() + "/config.json (not given: transformers' default)");
}

// Issue 53: a config.json is read as transformers reads it, never as another model.
TEST(LlamaFrom, AFileTransformersWouldReadAsAnotherModelIsAnError) {
  LlamaDir dir;
  const std::string file = dir.path() + "/config.json";
  const std::string yaml =
      "data: {path: t.txt}\nmodel: {kind: llama, from: \"" + dir.path() + "\"}\n";
  const auto error_with = [&](const std::string& json) {
    dir.file("config.json", json);
    return config_error(yaml);
  };
  const std::string at = "x.yaml:2: model.from: " + file;
  const std::string shape = R"("hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4)";
  // No vocab_size: transformers' LlamaConfig takes 32000, and so does model.from; a vocabulary
  // that cannot hold the text's bytes is refused.
  dir.file("config.json", R"({"model_type": "llama", )" + shape + "}");
  EXPECT_EQ(parse_config(yaml, "x.yaml").model.vocab, 32000);
  EXPECT_EQ(error_with(R"({"model_type": "llama", "vocab_size": 100, )" + shape + "}"),
            at + ": field 'vocab_size' is 100; the llama trains on bytes of text (data.path), ids "
                 "0 to 255, so it needs at least 256");
  // No model_type.
  EXPECT_EQ(error_with(R"({"vocab_size": 256, )" + shape + "}"),
            at + ": field 'model_type' is missing; a Llama config.json says \"model_type\": "
                 "\"llama\" (without it the file does not say which model it describes)");
  // A key twice: transformers (Python's json) would take the last in silence.
  EXPECT_EQ(
      error_with(R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, )" + shape + "}"),
      at + ": key 'hidden_size' appears twice in the top-level object");
  // Not JSON: where and why.
  EXPECT_EQ(error_with(R"({"model_type": "llama", "rms_norm_eps": NaN})"),
            at + ": not valid JSON (parse error at line 1, column 41: syntax error while parsing "
                 "value - invalid literal; last read: '\"rms_norm_eps\": N')");
  EXPECT_EQ(error_with(R"({"model_type": "llama", "rope_theta": 1e999})"),
            at + ": not valid JSON (parse error at line 1, column 43: number overflow parsing "
                 "'1e999')");
  EXPECT_EQ(error_with("{\"model_type\": \"llama\xff\"}"),
            at + ": not valid JSON (parse error at line 1, column 22: syntax error while parsing "
                 "value - invalid string: ill-formed UTF-8 byte; last read: '\"llama\\xff')");
}

TEST(LlamaFrom, UnsupportedFieldsAndConflictsAreErrorsNamingThem) {
  LlamaDir dir;
  const std::string from = dir.path();
  const std::string file = from + "/config.json";
  const std::string yaml = "data: {path: t.txt}\nmodel: {kind: llama, from: \"" + from + "\"}\n";
  const auto error_with = [&](const std::string& json) {
    dir.file("config.json", json);
    return config_error(yaml);
  };
  const std::string at = "x.yaml:2: model.from: " + file + ": field ";
  EXPECT_EQ(error_with(with_field(kHfConfig, "rope_scaling", R"({"type": "linear"})")),
            at + "'rope_scaling' is set; only null (plain RoPE) is supported");
  EXPECT_EQ(error_with(with_field(kHfConfig, "attention_bias", "true")),
            at + "'attention_bias' is true; the llama's projections have no biases (expected "
                 "false)");
  EXPECT_EQ(error_with(with_field(kHfConfig, "mlp_bias", "true")),
            at + "'mlp_bias' is true; the llama's projections have no biases (expected false)");
  EXPECT_EQ(error_with(with_field(kHfConfig, "hidden_act", "\"gelu\"")),
            at + "'hidden_act' is 'gelu'; only silu (SwiGLU) is supported");
  EXPECT_EQ(error_with(with_field(kHfConfig, "model_type", "\"mistral\"")),
            at + "'model_type' is 'mistral'; expected llama");
  EXPECT_EQ(error_with(with_field(kHfConfig, "hidden_size", "\"48\"")),
            at + "'hidden_size' is \"48\"; expected an integer >= 1");
  EXPECT_EQ(error_with(R"({"model_type": "llama", "hidden_size": 32})"),
            at + "'num_hidden_layers' is missing; the model's shape comes from the file "
                 "(transformers' LlamaConfig would take 32, Llama-7B's, for it)");
  EXPECT_EQ(error_with("[1, 2]"),
            "x.yaml:2: model.from: " + file +
                " is a JSON array, not an object (a Hugging Face config.json)");
  // The keys model.from sets must not be given too; it needs kind llama; a missing file.
  dir.file("config.json", kHfConfig);
  EXPECT_EQ(config_error("data: {path: t.txt}\nmodel:\n  kind: llama\n  hidden: 64\n  from: \"" +
                         from + "\"\n"),
            "x.yaml:4: model.hidden: is set by model.from (" + from +
                "/config.json); give it in one place: remove it here or drop model.from");
  EXPECT_EQ(config_error("model: {kind: mlp, from: \"" + from + "\"}\n"),
            "x.yaml:1: model.from: reads a Hugging Face Llama config.json; it needs model.kind "
            "llama, not mlp");
  fs::remove(file);
  const std::string missing = config_error(yaml);
  EXPECT_NE(missing.find("model.from"), std::string::npos) << missing;
  EXPECT_NE(missing.find(file), std::string::npos) << missing;
}

}  // namespace
}  // namespace pipemat::train
