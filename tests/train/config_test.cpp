// The YAML config loader: values, defaults, overrides, round trip, shipped configs, and the exact
// text of every kind of error (source, line, key, value found, values allowed).

#include "pipemat/train/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/spelled.h"
#include "pipemat/schedule/schedule.h"

namespace pipemat::train {
namespace {

using schedule::RecomputeMode;
using schedule::ScheduleKind;

const char* const kSource = "x.yaml";

// The message of the ConfigError parse_config throws, or "(no error)".
std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(yaml, kSource, overrides);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "(no error)";
}

// Every field parse_config can set, compared one by one so a failure names the field.
void expect_same(const TrainConfig& a, const TrainConfig& b) {
  EXPECT_EQ(a.model.kind, b.model.kind);
  EXPECT_EQ(a.model.layers, b.model.layers);
  EXPECT_EQ(a.model.hidden, b.model.hidden);
  EXPECT_EQ(a.model.tokens, b.model.tokens);
  EXPECT_EQ(a.model.heads, b.model.heads);
  EXPECT_EQ(a.model.ffn, b.model.ffn);
  EXPECT_EQ(a.model.experts, b.model.experts);
  EXPECT_EQ(a.model.top_k, b.model.top_k);
  EXPECT_EQ(a.model.seq_len, b.model.seq_len);
  EXPECT_EQ(a.model.batch, b.model.batch);
  EXPECT_EQ(a.model.dropout, b.model.dropout);
  EXPECT_EQ(a.model.kv_heads, b.model.kv_heads);
  EXPECT_EQ(a.model.rope_theta, b.model.rope_theta);
  EXPECT_EQ(a.model.norm_eps, b.model.norm_eps);
  EXPECT_EQ(a.model.tie_embeddings, b.model.tie_embeddings);
  EXPECT_EQ(a.model.from, b.model.from);
  EXPECT_EQ(a.data.path, b.data.path);
  EXPECT_EQ(a.data.validation, b.data.validation);
  EXPECT_EQ(a.partition.layers_per_stage, b.partition.layers_per_stage);
  EXPECT_EQ(a.partition.memory_budget, b.partition.memory_budget);
  EXPECT_EQ(a.schedule.kind, b.schedule.kind);
  EXPECT_EQ(a.schedule.ranks, b.schedule.ranks);
  EXPECT_EQ(a.schedule.micro_batches, b.schedule.micro_batches);
  EXPECT_EQ(a.schedule.virtual_stages, b.schedule.virtual_stages);
  EXPECT_EQ(a.schedule.recompute, b.schedule.recompute);
  EXPECT_EQ(a.remat.policy, b.remat.policy);
  EXPECT_EQ(a.remat.early_stop, b.remat.early_stop);
  EXPECT_EQ(a.remat.custom.checkpoint, b.remat.custom.checkpoint);
  ASSERT_EQ(a.remat.custom.exclude.size(), b.remat.custom.exclude.size());
  for (size_t i = 0; i < a.remat.custom.exclude.size(); ++i) {
    EXPECT_EQ(a.remat.custom.exclude[i].path, b.remat.custom.exclude[i].path) << i;
    EXPECT_EQ(a.remat.custom.exclude[i].save_output, b.remat.custom.exclude[i].save_output) << i;
  }
  EXPECT_EQ(a.remat.custom.checkpoint_options.early_stop,
            b.remat.custom.checkpoint_options.early_stop);
  EXPECT_EQ(a.transport.kind, b.transport.kind);
  EXPECT_EQ(a.transport.timeout, b.transport.timeout);
  EXPECT_EQ(a.transport.master, b.transport.master);
  EXPECT_EQ(a.transport.connect_retries, b.transport.connect_retries);
  EXPECT_EQ(a.parallel.data, b.parallel.data);
  EXPECT_EQ(a.parallel.bucket_bytes, b.parallel.bucket_bytes);
  EXPECT_EQ(a.parallel.weight_tail, b.parallel.weight_tail);
  EXPECT_EQ(a.parallel.shard_optimizer, b.parallel.shard_optimizer);
  EXPECT_EQ(a.training.steps, b.training.steps);
  EXPECT_EQ(a.training.optimizer, b.training.optimizer);
  EXPECT_EQ(a.training.lr, b.training.lr);
  EXPECT_EQ(a.training.momentum, b.training.momentum);
  EXPECT_EQ(a.training.weight_decay, b.training.weight_decay);
  EXPECT_EQ(a.training.seed, b.training.seed);
  EXPECT_EQ(a.training.threads, b.training.threads);
  EXPECT_EQ(a.training.thread_probe, b.training.thread_probe);
  EXPECT_EQ(a.training.clip_grad_norm, b.training.clip_grad_norm);
  EXPECT_EQ(a.training.warmup, b.training.warmup);
  EXPECT_EQ(a.training.lr_decay, b.training.lr_decay);
  EXPECT_EQ(a.training.min_lr, b.training.min_lr);
  EXPECT_EQ(a.training.eval_every, b.training.eval_every);
  EXPECT_EQ(a.training.eval_batches, b.training.eval_batches);
  EXPECT_EQ(a.training.stop_after, b.training.stop_after);
  EXPECT_EQ(a.training.allow_non_finite, b.training.allow_non_finite);
  EXPECT_EQ(a.training.precision, b.training.precision);
  EXPECT_EQ(a.training.device, b.training.device);
  EXPECT_EQ(a.training.init_from, b.training.init_from);
  EXPECT_EQ(a.sample.tokens, b.sample.tokens);
  EXPECT_EQ(a.sample.prompt, b.sample.prompt);
  EXPECT_EQ(a.sample.temperature, b.sample.temperature);
  EXPECT_EQ(a.sample.top_k, b.sample.top_k);
  EXPECT_EQ(a.sample.seed, b.sample.seed);
  EXPECT_EQ(a.checkpoint.dir, b.checkpoint.dir);
  EXPECT_EQ(a.checkpoint.every, b.checkpoint.every);
  EXPECT_EQ(a.checkpoint.keep_last, b.checkpoint.keep_last);
  EXPECT_EQ(a.checkpoint.resume, b.checkpoint.resume);
  EXPECT_EQ(a.checkpoint.overwrite, b.checkpoint.overwrite);
  EXPECT_EQ(a.output.metrics, b.output.metrics);
  EXPECT_EQ(a.output.timeline_svg, b.output.timeline_svg);
  EXPECT_EQ(a.output.loss_svg, b.output.loss_svg);
  EXPECT_EQ(a.output.progress, b.output.progress);
}

// Every key set to a value other than its default.
const char* const kFullConfig = R"(# every key
model: {kind: gpt, layers: 6, hidden: 48, tokens: 16, heads: 3, ffn: 96, experts: 8, top_k: 3, seq_len: 64, batch: 3, dropout: 0.25, kv_heads: 1, rope_theta: 500000, norm_eps: 1e-06, tie_embeddings: true}
data: {path: "text.txt", validation: 0.1}
partition: {layers_per_stage: [1, 2, 3]}
schedule: {kind: zb-h2, ranks: 3, micro_batches: 6, virtual_stages: 2, recompute: lazy, csv: "s.csv"}
parallel: {data: 3, bucket_bytes: 4096, weight_tail: false, shard_optimizer: true}
remat:
  policy: custom
  early_stop: false
  checkpoint: ["layers.*", "head"]
  exclude:
    - {path: "layers.*.experts"}
    - {path: "layers.*.router", save_output: false}
transport: {kind: tcp, timeout: 2.5, master: "10.0.0.1:1234", connect_retries: 7}
training: {steps: 11, optimizer: adamw, lr: 0.003, momentum: 0.9, weight_decay: 0.1, clip_grad_norm: 1.5, seed: 18446744073709551615, threads: 3, thread_probe: false, warmup: 2, lr_decay: cosine, min_lr: 0.001, eval_every: 4, eval_batches: 3, stop_after: 7, precision: bf16, allow_non_finite: true}
checkpoint: {dir: "ck", every: 2, keep_last: 3, resume: latest}
sample: {tokens: 50, prompt: "Hi", temperature: 0.5, top_k: 10, seed: 9}
output: {metrics: "out/m.jsonl", timeline_svg: "t.svg", loss_svg: "l.svg", progress: false}
)";

TEST(ConfigParse, EmptyDocumentGivesTheDefaults) {
  expect_same(parse_config("", kSource), TrainConfig{});
  expect_same(parse_config("# only a comment\n", kSource), TrainConfig{});
  expect_same(parse_config("model:\nschedule: ~\n", kSource), TrainConfig{});
  expect_same(parse_config("model: {layers: ~}\noutput: {metrics: }\n", kSource), TrainConfig{});
}

TEST(ConfigParse, DefaultsAreThoseOfTheOptionsStructs) {
  const TrainConfig config = parse_config("", kSource);
  EXPECT_EQ(config.model.kind, models::ModelKind::kRmsNormGemm);
  EXPECT_EQ(config.model.layers, 8);
  EXPECT_EQ(config.model.hidden, 64);
  EXPECT_EQ(config.model.tokens, 32);
  EXPECT_EQ(config.model.heads, 4);
  EXPECT_EQ(config.model.ffn, 0);
  EXPECT_EQ(config.model.experts, 4);
  EXPECT_EQ(config.model.top_k, 2);
  EXPECT_TRUE(config.partition.layers_per_stage.empty());
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kOneFOneB);
  EXPECT_EQ(config.schedule.ranks, 1);
  EXPECT_EQ(config.schedule.micro_batches, 1);
  EXPECT_EQ(config.schedule.virtual_stages, 1);
  EXPECT_EQ(config.schedule.recompute, RecomputeMode::kNone);
  EXPECT_EQ(config.remat.policy, models::RematPolicyKind::kSelective);
  EXPECT_TRUE(config.remat.early_stop);
  EXPECT_TRUE(config.remat.custom.checkpoint.empty());
  EXPECT_TRUE(config.remat.custom.exclude.empty());
  EXPECT_EQ(config.transport.kind, comm::TransportKind::kAuto);
  EXPECT_EQ(config.transport.timeout, std::chrono::milliseconds(0));
  EXPECT_EQ(config.transport.master, "");
  EXPECT_EQ(config.transport.connect_retries, 40);
  EXPECT_EQ(config.training.steps, 5);
  EXPECT_EQ(config.training.optimizer, OptimizerKind::kSgd);
  EXPECT_EQ(config.training.lr, 0.01);
  EXPECT_EQ(config.training.momentum, 0.0);
  EXPECT_EQ(config.training.weight_decay, 0.0);
  EXPECT_EQ(config.training.seed, 0u);
  EXPECT_EQ(config.output.metrics, "");
  EXPECT_EQ(config.output.timeline_svg, "");
  EXPECT_TRUE(config.output.progress);
}

TEST(ConfigParse, EveryKeyIsRead) {
  const TrainConfig config = parse_config(kFullConfig, kSource);
  EXPECT_EQ(config.model.kind, models::ModelKind::kGpt);
  EXPECT_EQ(config.model.layers, 6);
  EXPECT_EQ(config.model.hidden, 48);
  EXPECT_EQ(config.model.tokens, 16);
  EXPECT_EQ(config.model.heads, 3);
  EXPECT_EQ(config.model.ffn, 96);
  EXPECT_EQ(config.model.experts, 8);
  EXPECT_EQ(config.model.top_k, 3);
  EXPECT_EQ(config.model.seq_len, 64);
  EXPECT_EQ(config.model.batch, 3);
  EXPECT_EQ(config.model.dropout, 0.25);
  EXPECT_EQ(config.model.kv_heads, 1);
  EXPECT_EQ(config.model.rope_theta, 500000.0);
  EXPECT_EQ(config.model.norm_eps, 1e-6);
  EXPECT_TRUE(config.model.tie_embeddings);
  EXPECT_EQ(config.data.path, "text.txt");
  EXPECT_EQ(config.data.validation, 0.1);
  EXPECT_EQ(config.partition.layers_per_stage, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kZeroBubbleH2);
  EXPECT_EQ(config.schedule.ranks, 3);
  EXPECT_EQ(config.schedule.micro_batches, 6);
  EXPECT_EQ(config.schedule.virtual_stages, 2);
  EXPECT_EQ(config.schedule.recompute, RecomputeMode::kLazy);
  EXPECT_EQ(config.schedule_csv, "s.csv");
  EXPECT_EQ(config.remat.policy, models::RematPolicyKind::kCustom);
  EXPECT_FALSE(config.remat.early_stop);
  EXPECT_FALSE(config.remat.custom.checkpoint_options.early_stop);
  EXPECT_EQ(config.remat.custom.checkpoint, (std::vector<std::string>{"layers.*", "head"}));
  ASSERT_EQ(config.remat.custom.exclude.size(), 2u);
  EXPECT_EQ(config.remat.custom.exclude[0].path, "layers.*.experts");
  EXPECT_TRUE(config.remat.custom.exclude[0].save_output);
  EXPECT_EQ(config.remat.custom.exclude[1].path, "layers.*.router");
  EXPECT_FALSE(config.remat.custom.exclude[1].save_output);
  EXPECT_EQ(config.transport.kind, comm::TransportKind::kTcp);
  EXPECT_EQ(config.transport.timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(config.transport.master, "10.0.0.1:1234");
  EXPECT_EQ(config.transport.connect_retries, 7);
  EXPECT_EQ(config.parallel.data, 3);
  EXPECT_EQ(config.parallel.bucket_bytes, 4096);
  EXPECT_FALSE(config.parallel.weight_tail);
  EXPECT_TRUE(config.parallel.shard_optimizer);
  EXPECT_EQ(config.training.steps, 11);
  EXPECT_EQ(config.training.optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(config.training.lr, 0.003);
  EXPECT_EQ(config.training.momentum, 0.9);
  EXPECT_EQ(config.training.clip_grad_norm, 1.5);
  EXPECT_EQ(config.training.threads, 3);
  EXPECT_FALSE(config.training.thread_probe);
  EXPECT_EQ(config.training.weight_decay, 0.1);
  EXPECT_EQ(config.training.seed, 18446744073709551615u);
  EXPECT_EQ(config.training.warmup, 2);
  EXPECT_EQ(config.training.lr_decay, LrDecay::kCosine);
  EXPECT_EQ(config.training.min_lr, 0.001);
  EXPECT_EQ(config.training.eval_every, 4);
  EXPECT_EQ(config.training.eval_batches, 3);
  EXPECT_EQ(config.training.stop_after, 7);
  EXPECT_TRUE(config.training.allow_non_finite);
  EXPECT_EQ(config.training.precision, pp::Precision::kBFloat16);
  EXPECT_EQ(config.checkpoint.dir, "ck");
  EXPECT_EQ(config.checkpoint.every, 2);
  EXPECT_EQ(config.checkpoint.keep_last, 3);
  EXPECT_EQ(config.checkpoint.resume, "latest");
  EXPECT_EQ(config.sample.tokens, 50);
  EXPECT_EQ(config.sample.prompt, "Hi");
  EXPECT_EQ(config.sample.temperature, 0.5);
  EXPECT_EQ(config.sample.top_k, 10);
  EXPECT_EQ(config.sample.seed, 9u);
  EXPECT_EQ(config.output.metrics, "out/m.jsonl");
  EXPECT_EQ(config.output.timeline_svg, "t.svg");
  EXPECT_EQ(config.output.loss_svg, "l.svg");
  EXPECT_FALSE(config.output.progress);
}

TEST(ConfigParse, EveryEnumSpellingIsAccepted) {
  const std::vector<std::pair<std::string, ScheduleKind>> kinds = {
      {"gpipe", ScheduleKind::kGPipe},
      {"1f1b", ScheduleKind::kOneFOneB},
      {"interleaved", ScheduleKind::kInterleaved},
      {"zb-h1", ScheduleKind::kZeroBubbleH1},
      {"zb-h2", ScheduleKind::kZeroBubbleH2},
      {"zb-v", ScheduleKind::kZeroBubbleV}};
  for (const auto& [text, kind] : kinds) {
    EXPECT_EQ(parse_config("schedule: {kind: " + text + "}", kSource).schedule.kind, kind) << text;
  }
  EXPECT_EQ(parse_config("schedule: {recompute: pretrigger}", kSource).schedule.recompute,
            RecomputeMode::kPretrigger);
  EXPECT_EQ(parse_config("transport: {kind: mpi}", kSource).transport.kind,
            comm::TransportKind::kMpi);
  EXPECT_EQ(parse_config("transport: {kind: local}", kSource).transport.kind,
            comm::TransportKind::kLocal);
  for (const char* kind :
       {"mlp", "rmsnorm-gemm", "transformer", "moe", "save-chain"}) {  // gpt: data
    EXPECT_STREQ(
        to_string(parse_config(std::string("model: {kind: ") + kind + "}", kSource).model.kind),
        kind);
  }
  for (const char* policy : {"none", "full", "selective"}) {
    EXPECT_STREQ(
        to_string(
            parse_config(std::string("remat: {policy: ") + policy + "}", kSource).remat.policy),
        policy);
  }
}

// The word choices of options.h: every value has one spelling, and parse_* inverts to_string.
template <typename Enum, typename Parse>
void expect_spellings(const std::vector<Enum>& values, Parse parse,
                      const std::vector<std::string>& names) {
  EXPECT_EQ(spellings(values), names);
  for (Enum value : values) EXPECT_TRUE(parse(to_string(value)) == value) << to_string(value);
  EXPECT_FALSE(parse("nope").has_value());
  EXPECT_FALSE(parse("").has_value());
}

TEST(ConfigParse, WordChoicesAndTheirSpellings) {
  expect_spellings(models::model_kind_values(), models::parse_model_kind,
                   {"gpt", "llama", "mlp", "rmsnorm-gemm", "transformer", "moe", "save-chain"});
  expect_spellings(models::remat_policy_values(), models::parse_remat_policy,
                   {"none", "full", "selective", "custom"});
  expect_spellings(optimizer_values(), parse_optimizer, {"sgd", "adamw"});
  expect_spellings(lr_decay_values(), parse_lr_decay, {"none", "cosine"});
}

TEST(ConfigParse, ScalarSpellings) {
  const TrainConfig config = parse_config(
      "output: {progress: False}\nremat: {early_stop: TRUE}\ntraining: {lr: 1e-3, seed: +7}\n"
      "transport: {timeout: 0.001}\n",
      kSource);
  EXPECT_FALSE(config.output.progress);
  EXPECT_TRUE(config.remat.early_stop);
  EXPECT_EQ(config.training.lr, 1e-3);
  EXPECT_EQ(config.training.seed, 7u);
  EXPECT_EQ(config.transport.timeout, std::chrono::milliseconds(1));
  // A quoted string is a string: free-form values may be quoted or not.
  EXPECT_EQ(parse_config("output: {metrics: 'a b.jsonl'}", kSource).output.metrics, "a b.jsonl");
  EXPECT_EQ(parse_config("model: {kind: \"moe\"}", kSource).model.kind, models::ModelKind::kMoe);
}

TEST(ConfigParse, ChecksWithinOneConfigPass) {
  // top_k only matters for moe, heads only for transformer.
  EXPECT_EQ(parse_config("model: {kind: mlp, experts: 1, top_k: 2}", kSource).model.top_k, 2);
  EXPECT_EQ(parse_config("model: {kind: moe, experts: 2, top_k: 2}", kSource).model.top_k, 2);
  EXPECT_EQ(parse_config("model: {kind: mlp, hidden: 10, heads: 3}", kSource).model.heads, 3);
  EXPECT_EQ(parse_config("model: {kind: transformer, hidden: 12, heads: 3}", kSource).model.heads,
            3);
  EXPECT_EQ(parse_config("model: {layers: 5}\npartition: {layers_per_stage: [2, 3]}", kSource)
                .partition.layers_per_stage,
            (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(parse_config("partition: {layers_per_stage: []}", kSource)
                  .partition.layers_per_stage.empty());
  // Empty lists are fine with any policy.
  EXPECT_EQ(
      parse_config("remat: {policy: none, checkpoint: [], exclude: []}", kSource).remat.policy,
      models::RematPolicyKind::kNone);
}

// ---- errors ------------------------------------------------------------------------------

TEST(ConfigErrors, MalformedYamlNamesLineColumnAndTheParserMessage) {
  EXPECT_EQ(error_of("model: {layers: 4\n"),
            "x.yaml:2:1: malformed YAML: end of map flow not found");
  EXPECT_EQ(error_of("model:\n  layers: 4\n bad: 1\n"),
            "x.yaml:3:2: malformed YAML: end of map not found");
  EXPECT_EQ(error_of("model:\n\tlayers: 4\n"), "x.yaml:2:8: malformed YAML: illegal map value");
}

TEST(ConfigErrors, DocumentShape) {
  EXPECT_EQ(error_of("hello\n"),
            "x.yaml:1: the document is 'hello', not a mapping; expected a mapping with keys "
            "model, data, partition, schedule, parallel, remat, transport, training, checkpoint, "
            "sample, output");
  EXPECT_EQ(error_of("model: {layers: 4}\n---\nmodel: {layers: 5}\n"),
            "x.yaml:3: a second YAML document starts here; expected the whole config in one "
            "document (remove the '---')");
  EXPECT_EQ(error_of("training: {steps: 2}\nmodel: 3\n"),
            "x.yaml:2: model: '3' is not a mapping; expected a mapping with keys kind, layers, "
            "hidden, tokens, heads, ffn, experts, top_k, seq_len, batch, vocab, dropout, kv_heads, "
            "rope_theta, norm_eps, tie_embeddings, from");
  EXPECT_EQ(error_of("schedule: [1f1b]\n"),
            "x.yaml:1: schedule: a list is not a mapping; expected a mapping with keys kind, "
            "ranks, micro_batches, virtual_stages, recompute, csv");
}

// remat.stages: a policy name per model stage; custom stages use remat.checkpoint / exclude.
TEST(ConfigRemat, StagesListOnePolicyPerStage) {
  const TrainConfig c = parse_config("remat: {stages: [selective, none, full]}\n", kSource);
  EXPECT_EQ(c.remat.stages, (std::vector<models::StageRemat>{
                                models::StageRemat::named(models::RematPolicyKind::kSelective),
                                models::StageRemat::named(models::RematPolicyKind::kNone),
                                models::StageRemat::named(models::RematPolicyKind::kFull)}));
  EXPECT_EQ(parse_config(config_to_yaml(c), kSource).remat.stages, c.remat.stages);
  EXPECT_EQ(error_of("remat: {stages: [selective, fast]}\n"),
            "x.yaml:1: remat.stages[1]: 'fast' is not allowed; allowed: none, full, selective, "
            "custom");
  EXPECT_EQ(error_of("remat: {stages: [none, custom]}\n"),
            "x.yaml:1: remat.stages: 'custom' needs at least one remat.checkpoint pattern, e.g. "
            "checkpoint: [\"layers.*\"]");
  EXPECT_EQ(parse_config("remat: {stages: [none, custom], checkpoint: [\"layers.*\"]}\n", kSource)
                .remat.custom.checkpoint,
            std::vector<std::string>{"layers.*"});
}

// remat.stages entries may be a stage's own lists (what `pipemat plan --out` writes).
TEST(ConfigRemat, StagesEntryMayBeTheStagesOwnLists) {
  const TrainConfig c = parse_config(
      "remat:\n"
      "  stages:\n"
      "    - {checkpoint: [layers.0, layers.2], exclude: [{path: layers.0.up}]}\n"
      "    - none\n",
      kSource);
  const std::vector<models::StageRemat> want{
      models::StageRemat::of({"layers.0", "layers.2"}, {{"layers.0.up", true}}),
      models::StageRemat::named(models::RematPolicyKind::kNone)};
  EXPECT_EQ(c.remat.stages, want);
  EXPECT_NE(want[0], models::StageRemat::of({"layers.0", "layers.2"}, {{"layers.0.up", false}}));
  const std::string yaml = config_to_yaml(c);
  EXPECT_NE(yaml.find("  stages:\n    - {checkpoint: [\"layers.0\", \"layers.2\"], exclude: "
                      "[{path: \"layers.0.up\", save_output: true}]}\n    - none\n"),
            std::string::npos)
      << yaml;
  EXPECT_EQ(parse_config(yaml, kSource).remat.stages, want);
  // A stage's own lists need no remat.policy: custom, and do not allow remat.checkpoint.
  EXPECT_EQ(error_of("remat: {stages: [{exclude: [{path: layers.0.up}]}]}\n"),
            "x.yaml:1: remat.stages[0]: a stage's own policy needs at least one checkpoint "
            "pattern, e.g. {checkpoint: [\"layers.0\"]}; write none for a stage without "
            "recompute");
  EXPECT_EQ(error_of("remat: {stages: [{checkpoint: [layers.0], save: [x]}]}\n"),
            "x.yaml:1: remat.stages[0].save: unknown key; allowed in remat.stages[0]: checkpoint, "
            "exclude");
  EXPECT_EQ(error_of("remat: {stages: [{checkpoint: [\"\"]}]}\n"),
            "x.yaml:1: remat.stages[0].checkpoint[0]: '' is empty; expected a module path "
            "pattern, e.g. \"layers.*.gemm\"");
  EXPECT_EQ(error_of("remat: {stages: [{checkpoint: [layers.0]}], checkpoint: [layers.*]}\n"),
            "x.yaml:1: remat.checkpoint: only allowed with remat.policy custom, but the policy "
            "is 'selective'; set remat.policy: custom or remove remat.checkpoint");
}

TEST(ConfigErrors, UnknownKeysAtEveryLevel) {
  EXPECT_EQ(error_of("modle: {layers: 4}\n"),
            "x.yaml:1: modle: unknown key; did you mean 'model'? allowed top-level keys: model, "
            "data, partition, schedule, parallel, remat, transport, training, checkpoint, sample, "
            "output");
  EXPECT_EQ(error_of("optimizer: sgd\n"),
            "x.yaml:1: optimizer: unknown key; did you mean 'training.optimizer'? allowed "
            "top-level keys: model, data, partition, schedule, parallel, remat, transport, "
            "training, checkpoint, sample, output");
  EXPECT_EQ(error_of("extra: 1\n"),
            "x.yaml:1: extra: unknown key; allowed top-level keys: model, data, partition, "
            "schedule, parallel, remat, transport, training, checkpoint, sample, output");
  EXPECT_EQ(
      error_of("model:\n  kind: mlp\n  layer: 4\n"),
      "x.yaml:3: model.layer: unknown key; did you mean 'model.layers'? allowed in model: "
      "kind, layers, hidden, tokens, heads, ffn, experts, top_k, seq_len, batch, vocab, dropout, "
      "kv_heads, rope_theta, norm_eps, tie_embeddings, from");
  EXPECT_EQ(error_of("model: {steps: 4}\n"),
            "x.yaml:1: model.steps: unknown key; did you mean 'training.steps'? allowed in "
            "model: kind, layers, hidden, tokens, heads, ffn, experts, top_k, seq_len, batch, "
            "vocab, dropout, kv_heads, rope_theta, norm_eps, tie_embeddings, from");
  EXPECT_EQ(error_of("parallel: {data: 2, shard_optimiser: true}\n"),
            "x.yaml:1: parallel.shard_optimiser: unknown key; did you mean "
            "'parallel.shard_optimizer'? allowed in parallel: data, bucket_bytes, weight_tail, "
            "shard_optimizer");
  EXPECT_EQ(error_of("schedule:\n  kind: 1f1b\n  micro_batch: 4\n"),
            "x.yaml:3: schedule.micro_batch: unknown key; did you mean 'schedule.micro_batches'? "
            "allowed in schedule: kind, ranks, micro_batches, virtual_stages, recompute, csv");
  EXPECT_EQ(
      error_of("training: {steps: 2, batch_size: 4}\n"),
      "x.yaml:1: training.batch_size: unknown key; allowed in training: steps, optimizer, "
      "lr, momentum, weight_decay, clip_grad_norm, seed, threads, thread_probe, warmup, lr_decay, "
      "min_lr, "
      "eval_every, eval_batches, stop_after, precision, allow_non_finite, device, init_from");
  EXPECT_EQ(error_of("remat:\n  policy: custom\n  checkpoint: [a]\n  exclude:\n"
                     "    - {path: a.b}\n    - {path: a.c, save_ouput: false}\n"),
            "x.yaml:6: remat.exclude[1].save_ouput: unknown key; did you mean "
            "'remat.exclude[1].save_output'? allowed in remat.exclude[1]: path, save_output");
  EXPECT_EQ(
      error_of("transport: {kind: tcp, rank: 0}\n"),
      "x.yaml:1: transport.rank: unknown key; allowed in transport: kind, lane, timeout, master, "
      "connect_retries");
}

TEST(ConfigErrors, RepeatedKey) {
  EXPECT_EQ(error_of("model:\n  layers: 4\n  hidden: 8\n  layers: 6\n"),
            "x.yaml:4: model.layers: given twice (first on line 2); keep one");
}

TEST(ConfigErrors, WrongTypes) {
  EXPECT_EQ(error_of("model:\n  layers: eight\n"),
            "x.yaml:2: model.layers: 'eight' is not an integer; expected an integer in [1, 4096]");
  EXPECT_EQ(error_of("model: {hidden: 6.5}\n"),
            "x.yaml:1: model.hidden: '6.5' is not an integer; expected an integer in [1, 65536]");
  EXPECT_EQ(
      error_of("model: {tokens: [32]}\n"),
      "x.yaml:1: model.tokens: a list is not an integer; expected an integer in [1, 1048576]");
  EXPECT_EQ(error_of("model: {layers: \"8\"}\n"),
            "x.yaml:1: model.layers: '8' is a quoted string, not an integer; drop the quotes");
  EXPECT_EQ(error_of("training:\n  lr: fast\n"),
            "x.yaml:2: training.lr: 'fast' is not a number; expected a number in (0, 1000000]");
  EXPECT_EQ(error_of("training:\n  lr: '0.1'\n"),
            "x.yaml:2: training.lr: '0.1' is a quoted string, not a number; drop the quotes");
  EXPECT_EQ(error_of("training: {lr: .nan}\n"),
            "x.yaml:1: training.lr: '.nan' is not a number; expected a number in (0, 1000000]");
  EXPECT_EQ(error_of("training: {seed: -1}\n"),
            "x.yaml:1: training.seed: '-1' is out of range; expected an integer >= 0");
  EXPECT_EQ(error_of("training: {seed: x1}\n"),
            "x.yaml:1: training.seed: 'x1' is not an integer; expected an integer >= 0");
  EXPECT_EQ(error_of("output:\n  progress: yes\n"),
            "x.yaml:2: output.progress: 'yes' is not a boolean; expected true or false");
  EXPECT_EQ(error_of("remat: {early_stop: \"true\"}\n"),
            "x.yaml:1: remat.early_stop: 'true' is not a boolean; expected true or false");
  EXPECT_EQ(error_of("remat:\n  policy: custom\n  checkpoint: [\"layers.*\"]\n  exclude:\n"
                     "    - {path: \"layers.*.up\", save_output: maybe}\n"),
            "x.yaml:5: remat.exclude[0].save_output: 'maybe' is not a boolean; expected true or "
            "false");
  EXPECT_EQ(error_of("partition: {layers_per_stage: 8}\n"),
            "x.yaml:1: partition.layers_per_stage: '8' is not a list; expected auto, or a list "
            "of layer counts, one per stage, e.g. [4, 4]");
  EXPECT_EQ(error_of("partition:\n  layers_per_stage:\n    - 4\n    - four\n"),
            "x.yaml:4: partition.layers_per_stage[1]: 'four' is not an integer; expected an "
            "integer >= 1");
  EXPECT_EQ(error_of("remat: {policy: custom, checkpoint: \"layers.*\"}\n"),
            "x.yaml:1: remat.checkpoint: 'layers.*' is not a list; expected a list of module "
            "path patterns, e.g. [\"layers.*\"]");
  EXPECT_EQ(error_of("remat: {policy: custom, checkpoint: [[a]]}\n"),
            "x.yaml:1: remat.checkpoint[0]: a list is not a string; expected a module path "
            "pattern, e.g. \"layers.*.gemm\"");
  EXPECT_EQ(error_of("remat: {policy: custom, checkpoint: [\"\"]}\n"),
            "x.yaml:1: remat.checkpoint[0]: '' is empty; expected a module path pattern, e.g. "
            "\"layers.*.gemm\"");
  EXPECT_EQ(error_of("remat: {policy: custom, checkpoint: [a], exclude: [a.b]}\n"),
            "x.yaml:1: remat.exclude[0]: 'a.b' is not a mapping; expected {path: PATTERN, "
            "save_output: BOOL}, e.g. {path: \"layers.*.gemm\"}");
  EXPECT_EQ(error_of("remat: {policy: custom, checkpoint: [a], exclude: [{save_output: true}]}\n"),
            "x.yaml:1: remat.exclude[0]: 'path' is missing; expected {path: PATTERN, "
            "save_output: BOOL}, e.g. {path: \"layers.*.gemm\"}");
  EXPECT_EQ(error_of("output: {metrics: {path: m.jsonl}}\n"),
            "x.yaml:1: output.metrics: a mapping is not a string; expected a file path (empty: "
            "no metrics file)");
  EXPECT_EQ(error_of("transport: {master: localhost}\n"),
            "x.yaml:1: transport.master: 'localhost' is not host:port; expected host:port with a "
            "port in [1, 65535], e.g. \"127.0.0.1:29500\" (empty: PIPEMAT_MASTER)");
  EXPECT_EQ(error_of("transport: {master: \"h:70000\"}\n"),
            "x.yaml:1: transport.master: 'h:70000' is not host:port; expected host:port with a "
            "port in [1, 65535], e.g. \"127.0.0.1:29500\" (empty: PIPEMAT_MASTER)");
}

TEST(ConfigErrors, OutOfRangeNumbers) {
  EXPECT_EQ(error_of("model:\n  layers: 0\n"),
            "x.yaml:2: model.layers: '0' is out of range; expected an integer in [1, 4096]");
  EXPECT_EQ(error_of("model: {hidden: -64}\n"),
            "x.yaml:1: model.hidden: '-64' is out of range; expected an integer in [1, 65536]");
  EXPECT_EQ(error_of("model: {tokens: 0}\n"),
            "x.yaml:1: model.tokens: '0' is out of range; expected an integer in [1, 1048576]");
  EXPECT_EQ(error_of("model: {heads: 0}\n"),
            "x.yaml:1: model.heads: '0' is out of range; expected an integer in [1, 65536]");
  EXPECT_EQ(error_of("model: {ffn: -1}\n"),
            "x.yaml:1: model.ffn: '-1' is out of range; expected an integer in [0, 65536]");
  EXPECT_EQ(error_of("model: {experts: 0}\n"),
            "x.yaml:1: model.experts: '0' is out of range; expected an integer in [1, 1024]");
  EXPECT_EQ(error_of("model: {top_k: 0}\n"),
            "x.yaml:1: model.top_k: '0' is out of range; expected an integer in [1, 1024]");
  EXPECT_EQ(error_of("model: {layers: 99999999999999999999}\n"),
            "x.yaml:1: model.layers: '99999999999999999999' is out of range; expected an "
            "integer in [1, 4096]");
  // Sizes that each fit but together would not: an error naming the key, before any tensor.
  EXPECT_EQ(error_of("model: {layers: 4096, hidden: 4096}\n"),
            "x.yaml:1: model.layers: the rmsnorm-gemm model of 4096 layers with hidden 4096 holds "
            "about 256.125 GiB of float32 weights, more than the limit of 16 GiB; lower "
            "model.layers, model.hidden or model.ffn");
  // A text model's embedding and head hold vocab x hidden each; its logits are tokens x vocab.
  EXPECT_EQ(error_of("model: {vocab: 255}\n"),
            "x.yaml:1: model.vocab: '255' is out of range; expected an integer in [256, 4194304]");
  EXPECT_EQ(error_of("data: {path: t.txt}\nmodel: {kind: gpt, hidden: 1024, vocab: 4194304}\n"),
            "x.yaml:2: model.vocab: the gpt model of 8 layers with hidden 1024 holds about "
            "32.37506103515625 GiB of float32 weights, more than the limit of 16 GiB; lower "
            "model.layers, "
            "model.hidden or model.ffn (or model.vocab)");
  EXPECT_EQ(error_of("data: {path: t.txt}\nmodel: {kind: gpt, hidden: 64, vocab: 2097152}\n"),
            "x.yaml:2: model.vocab: one activation of 1024 tokens x 2097152 is about 8 GiB, more "
            "than the limit of 4 GiB per micro-batch; lower model.batch or the model's width (or "
            "model.vocab)");
  EXPECT_EQ(error_of("model: {tokens: 1048576, hidden: 2048}\n"),
            "x.yaml:1: model.tokens: one activation of 1048576 tokens x 2048 is about 8 GiB, more "
            "than the limit of 4 GiB per micro-batch; lower model.tokens or the model's width");
  EXPECT_EQ(error_of("training: {lr: 1e300}\n"),
            "x.yaml:1: training.lr: '1e300' is out of range; expected a number in (0, 1000000]");
  EXPECT_EQ(error_of("schedule:\n  kind: 1f1b\n  ranks: 0\n"),
            "x.yaml:3: schedule.ranks: '0' is out of range; expected an integer in [1, "
            "2147483647]");
  // The deprecated name has the same checks; the error names the key as written.
  EXPECT_EQ(error_of("schedule: {stages: 2147483648}\n"),
            "x.yaml:1: schedule.stages: '2147483648' is out of range; expected an integer in [1, "
            "2147483647]");
  EXPECT_EQ(error_of("schedule: {micro_batches: 0}\n"),
            "x.yaml:1: schedule.micro_batches: '0' is out of range; expected an integer in [1, "
            "2147483647]");
  EXPECT_EQ(error_of("schedule: {virtual_stages: -2}\n"),
            "x.yaml:1: schedule.virtual_stages: '-2' is out of range; expected an integer in [1, "
            "2147483647]");
  EXPECT_EQ(error_of("training: {lr: 0}\n"),
            "x.yaml:1: training.lr: '0' is out of range; expected a number in (0, 1000000]");
  EXPECT_EQ(error_of("training: {lr: -0.1}\n"),
            "x.yaml:1: training.lr: '-0.1' is out of range; expected a number in (0, 1000000]");
  EXPECT_EQ(error_of("training: {steps: 0}\n"),
            "x.yaml:1: training.steps: '0' is out of range; expected an integer >= 1");
  EXPECT_EQ(error_of("training: {momentum: -0.5}\n"),
            "x.yaml:1: training.momentum: '-0.5' is out of range; expected a number >= 0");
  EXPECT_EQ(error_of("training: {weight_decay: -1}\n"),
            "x.yaml:1: training.weight_decay: '-1' is out of range; expected a number >= 0");
  EXPECT_EQ(error_of("training: {seed: 18446744073709551616}\n"),
            "x.yaml:1: training.seed: '18446744073709551616' is out of range; expected an "
            "integer in [0, 18446744073709551615]");
  EXPECT_EQ(error_of("transport:\n  timeout: -1\n"),
            "x.yaml:2: transport.timeout: '-1' is out of range; expected a number in [0, "
            "31536000]");
  EXPECT_EQ(error_of("transport: {timeout: 0.0001}\n"),
            "x.yaml:1: transport.timeout: '0.0001' is below the 1 ms resolution; expected 0 (the "
            "default) or at least 0.001 seconds");
  EXPECT_EQ(error_of("transport: {connect_retries: 0}\n"),
            "x.yaml:1: transport.connect_retries: '0' is out of range; expected an integer in "
            "[1, 2147483647]");
  EXPECT_EQ(error_of("partition: {layers_per_stage: [4, 0, 4]}\n"),
            "x.yaml:1: partition.layers_per_stage[1]: '0' is out of range; expected an integer "
            ">= 1");
}

TEST(ConfigErrors, UnknownEnumValuesListTheAllowedOnes) {
  EXPECT_EQ(error_of("# x\n\n\n\n\nschedule:\n  kind: zb-x\n"),
            "x.yaml:7: schedule.kind: 'zb-x' is not allowed; allowed: gpipe, 1f1b, interleaved, "
            "zb-h1, zb-h2, zb-v");
  EXPECT_EQ(error_of("schedule: {kind: imported}\n"),
            "x.yaml:1: schedule.kind: 'imported' is not allowed; allowed: gpipe, 1f1b, "
            "interleaved, zb-h1, zb-h2, zb-v");
  EXPECT_EQ(error_of("schedule: {recompute: eager}\n"),
            "x.yaml:1: schedule.recompute: 'eager' is not allowed; allowed: none, lazy, "
            "pretrigger");
  EXPECT_EQ(error_of("model: {kind: gpt2}\n"),
            "x.yaml:1: model.kind: 'gpt2' is not allowed; allowed: gpt, llama, mlp, rmsnorm-gemm, "
            "transformer, moe, save-chain");
  EXPECT_EQ(error_of("model: {kind: gpt}\n"),
            "x.yaml:1: model.kind: gpt trains on text and needs data.path, a text file or a "
            "directory of text files (e.g. /usr/share/games/fortunes)");
  EXPECT_EQ(error_of("sample: {tokens: 20}\n"),
            "x.yaml:1: sample.tokens: only for model.kind gpt or llama (the zoo's synthetic data "
            "has no text to sample or validate on)");
  EXPECT_EQ(error_of("model: {kind: gpt}\ndata: {path: t.txt}\nsample: {tokens: 20}\n"),
            "x.yaml:3: sample.tokens: the sample is drawn from the final checkpoint and needs "
            "checkpoint.dir");
  EXPECT_EQ(error_of("training: {lr: 0.01, min_lr: 0.1}\n"),
            "x.yaml:1: training.min_lr: min_lr 0.1 is larger than training.lr 0.01");
  EXPECT_EQ(error_of("training: {lr_decay: linear}\n"),
            "x.yaml:1: training.lr_decay: 'linear' is not allowed; allowed: none, cosine");
  EXPECT_EQ(error_of("model: {dropout: 1}\n"),
            "x.yaml:1: model.dropout: '1' is out of range; expected a number in [0, 0.9]");
  EXPECT_EQ(error_of("training: {optimizer: adam}\n"),
            "x.yaml:1: training.optimizer: 'adam' is not allowed; allowed: sgd, adamw");
  EXPECT_EQ(error_of("remat: {policy: [full]}\n"),
            "x.yaml:1: remat.policy: a list is not allowed; allowed: none, full, selective, "
            "custom");
  EXPECT_EQ(error_of("transport: {kind: nccl}\n"),
            "x.yaml:1: transport.kind: 'nccl' is not allowed; allowed: auto, mpi, tcp, local");
}

TEST(ConfigErrors, ChecksAcrossKeys) {
  EXPECT_EQ(error_of("model:\n  kind: moe\n  experts: 4\n  top_k: 5\n"),
            "x.yaml:4: model.top_k: top_k 5 is larger than experts 4; expected 1 <= model.top_k "
            "<= model.experts");
  // Located at the key that was given when the other one is a default.
  EXPECT_EQ(error_of("model:\n  kind: moe\n  experts: 1\n"),
            "x.yaml:3: model.experts: top_k 2 is larger than experts 1; expected 1 <= "
            "model.top_k <= model.experts");
  EXPECT_EQ(error_of("model: {kind: transformer, hidden: 64, heads: 5}\n"),
            "x.yaml:1: model.heads: hidden 64 is not divisible by heads 5; expected model.hidden "
            "% model.heads == 0");
  EXPECT_EQ(error_of("model: {layers: 8}\npartition:\n  layers_per_stage: [4, 3]\n"),
            "x.yaml:3: partition.layers_per_stage: the entries sum to 7 but model.layers is 8; "
            "give one entry per stage summing to 8, or no list for a balanced split");
  EXPECT_EQ(error_of("remat:\n  policy: selective\n  checkpoint: [\"layers.*\"]\n"),
            "x.yaml:3: remat.checkpoint: only allowed with remat.policy custom, but the policy is "
            "'selective'; set remat.policy: custom or remove remat.checkpoint");
  EXPECT_EQ(error_of("remat:\n  exclude:\n    - {path: \"layers.*.gemm\"}\n"),
            "x.yaml:3: remat.exclude: only allowed with remat.policy custom, but the policy is "
            "'selective'; set remat.policy: custom or remove remat.exclude");
  EXPECT_EQ(error_of("remat:\n  early_stop: true\n  policy: custom\n"),
            "x.yaml:3: remat.policy: 'custom' needs at least one remat.checkpoint pattern, e.g. "
            "checkpoint: [\"layers.*\"]");
}

// Issue 44, finding 9: a malformed glob is an error naming its key (it was read as a literal
// '[' that matched nothing, and the run had no checkpoint units).
TEST(ConfigErrors, MalformedRematPatternNamesItsKey) {
  EXPECT_EQ(error_of("remat: {policy: custom}\n", {"remat.checkpoint=['[']"}),
            "--set: remat.checkpoint[0]: '[' is not a module path pattern: component '[' opens a "
            "'[' set that it never closes (write '[[]' for a literal '['); expected e.g. "
            "\"layers.*.gemm\" (shell wildcards within a component)");
  EXPECT_EQ(error_of("remat:\n  policy: custom\n  checkpoint: [\"layers.*\"]\n  exclude:\n"
                     "    - {path: \"layers..gemm\"}\n"),
            "x.yaml:5: remat.exclude[0].path: 'layers..gemm' is not a module path pattern: it "
            "has an empty component (two dots, or a dot at an end); expected e.g. "
            "\"layers.*.gemm\" (shell wildcards within a component)");
}

// Issue 44, finding 10: the entries' sum overflowed and was reported as a negative number.
TEST(ConfigErrors, LayersPerStageSumThatOverflowsIsRefused) {
  EXPECT_EQ(error_of("model: {layers: 8}\npartition:\n  layers_per_stage: "
                     "[9223372036854775807, 1]\n"),
            "x.yaml:3: partition.layers_per_stage: the entries sum to more than 2^63 - 1; give "
            "one entry per stage summing to model.layers (8), or no list for a balanced split");
}

// Issue 44, finding 10: a check across keys names the key --set gave, not the file's line of
// another key of the same check.
TEST(ConfigErrors, ChecksAcrossKeysNameTheKeyThatSetGave) {
  const std::string error =
      error_of("model: {kind: rmsnorm-gemm, layers: 64}\n", {"model.hidden=65536"});
  EXPECT_EQ(error.rfind("--set: model.hidden: the rmsnorm-gemm model of 64 layers with hidden "
                        "65536 holds about ",
                        0),
            0u)
      << error;
  // Without --set the key given in the file is named, as before.
  EXPECT_EQ(error_of("model: {kind: rmsnorm-gemm, layers: 64, hidden: 65536}\n")
                .rfind("x.yaml:1: model.layers: the rmsnorm-gemm model of 64 layers", 0),
            0u);
}

// Issue 44, finding 10: resources refused before any thread starts, naming the key: libgomp
// ended the process ("Thread creation failed", no pipemat error line) and 1024 local ranks
// failed after 91 s.
TEST(ConfigErrors, ResourcesBeyondTheMachineAreRefusedNamingTheKey) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  EXPECT_EQ(error_of("training: {threads: 1024}\n"),
            "x.yaml:1: training.threads: 1024 compute threads per rank, but this machine has " +
                std::to_string(hardware) +
                " hardware threads; expected at most 4 per hardware "
                "thread (" +
                std::to_string(4 * hardware) +
                "), or 0 for the hardware threads divided by the ranks");
  EXPECT_EQ(error_of("", {"schedule.ranks=1024", "transport.kind=local"}),
            "--set: schedule.ranks: transport.kind local runs the 1024 ranks (schedule.ranks x "
            "parallel.data) as threads of one process; expected at most 64; run more ranks as "
            "processes (transport.kind tcp or mpi, pipemat-run -n)");
  EXPECT_EQ(error_of("schedule: {ranks: 1024}\n"), "(no error)");  // processes: not this check
}

TEST(ConfigErrors, TheFirstProblemInDocumentOrderIsReported) {
  EXPECT_EQ(error_of("training: {steps: 0}\nmodel: {layers: 0}\n"),
            "x.yaml:1: training.steps: '0' is out of range; expected an integer >= 1");
}

TEST(ConfigErrors, ErrorsAreConfigErrors) {
  EXPECT_THROW(parse_config("model: {layers: 0}", kSource), ConfigError);
  EXPECT_THROW(parse_config("[", kSource), ConfigError);
  EXPECT_THROW(parse_config("", kSource, {"x"}), ConfigError);
}

// ---- overrides ---------------------------------------------------------------------------

TEST(ConfigOverrides, ApplyOnTopOfTheDocument) {
  const std::string yaml = "model: {layers: 8, hidden: 64}\nschedule: {kind: 1f1b, ranks: 2}\n";
  const TrainConfig config = parse_config(
      yaml, kSource,
      {"schedule.kind=zb-v", "model.layers=4", "training.lr=0.5", "output.metrics=out/m.jsonl",
       "transport.timeout=1.5", "transport.master=127.0.0.1:29500", "remat.early_stop=false"});
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kZeroBubbleV);
  EXPECT_EQ(config.schedule.ranks, 2);
  EXPECT_EQ(config.model.layers, 4);
  EXPECT_EQ(config.model.hidden, 64);
  EXPECT_EQ(config.training.lr, 0.5);
  EXPECT_EQ(config.output.metrics, "out/m.jsonl");
  EXPECT_EQ(config.transport.timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(config.transport.master, "127.0.0.1:29500");
  EXPECT_FALSE(config.remat.early_stop);
}

TEST(ConfigOverrides, ListsAndMappingsInFlowStyle) {
  const TrainConfig config = parse_config(
      "model: {layers: 8}\n", kSource,
      {"partition.layers_per_stage=[2,6]", "remat.policy=custom", "remat.checkpoint=[layers.*]",
       "remat.exclude=[{path: layers.*.gemm}, {path: layers.*.up, save_output: false}]"});
  EXPECT_EQ(config.partition.layers_per_stage, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(config.remat.custom.checkpoint, (std::vector<std::string>{"layers.*"}));
  ASSERT_EQ(config.remat.custom.exclude.size(), 2u);
  EXPECT_EQ(config.remat.custom.exclude[0].path, "layers.*.gemm");
  EXPECT_TRUE(config.remat.custom.exclude[0].save_output);
  EXPECT_EQ(config.remat.custom.exclude[1].path, "layers.*.up");
  EXPECT_FALSE(config.remat.custom.exclude[1].save_output);
}

TEST(ConfigOverrides, CreateMissingSectionsAndTheLastOneWins) {
  const TrainConfig config = parse_config(
      "model:\n", kSource, {"model.layers=3", "training.steps=9", " model.layers = 6"});
  EXPECT_EQ(config.model.layers, 6);
  EXPECT_EQ(config.training.steps, 9);
  // An empty value is null: the default.
  EXPECT_EQ(parse_config("model: {kind: moe}", kSource, {"model.kind="}).model.kind,
            models::ModelKind::kRmsNormGemm);
}

TEST(ConfigOverrides, EveryLeafKeyCanBeSet) {
  for (const std::string& key : config_keys()) {
    if (key.find("[]") != std::string::npos) continue;
    EXPECT_NO_THROW(parse_config("", kSource, {key + "="})) << key;
  }
}

TEST(ConfigOverrides, Errors) {
  EXPECT_EQ(error_of("", {"model.layers"}),
            "--set: 'model.layers' is not key.path=value; expected e.g. --set "
            "schedule.kind=zb-v");
  EXPECT_EQ(error_of("", {"=4"}),
            "--set: '=4' is not key.path=value; expected e.g. --set schedule.kind=zb-v");
  EXPECT_EQ(error_of("", {"model.layer=4"}),
            "--set: model.layer: unknown key; did you mean 'model.layers'?");
  EXPECT_EQ(error_of("", {"model.steps=4"}),
            "--set: model.steps: unknown key; did you mean 'training.steps'?");
  EXPECT_EQ(error_of("", {"remat.exclude[0].path=a"}),
            "--set: remat.exclude[0].path: list entries cannot be set one by one; set the whole "
            "list, e.g. --set remat.exclude=[{path: layers.*.gemm}]");
  const std::string all_keys =
      "model.kind, model.layers, model.hidden, model.tokens, model.heads, model.ffn, "
      "model.experts, model.top_k, model.seq_len, model.batch, model.vocab, model.dropout, "
      "model.kv_heads, "
      "model.rope_theta, model.norm_eps, model.tie_embeddings, model.from, data.path, "
      "data.validation, data.format, data.tokenizer, partition.layers_per_stage, "
      "partition.memory_budget, schedule.kind, "
      "schedule.ranks, "
      "schedule.micro_batches, schedule.virtual_stages, schedule.recompute, schedule.csv, "
      "parallel.data, parallel.bucket_bytes, parallel.weight_tail, parallel.shard_optimizer, "
      "remat.policy, "
      "remat.early_stop, remat.checkpoint, remat.exclude, remat.stages, transport.kind, "
      "transport.lane, transport.timeout, "
      "transport.master, transport.connect_retries, training.steps, training.optimizer, "
      "training.lr, training.momentum, training.weight_decay, training.clip_grad_norm, "
      "training.seed, training.threads, training.thread_probe, training.warmup, training.lr_decay, "
      "training.min_lr, "
      "training.eval_every, training.eval_batches, training.stop_after, training.precision, "
      "training.allow_non_finite, "
      "training.device, training.init_from, "
      "checkpoint.dir, "
      "checkpoint.every, "
      "checkpoint.keep_last, checkpoint.resume, checkpoint.overwrite, sample.tokens, "
      "sample.prompt, "
      "sample.temperature, sample.top_k, sample.seed, output.metrics, "
      "output.timeline_svg, output.trace, output.loss_svg, output.progress, output.reference_steps";
  EXPECT_EQ(error_of("", {"model={layers: 4}"}), "--set: model: unknown key; allowed: " + all_keys);
  EXPECT_EQ(error_of("", {"partition.layers_per_stage=[2,6"}),
            "--set: partition.layers_per_stage: '[2,6' is not a YAML value (end of sequence flow "
            "not found); expected a scalar or a flow list/mapping, e.g. [2, 6]");
  // Bad values that came from an override are located as --set.
  EXPECT_EQ(error_of("schedule:\n  kind: 1f1b\n", {"schedule.kind=zb-x"}),
            "--set: schedule.kind: 'zb-x' is not allowed; allowed: gpipe, 1f1b, interleaved, "
            "zb-h1, zb-h2, zb-v");
  EXPECT_EQ(error_of("", {"remat.policy=custom", "remat.checkpoint=[a]",
                          "remat.exclude=[{path: a.b, save_output: maybe}]"}),
            "--set: remat.exclude[0].save_output: 'maybe' is not a boolean; expected true or "
            "false");
  EXPECT_EQ(error_of("", {"model.layers=[4]"}),
            "--set: model.layers: a list is not an integer; expected an integer in [1, 4096]");
  // A check across keys is located at the key it names.
  EXPECT_EQ(
      error_of("model: {layers: 8}\npartition: {layers_per_stage: [4, 4]}\n", {"model.layers=9"}),
      "x.yaml:2: partition.layers_per_stage: the entries sum to 8 but model.layers is 9; "
      "give one entry per stage summing to 9, or no list for a balanced split");
  // A section that is not a mapping is reported at its line, not hidden by the override.
  EXPECT_EQ(error_of("model: 3\n", {"model.layers=4"}),
            "x.yaml:1: model: '3' is not a mapping; expected a mapping with keys kind, layers, "
            "hidden, tokens, heads, ffn, experts, top_k, seq_len, batch, vocab, dropout, kv_heads, "
            "rope_theta, norm_eps, tie_embeddings, from");
}

// ---- deprecated keys (Note [Deprecated keys]) -------------------------------------------

TEST(ConfigDeprecated, ScheduleStagesReadsAsRanksWithAWarning) {
  const TrainConfig config = parse_config("schedule:\n  kind: 1f1b\n  stages: 3\n", kSource);
  EXPECT_EQ(config.schedule.ranks, 3);
  EXPECT_EQ(config.warnings,
            (std::vector<std::string>{"x.yaml:3: schedule.stages: deprecated name of "
                                      "schedule.ranks; write schedule.ranks instead"}));
  // Given as null it is still the old name.
  EXPECT_EQ(parse_config("schedule: {stages: ~}\n", kSource).warnings.size(), 1u);
  const TrainConfig current = parse_config("schedule: {ranks: 3}\n", kSource);
  EXPECT_EQ(current.schedule.ranks, 3);
  EXPECT_TRUE(current.warnings.empty());
  EXPECT_TRUE(parse_config("", kSource).warnings.empty());
  // The effective config holds the new name only.
  const std::string echoed = config_to_yaml(config);
  EXPECT_NE(echoed.find("\n  ranks: 3\n"), std::string::npos) << echoed;
  EXPECT_EQ(echoed.find("\n  stages:"), echoed.rfind("\n  stages: []"));  // remat.stages only
}

TEST(ConfigDeprecated, BothNamesAreAnErrorNamingBoth) {
  EXPECT_EQ(error_of("schedule:\n  stages: 2\n  ranks: 2\n"),
            "x.yaml:3: schedule.ranks: given together with schedule.stages (line 2); "
            "schedule.stages is the deprecated name of schedule.ranks: keep only schedule.ranks");
  EXPECT_EQ(error_of("schedule: {ranks: 2, stages: ~}\n"),
            "x.yaml:1: schedule.stages: given together with schedule.ranks (line 1); "
            "schedule.stages is the deprecated name of schedule.ranks: keep only schedule.ranks");
}

TEST(ConfigDeprecated, OverridesUnderEitherName) {
  const TrainConfig old_name = parse_config("", kSource, {"schedule.stages=4"});
  EXPECT_EQ(old_name.schedule.ranks, 4);
  EXPECT_EQ(old_name.warnings,
            (std::vector<std::string>{"--set: schedule.stages: deprecated name of schedule.ranks; "
                                      "write schedule.ranks instead"}));
  // An override replaces the document's value under either name: no conflict.
  const TrainConfig new_over_old =
      parse_config("schedule: {stages: 2}\n", kSource, {"schedule.ranks=4"});
  EXPECT_EQ(new_over_old.schedule.ranks, 4);
  EXPECT_TRUE(new_over_old.warnings.empty());
  const TrainConfig old_over_new =
      parse_config("schedule: {ranks: 2}\n", kSource, {"schedule.stages=4"});
  EXPECT_EQ(old_over_new.schedule.ranks, 4);
  EXPECT_EQ(old_over_new.warnings.size(), 1u);
  EXPECT_EQ(error_of("", {"schedule.stages=0"}),
            "--set: schedule.stages: '0' is out of range; expected an integer in [1, "
            "2147483647]");
}

TEST(ConfigDeprecated, TyposNearTheOldNameSuggestTheNewOne) {
  EXPECT_EQ(error_of("schedule:\n  kind: 1f1b\n  stagez: 2\n"),
            "x.yaml:3: schedule.stagez: unknown key; did you mean 'schedule.ranks' (formerly "
            "'schedule.stages')? allowed in schedule: kind, ranks, micro_batches, "
            "virtual_stages, recompute, csv");
  EXPECT_EQ(error_of("", {"schedule.stagez=2"}),
            "--set: schedule.stagez: unknown key; did you mean 'schedule.ranks' (formerly "
            "'schedule.stages')?");
}

// ---- round trip --------------------------------------------------------------------------

TEST(ConfigRoundTrip, DefaultsAsYaml) {
  EXPECT_EQ(config_to_yaml(TrainConfig{}),
            "model:\n"
            "  kind: rmsnorm-gemm\n"
            "  layers: 8\n"
            "  hidden: 64\n"
            "  tokens: 32\n"
            "  heads: 4\n"
            "  ffn: 0\n"
            "  experts: 4\n"
            "  top_k: 2\n"
            "  seq_len: 128\n"
            "  batch: 8\n"
            "  vocab: 256\n"
            "  dropout: 0\n"
            "  kv_heads: 0\n"
            "  rope_theta: 10000\n"
            "  norm_eps: 1e-05\n"
            "  tie_embeddings: false\n"
            "  from: \"\"\n"
            "data:\n"
            "  path: \"\"\n"
            "  validation: 0.05\n"
            "  format: text\n"
            "  tokenizer: \"\"\n"
            "partition:\n"
            "  layers_per_stage: []\n"
            "  memory_budget: []\n"
            "schedule:\n"
            "  kind: 1f1b\n"
            "  ranks: 1\n"
            "  micro_batches: 1\n"
            "  virtual_stages: 1\n"
            "  recompute: none\n"
            "  csv: \"\"\n"
            "parallel:\n"
            "  data: 1\n"
            "  bucket_bytes: 26214400\n"
            "  weight_tail: true\n"
            "  shard_optimizer: false\n"
            "remat:\n"
            "  policy: selective\n"
            "  early_stop: true\n"
            "  checkpoint: []\n"
            "  exclude: []\n"
            "  stages: []\n"
            "transport:\n"
            "  kind: auto\n"
            "  lane: none\n"
            "  timeout: 0\n"
            "  master: \"\"\n"
            "  connect_retries: 40\n"
            "training:\n"
            "  steps: 5\n"
            "  optimizer: sgd\n"
            "  lr: 0.01\n"
            "  momentum: 0\n"
            "  weight_decay: 0\n"
            "  clip_grad_norm: 0\n"
            "  seed: 0\n"
            "  threads: 0\n"
            "  thread_probe: true\n"
            "  warmup: 0\n"
            "  lr_decay: none\n"
            "  min_lr: 0\n"
            "  eval_every: 0\n"
            "  eval_batches: 8\n"
            "  stop_after: 0\n"
            "  precision: fp32\n"
            "  allow_non_finite: false\n"
            "  device: \"cpu\"\n"
            "  init_from: \"\"\n"
            "checkpoint:\n"
            "  dir: \"\"\n"
            "  every: 0\n"
            "  keep_last: 0\n"
            "  resume: \"\"\n"
            "  overwrite: false\n"
            "sample:\n"
            "  tokens: 0\n"
            "  prompt: \"\\n\"\n"
            "  temperature: 0.8\n"
            "  top_k: 40\n"
            "  seed: 0\n"
            "output:\n"
            "  metrics: \"\"\n"
            "  timeline_svg: \"\"\n"
            "  trace: \"\"\n"
            "  loss_svg: \"\"\n"
            "  progress: true\n"
            "  reference_steps: 0\n");
}

TEST(ConfigRoundTrip, ParseOfTheYamlGivesTheSameConfig) {
  for (const std::string& yaml : {std::string(), std::string(kFullConfig)}) {
    const TrainConfig config = parse_config(yaml, kSource);
    const std::string echoed = config_to_yaml(config);
    expect_same(parse_config(echoed, "echo"), config);
    EXPECT_EQ(config_to_yaml(parse_config(echoed, "echo")), echoed);
  }
}

TEST(ConfigRoundTrip, AwkwardValues) {
  TrainConfig config;
  config.training.lr = 0.1 + 0.2;  // needs 17 digits
  config.training.momentum = 1e-300;
  config.transport.timeout = std::chrono::milliseconds(1);
  config.output.metrics = "a: b # c\n\"d\"";
  config.output.timeline_svg = "true";
  config.remat.policy = models::RematPolicyKind::kCustom;
  config.remat.custom.checkpoint = {"*", "[ab]?.**"};
  config.remat.custom.exclude = {{"x.y", false}, {"- z", true}};
  config.remat.custom.checkpoint_options.early_stop = config.remat.early_stop;
  expect_same(parse_config(config_to_yaml(config), "echo"), config);
}

// ---- shipped configs ---------------------------------------------------------------------

std::filesystem::path configs_dir() {
  return std::filesystem::path(PIPEMAT_SOURCE_DIR) / "configs";
}

TEST(ConfigFiles, EveryShippedConfigParsesAndStartsWithAComment) {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(configs_dir())) {
    if (entry.path().extension() != ".yaml") continue;
    names.insert(entry.path().filename().string());
    EXPECT_NO_THROW(load_config(entry.path().string())) << entry.path();
    std::ifstream in(entry.path());
    std::string first_line;
    std::getline(in, first_line);
    EXPECT_EQ(first_line.rfind("# ", 0), 0u) << entry.path() << ": " << first_line;
  }
  EXPECT_EQ(names,
            (std::set<std::string>{"default.yaml", "zoo.yaml", "gpipe.yaml", "1f1b.yaml",
                                   "interleaved.yaml", "zb-h1.yaml", "zb-h2.yaml", "zb-v.yaml",
                                   "zb-v-4rank.yaml", "bench.yaml", "plan-transformer.yaml",
                                   "plan-gpt.yaml", "dp-pp.yaml", "llama.yaml", "llama-bpe.yaml"}));
}

TEST(ConfigFiles, EveryShippedScheduleBuilds) {
  // The runtime's schedule checks (M vs P, virtual stages) pass for every shipped config, and an
  // explicit partition has one entry per model stage.
  for (const auto& entry : std::filesystem::directory_iterator(configs_dir())) {
    if (entry.path().extension() != ".yaml") continue;
    const TrainConfig config = load_config(entry.path().string());
    schedule::Schedule built;
    EXPECT_NO_THROW(built = schedule::build_schedule(config.schedule)) << entry.path();
    if (!config.partition.layers_per_stage.empty()) {
      EXPECT_EQ(static_cast<int>(config.partition.layers_per_stage.size()), built.stages_count)
          << entry.path();
    }
    EXPECT_GE(config.model.layers, built.stages_count) << entry.path();
  }
}

TEST(ConfigFiles, DefaultIsTheGptMainJob) {
  const TrainConfig config = load_config((configs_dir() / "default.yaml").string());
  EXPECT_EQ(config.model.kind, models::ModelKind::kGpt);
  EXPECT_EQ(config.data.path, "/usr/share/games/fortunes");
  EXPECT_EQ(config.model.dropout, 0.05);
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kZeroBubbleH1);  // split backward
  EXPECT_EQ(config.schedule.ranks, 2);
  EXPECT_EQ(config.schedule.recompute, RecomputeMode::kPretrigger);
  EXPECT_EQ(config.remat.policy, models::RematPolicyKind::kSelective);
  EXPECT_EQ(config.training.optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(config.training.lr_decay, LrDecay::kCosine);
  EXPECT_EQ(config.training.eval_every, 100);
  EXPECT_EQ(config.sample.tokens, 200);
  EXPECT_FALSE(config.checkpoint.dir.empty());
}

TEST(ConfigFiles, ZooIsTheTwoStageSyntheticRun) {
  const TrainConfig config = load_config((configs_dir() / "zoo.yaml").string());
  EXPECT_EQ(config.model.kind, models::ModelKind::kRmsNormGemm);
  EXPECT_EQ(config.model.layers, 8);
  EXPECT_EQ(config.model.hidden, 64);
  EXPECT_EQ(config.model.tokens, 32);
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kOneFOneB);
  EXPECT_EQ(config.schedule.ranks, 2);
  EXPECT_EQ(config.schedule.micro_batches, 4);
  EXPECT_EQ(config.schedule.virtual_stages, 1);
  EXPECT_EQ(config.schedule.recompute, RecomputeMode::kPretrigger);
  EXPECT_EQ(config.remat.policy, models::RematPolicyKind::kSelective);
  EXPECT_EQ(config.transport.kind, comm::TransportKind::kAuto);
  EXPECT_EQ(config.training.steps, 5);
  EXPECT_EQ(config.training.optimizer, OptimizerKind::kSgd);
  EXPECT_EQ(config.training.lr, 0.05);
}

TEST(ConfigFiles, OneConfigPerScheduleKind) {
  const std::vector<std::pair<std::string, ScheduleKind>> files = {
      {"gpipe", ScheduleKind::kGPipe},
      {"1f1b", ScheduleKind::kOneFOneB},
      {"interleaved", ScheduleKind::kInterleaved},
      {"zb-h1", ScheduleKind::kZeroBubbleH1},
      {"zb-h2", ScheduleKind::kZeroBubbleH2},
      {"zb-v", ScheduleKind::kZeroBubbleV}};
  for (const auto& [name, kind] : files) {
    const TrainConfig config = load_config((configs_dir() / (name + ".yaml")).string());
    EXPECT_EQ(config.schedule.kind, kind) << name;
    EXPECT_EQ(config.schedule.ranks, 2) << name;
    EXPECT_EQ(config.schedule.virtual_stages, name == "interleaved" ? 2 : 1) << name;
  }
}

TEST(ConfigFiles, ZbV4RankUsesACustomPolicy) {
  const TrainConfig config = load_config((configs_dir() / "zb-v-4rank.yaml").string());
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kZeroBubbleV);
  EXPECT_EQ(config.schedule.ranks, 4);
  EXPECT_EQ(config.model.kind, models::ModelKind::kTransformer);
  EXPECT_EQ(config.remat.policy, models::RematPolicyKind::kCustom);
  EXPECT_EQ(config.remat.custom.checkpoint, (std::vector<std::string>{"layers.*"}));
  ASSERT_FALSE(config.remat.custom.exclude.empty());
  EXPECT_EQ(config.remat.custom.exclude[0].path, "layers.*.attn.qkv");
}

TEST(ConfigFiles, OverridesApplyToFiles) {
  const TrainConfig config =
      load_config((configs_dir() / "default.yaml").string(), {"schedule.kind=zb-h1"});
  EXPECT_EQ(config.schedule.kind, ScheduleKind::kZeroBubbleH1);
}

TEST(ConfigFiles, ErrorsNameThePath) {
  const std::string missing = (configs_dir() / "no-such.yaml").string();
  try {
    load_config(missing);
    FAIL() << "no error";
  } catch (const ConfigError& error) {
    EXPECT_EQ(std::string(error.what()),
              "config: cannot open '" + missing +
                  "' (No such file or directory); expected a readable regular file");
  }
  try {
    load_config(configs_dir().string());
    FAIL() << "no error";
  } catch (const ConfigError& error) {
    EXPECT_EQ(std::string(error.what()),
              "config: '" + configs_dir().string() +
                  "' is a directory; expected a regular file (copy the data into a file and give "
                  "its path)");
  }
  const std::filesystem::path bad =
      std::filesystem::temp_directory_path() /
      ("pipemat_config_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
       ".yaml");
  {
    std::ofstream out(bad);
    out << "# bad\nschedule:\n  kind: zb-x\n";
  }
  try {
    load_config(bad.string());
    FAIL() << "no error";
  } catch (const ConfigError& error) {
    EXPECT_EQ(std::string(error.what()),
              bad.string() +
                  ":3: schedule.kind: 'zb-x' is not allowed; allowed: gpipe, 1f1b, "
                  "interleaved, zb-h1, zb-h2, zb-v");
  }
  std::filesystem::remove(bad);
}

// ---- keys and docs -----------------------------------------------------------------------

TEST(ConfigKeys, EveryKeyInDocumentOrder) {
  EXPECT_EQ(config_keys(), (std::vector<std::string>{"model.kind",
                                                     "model.layers",
                                                     "model.hidden",
                                                     "model.tokens",
                                                     "model.heads",
                                                     "model.ffn",
                                                     "model.experts",
                                                     "model.top_k",
                                                     "model.seq_len",
                                                     "model.batch",
                                                     "model.vocab",
                                                     "model.dropout",
                                                     "model.kv_heads",
                                                     "model.rope_theta",
                                                     "model.norm_eps",
                                                     "model.tie_embeddings",
                                                     "model.from",
                                                     "data.path",
                                                     "data.validation",
                                                     "data.format",
                                                     "data.tokenizer",
                                                     "partition.layers_per_stage",
                                                     "partition.memory_budget",
                                                     "schedule.kind",
                                                     "schedule.ranks",
                                                     "schedule.micro_batches",
                                                     "schedule.virtual_stages",
                                                     "schedule.recompute",
                                                     "schedule.csv",
                                                     "parallel.data",
                                                     "parallel.bucket_bytes",
                                                     "parallel.weight_tail",
                                                     "parallel.shard_optimizer",
                                                     "remat.policy",
                                                     "remat.early_stop",
                                                     "remat.checkpoint",
                                                     "remat.exclude",
                                                     "remat.exclude[].path",
                                                     "remat.exclude[].save_output",
                                                     "remat.stages",
                                                     "remat.stages[].checkpoint",
                                                     "remat.stages[].exclude",
                                                     "transport.kind",
                                                     "transport.lane",
                                                     "transport.timeout",
                                                     "transport.master",
                                                     "transport.connect_retries",
                                                     "training.steps",
                                                     "training.optimizer",
                                                     "training.lr",
                                                     "training.momentum",
                                                     "training.weight_decay",
                                                     "training.clip_grad_norm",
                                                     "training.seed",
                                                     "training.threads",
                                                     "training.thread_probe",
                                                     "training.warmup",
                                                     "training.lr_decay",
                                                     "training.min_lr",
                                                     "training.eval_every",
                                                     "training.eval_batches",
                                                     "training.stop_after",
                                                     "training.precision",
                                                     "training.allow_non_finite",
                                                     "training.device",
                                                     "training.init_from",
                                                     "checkpoint.dir",
                                                     "checkpoint.every",
                                                     "checkpoint.keep_last",
                                                     "checkpoint.resume",
                                                     "checkpoint.overwrite",
                                                     "sample.tokens",
                                                     "sample.prompt",
                                                     "sample.temperature",
                                                     "sample.top_k",
                                                     "sample.seed",
                                                     "output.metrics",
                                                     "output.timeline_svg",
                                                     "output.trace",
                                                     "output.loss_svg",
                                                     "output.progress",
                                                     "output.reference_steps"}));
}

TEST(ConfigKeys, EveryKeyIsDocumented) {
  std::ifstream in(std::filesystem::path(PIPEMAT_SOURCE_DIR) / "docs" / "config.md");
  ASSERT_TRUE(in.is_open());
  std::stringstream text;
  text << in.rdbuf();
  for (const std::string& key : config_keys()) {
    EXPECT_NE(text.str().find("`" + key + "`"), std::string::npos) << key;
  }
}

// docs/config.md holds the reference row of every key, as the field table has it (type, the
// default config_to_yaml writes, allowed values, meaning), in the table's order. A failure
// prints the row to paste.
TEST(ConfigKeys, EveryKeysRowIsInTheDocsInOrder) {
  std::ifstream in(std::filesystem::path(PIPEMAT_SOURCE_DIR) / "docs" / "config.md");
  ASSERT_TRUE(in.is_open());
  std::vector<std::string> rows;  // the lines of the key tables
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `", 0) == 0) rows.push_back(line);
  }
  const std::vector<ConfigKeyDoc> docs = config_key_docs();
  ASSERT_EQ(docs.size(), config_keys().size());
  for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(docs[i].key, config_keys()[i]);
  std::vector<std::string> want;
  for (const ConfigKeyDoc& doc : docs) want.push_back(doc.row());
  std::vector<std::string> found;  // the rows of config keys, in document order
  for (const std::string& row : rows) {
    for (const ConfigKeyDoc& doc : docs) {
      if (row.rfind("| `" + doc.key + "` |", 0) == 0) found.push_back(row);
    }
  }
  ASSERT_EQ(found.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(found[i], want[i]) << docs[i].key;
}

// `pipemat config --keys` prints config_key_tables(): each section's heading and its whole table
// (header, rule, rows in key order) stand in docs/config.md as printed.
TEST(ConfigKeys, TheDocsHoldEveryGeneratedTable) {
  std::ifstream in(std::filesystem::path(PIPEMAT_SOURCE_DIR) / "docs" / "config.md");
  ASSERT_TRUE(in.is_open());
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string tables = config_key_tables();
  size_t sections = 0;
  for (size_t at = tables.find("### "); at != std::string::npos; ++sections) {
    const size_t next = tables.find("### ", at + 1);
    const std::string block = tables.substr(at, next == std::string::npos ? next : next - at);
    const std::string heading = block.substr(0, block.find('\n') + 1);
    const std::string table = block.substr(block.find("| key |"));
    EXPECT_NE(doc.str().find(heading), std::string::npos) << heading;
    EXPECT_NE(doc.str().find(table), std::string::npos) << "docs/config.md lacks:\n" << table;
    at = next;
  }
  EXPECT_EQ(sections, 11u);  // model data partition schedule parallel remat transport training
                             // checkpoint sample output
}

TEST(ConfigKeys, RowsOfTheFieldTable) {
  const std::vector<ConfigKeyDoc> docs = config_key_docs();
  ASSERT_FALSE(docs.empty());
  EXPECT_EQ(docs[1].row(),
            "| `model.layers` | integer | `8` | >= 1 | number of layers (gpt, llama: decoder "
            "blocks) |");
  for (const ConfigKeyDoc& doc : docs) {
    EXPECT_FALSE(doc.type.empty()) << doc.key;
    EXPECT_FALSE(doc.default_value.empty()) << doc.key;
    EXPECT_FALSE(doc.meaning.empty()) << doc.key;
  }
}

}  // namespace
}  // namespace pipemat::train
