// StageSplit invariance (Note [Random streams of a step]): one model, seed, data, global batch and
// micro-batch count train to the same losses, gradient norms, validation losses and parameters,
// bitwise, whatever the pipeline degree, the layers per stage, the schedule kind and its virtual
// stages: the GPT with dropout, the Llama and a zoo model, in fp32 and bf16, 6 steps with
// clipping active. The single-process reference of one stage is the measure: the reference
// chained over other splits, and a pipeline of every schedule kind on threads, equal it. A tied
// Llama trains alike on every split of two or more stages, and differs from one stage in the
// last bits (the Note says why).

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/train/config.h"
#include "pipemat/train/text_data.h"
#include "pipemat/train/train.h"
#include "text_config.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

constexpr double kLayoutClip = 0.05;  // below every step's gradient norm: clipping acts

// A text file under the temp dir for one test, removed at its end.
class LayoutText {
 public:
  LayoutText() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "pipemat_layout_" + std::string(info->test_suite_name()) + "_" +
                       info->name() + "_" + std::to_string(::getpid()) + ".txt";
    std::replace(name.begin(), name.end(), '/', '_');
    path_ = fs::temp_directory_path() / name;
    const char* words[] = {"one", "two", "three", "four", "five", "six", "seven", "eight"};
    std::string text;
    for (uint32_t i = 0; text.size() < 16 * kSplitBlock; ++i) {
      text += words[(i * 5 + i / 3) % 8];
      text += (i % 7 == 6) ? ".\n" : " ";
    }
    std::ofstream(path_, std::ios::binary) << text;
  }
  ~LayoutText() { fs::remove(path_); }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

// 4 layers in one stage (1 rank), 4 micro-batches, 6 steps of AdamW with clipping, warm-up and
// cosine decay; the text models evaluate after steps 2 and 5. `model`: gpt (dropout 0.1), llama
// or transformer (the zoo's, on synthetic data).
TrainConfig layout_config(const std::string& text, const std::string& model, bool bf16) {
  TrainConfig c = model == "llama" ? testing::llama_config(text, "1f1b", "selective")
                                   : testing::text_config(text, "1f1b", "selective");
  if (model == "gpt") {
    c.model.kind = models::ModelKind::kGpt;
    c.model.hidden = 16;
    c.model.heads = 2;
    c.model.ffn = 32;
    c.model.dropout = 0.1;
  } else if (model == "transformer") {
    c.model.kind = models::ModelKind::kTransformer;
    c.model.hidden = 16;
    c.model.heads = 2;
    c.model.ffn = 32;
    c.model.tokens = 8;
  }
  c.model.layers = 4;
  c.schedule.ranks = 1;
  c.training.steps = 6;
  c.training.eval_every = models::is_text_model(c.model.kind) ? 3 : 0;
  c.training.clip_grad_norm = kLayoutClip;
  if (bf16) c.training.precision = pp::Precision::kBFloat16;
  return c;
}

// A split of the 4 layers: the schedule kind, its ranks and the layers of each model stage
// (ranks x 2 stages for interleaved, with 2 virtual stages, and for zb-v).
struct StageSplit {
  std::string kind;
  int ranks = 1;
  std::vector<int64_t> layers_per_stage;
};

void PrintTo(const StageSplit& l, std::ostream* os) {
  *os << l.kind << " on " << l.ranks << " ranks, layers per stage [";
  for (size_t i = 0; i < l.layers_per_stage.size(); ++i) {
    *os << (i ? ", " : "") << l.layers_per_stage[i];
  }
  *os << "]";
}

TrainConfig with_split(TrainConfig c, const StageSplit& l) {
  c.schedule.kind = schedule::parse_schedule_kind(l.kind);
  c.schedule.ranks = l.ranks;
  c.schedule.virtual_stages = l.kind == "interleaved" ? 2 : 1;
  c.partition.layers_per_stage = l.layers_per_stage;
  return c;
}

// What a run trained: per step its loss and gradient norm, the validation losses, and the
// parameters by their name in the whole model (a tied weight's copies are one name, checked
// equal).
struct LayoutOutcome {
  std::vector<double> losses, grad_norms;
  std::vector<std::pair<int64_t, double>> validation;
  std::map<std::string, at::Tensor> params;
};

LayoutOutcome outcome_of(const TrainResult& r) {
  LayoutOutcome t;
  for (const StepMetrics& m : r.steps) {
    t.losses.push_back(m.loss);
    t.grad_norms.push_back(m.grad_norm);
  }
  t.validation = r.validation;
  for (const auto& [name, value] : r.params) {
    const auto [it, fresh] = t.params.emplace(name, value);
    if (!fresh) {
      EXPECT_TRUE(at::equal(it->second, value)) << "the copies of tied " << name;
    }
  }
  return t;
}

LayoutOutcome layout_reference(const TrainConfig& c) {
  return outcome_of(train_reference(c, nullptr));
}

// Equal bit for bit; `want` clipped at every step.
void expect_same_training(const LayoutOutcome& got, const LayoutOutcome& want) {
  ASSERT_EQ(want.losses.size(), 6u);
  for (double norm : want.grad_norms) EXPECT_GT(norm, kLayoutClip) << "clipping acted";
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_EQ(got.grad_norms, want.grad_norms);
  EXPECT_EQ(got.validation, want.validation);
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [name, value] : want.params) {
    const auto it = got.params.find(name);
    ASSERT_NE(it, got.params.end()) << name;
    EXPECT_TRUE(at::equal(it->second, value)) << "parameter " << name;
  }
}

struct LayoutModel {
  std::string model;
  bool bf16 = false;
};

void PrintTo(const LayoutModel& m, std::ostream* os) {
  *os << m.model << (m.bf16 ? " bf16" : " fp32");
}

std::string layout_model_name(const LayoutModel& m) {
  return m.model + (m.bf16 ? "_bf16" : "_fp32");
}

const std::vector<LayoutModel>& layout_models() {
  static const std::vector<LayoutModel> cases{{"gpt", false},         {"gpt", true},
                                              {"llama", false},       {"llama", true},
                                              {"transformer", false}, {"transformer", true}};
  return cases;
}

// The reference chained over every split of 2, 3 and 4 stages equals the one of one stage.
class LayoutReference : public ::testing::TestWithParam<LayoutModel> {};

TEST_P(LayoutReference, EverySplitTrainsAsOneStageBitwise) {
  LayoutText text;
  const TrainConfig c = layout_config(text.path(), GetParam().model, GetParam().bf16);
  const LayoutOutcome one = layout_reference(c);
  for (const StageSplit& l : std::vector<StageSplit>{{"1f1b", 2, {1, 3}},
                                                     {"1f1b", 2, {2, 2}},
                                                     {"1f1b", 2, {3, 1}},
                                                     {"1f1b", 3, {1, 2, 1}},
                                                     {"1f1b", 3, {2, 1, 1}},
                                                     {"1f1b", 4, {1, 1, 1, 1}}}) {
    SCOPED_TRACE(::testing::PrintToString(l));
    expect_same_training(layout_reference(with_split(c, l)), one);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, LayoutReference, ::testing::ValuesIn(layout_models()),
                         [](const ::testing::TestParamInfo<LayoutModel>& test) {
                           return layout_model_name(test.param);
                         });

// A pipeline of each schedule kind on threads, each on another split with selective remat and
// pre-triggered replays, equals the reference of one stage.
struct LayoutPipelineCase {
  StageSplit layout;
  LayoutModel model;
};

void PrintTo(const LayoutPipelineCase& p, std::ostream* os) {
  PrintTo(p.layout, os);
  *os << ", ";
  PrintTo(p.model, os);
}

std::vector<LayoutPipelineCase> layout_pipeline_cases() {
  const std::vector<StageSplit> layouts{
      {"gpipe", 2, {3, 1}},    {"1f1b", 4, {1, 1, 1, 1}}, {"interleaved", 2, {1, 1, 1, 1}},
      {"zb-h1", 3, {1, 2, 1}}, {"zb-h2", 2, {1, 3}},      {"zb-v", 2, {1, 1, 1, 1}}};
  std::vector<LayoutPipelineCase> out;
  for (const StageSplit& l : layouts) {
    for (const LayoutModel& m : layout_models()) out.push_back({l, m});
  }
  return out;
}

class LayoutPipeline : public ::testing::TestWithParam<LayoutPipelineCase> {};

TEST_P(LayoutPipeline, TrainsAsOneStageBitwise) {
  LayoutText text;
  const TrainConfig c = layout_config(text.path(), GetParam().model.model, GetParam().model.bf16);
  expect_same_training(outcome_of(train_in_process(with_split(c, GetParam().layout), nullptr)),
                       layout_reference(c));
}

INSTANTIATE_TEST_SUITE_P(Kinds, LayoutPipeline, ::testing::ValuesIn(layout_pipeline_cases()),
                         [](const ::testing::TestParamInfo<LayoutPipelineCase>& test) {
                           const StageSplit& l = test.param.layout;
                           std::string n = l.kind + "_" + std::to_string(l.ranks) + "ranks_";
                           for (int64_t k : l.layers_per_stage) n += std::to_string(k);
                           n += "_" + layout_model_name(test.param.model);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// Note [Data x pipeline]: at a data degree of 2 (sharded optimizer or not) every split trains
// alike too, the GPT with dropout in fp32 and bf16: the reference on 1, 2 and 4 stages and a 2 x 2
// ZB-V pipeline with a sharded optimizer (4 ranks).
TEST(LayoutData, TwoReplicasTrainAlikeOnEverySplit) {
  LayoutText text;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    TrainConfig c = layout_config(text.path(), "gpt", bf16);
    c.parallel.data = 2;
    const LayoutOutcome one = layout_reference(c);
    for (const StageSplit& l :
         std::vector<StageSplit>{{"1f1b", 2, {1, 3}}, {"1f1b", 4, {1, 1, 1, 1}}}) {
      SCOPED_TRACE(::testing::PrintToString(l));
      expect_same_training(layout_reference(with_split(c, l)), one);
    }
    TrainConfig sharded = with_split(c, {"zb-v", 2, {1, 1, 1, 1}});
    sharded.parallel.shard_optimizer = true;
    expect_same_training(outcome_of(train_in_process(sharded, nullptr)), one);
  }
}

// Note [Tied weights] and Note [Random streams of a step]: a tied Llama trains alike on every
// split that puts its copies on two stages or more (each copy sums its micro-batches, then the
// copies are added), in the reference and in pipelines whose first and last stage share a rank
// (zb-v) or not, fp32 and bf16; one stage holds the weight once and adds each micro-batch's two
// uses first, which differs in the last bits.
TEST(LayoutTied, LlamaTrainsAlikeOnEverySplitOfTwoStagesOrMore) {
  LayoutText text;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    TrainConfig c = layout_config(text.path(), "llama", bf16);
    c.model.tie_embeddings = true;
    const LayoutOutcome two = layout_reference(with_split(c, {"1f1b", 2, {1, 3}}));
    for (const StageSplit& l :
         std::vector<StageSplit>{{"1f1b", 2, {3, 1}}, {"1f1b", 4, {1, 1, 1, 1}}}) {
      SCOPED_TRACE(::testing::PrintToString(l));
      expect_same_training(layout_reference(with_split(c, l)), two);
    }
    for (const StageSplit& l :
         std::vector<StageSplit>{{"zb-v", 2, {1, 1, 1, 1}}, {"zb-h1", 3, {2, 1, 1}}}) {
      SCOPED_TRACE(::testing::PrintToString(l));
      expect_same_training(outcome_of(train_in_process(with_split(c, l), nullptr)), two);
    }
    const LayoutOutcome one = layout_reference(c);
    EXPECT_EQ(one.losses.front(), two.losses.front()) << "the first forward is the same";
    EXPECT_FALSE(
        at::equal(one.params.at("embed_tokens.weight"), two.params.at("embed_tokens.weight")))
        << "one stage adds the two uses of each micro-batch first";
  }
}

}  // namespace
}  // namespace pipemat::train
