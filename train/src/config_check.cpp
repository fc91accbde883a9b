// The checks between keys of one config, after every value passed its own check. World size and
// schedule checks belong to the runtime (pp, the schedule generators).

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "config_reader.h"

namespace pipemat::train::config_detail {
namespace {

// Upper bounds of the float32 weights of the whole model and of one layer's widest activation per
// micro-batch: with the per-key limits of config_fields.cpp they keep every model the zoo builds
// inside this kind of machine.
constexpr double kMaxWeightBytes = 16.0 * (1LL << 30);
constexpr double kMaxActivationBytes = 4.0 * (1LL << 30);
// training.threads per hardware thread of the machine that reads the config.
constexpr int64_t kThreadsPerHardwareThread = 4;
// Ranks as threads of one process (transport.kind local): each holds its stages, a transport and
// its compute threads.
constexpr int64_t kMaxLocalRanks = 64;

// The keys of a llama that depend on one another (llama.h): grouped-query heads, the rotary
// embedding's pairs, no dropout.
void check_llama_keys(const TrainConfig& config, const ConfigReader& reader) {
  const models::ModelOptions& model = config.model;
  const int64_t kv_heads = model.kv_heads > 0 ? model.kv_heads : model.heads;
  if (model.heads % kv_heads != 0) {
    reader.fail_at(reader.blame({"model.kv_heads", "model.heads"}),
                   "heads " + std::to_string(model.heads) + " is not a multiple of kv_heads " +
                       std::to_string(kv_heads) +
                       "; expected model.heads % model.kv_heads == 0 (every key/value head "
                       "serves an equal group of query heads)");
  }
  if (model.hidden % model.heads == 0 && (model.hidden / model.heads) % 2 != 0) {
    reader.fail_at(
        reader.blame({"model.heads", "model.hidden"}),
        "the head size model.hidden / model.heads = " + std::to_string(model.hidden / model.heads) +
            " is odd; the rotary embedding rotates pairs of a head's features");
  }
  if (model.dropout != 0.0) {
    reader.fail_at("model.dropout", "llama has no dropout; expected 0");
  }
}

// Keys that need or exclude one another; each failure names the key to change.
void check_key_pairs(const TrainConfig& config, const ConfigReader& reader) {
  const models::ModelOptions& model = config.model;
  if (model.kind == models::ModelKind::kMoe && model.top_k > model.experts) {
    reader.fail_at(reader.blame({"model.top_k", "model.experts"}),
                   "top_k " + std::to_string(model.top_k) + " is larger than experts " +
                       std::to_string(model.experts) +
                       "; expected 1 <= model.top_k <= model.experts");
  }
  const CheckpointOptions& checkpoint = config.checkpoint;
  if (checkpoint.dir.empty() && (checkpoint.every > 0 || checkpoint.resume == "latest")) {
    reader.fail_at(
        checkpoint.every > 0 ? "checkpoint.every" : "checkpoint.resume",
        "needs checkpoint.dir, the directory the checkpoints are written to / read from");
  }
  const bool text = models::is_text_model(model.kind);
  if (text && config.data.path.empty()) {
    reader.fail_at("model.kind", std::string(to_string(model.kind)) +
                                     " trains on text and needs data.path, a text file or a "
                                     "directory of text files (e.g. /usr/share/games/fortunes)");
  }
  if (text && config.sample.tokens > 0 && config.checkpoint.dir.empty()) {
    reader.fail_at("sample.tokens",
                   "the sample is drawn from the final checkpoint and needs "
                   "checkpoint.dir");
  }
  if (!text && (config.sample.tokens > 0 || config.training.eval_every > 0)) {
    reader.fail_at(
        config.sample.tokens > 0 ? "sample.tokens" : "training.eval_every",
        "only for model.kind gpt or llama (the zoo's synthetic data has no text to sample or "
        "validate on)");
  }
  if (config.training.min_lr > config.training.lr) {
    reader.fail_at("training.min_lr", "min_lr " + format_number(config.training.min_lr) +
                                          " is larger than training.lr " +
                                          format_number(config.training.lr));
  }
  if ((model.kind == models::ModelKind::kTransformer || text) && model.hidden % model.heads != 0) {
    reader.fail_at(reader.blame({"model.heads", "model.hidden"}),
                   "hidden " + std::to_string(model.hidden) + " is not divisible by heads " +
                       std::to_string(model.heads) + "; expected model.hidden % model.heads == 0");
  }
  if (model.kind == models::ModelKind::kLlama) check_llama_keys(config, reader);
}

// Weights (float32) of the whole model and one layer's widest activation per micro-batch.
void check_model_size(const models::ModelOptions& model, const ConfigReader& reader) {
  const double h = static_cast<double>(model.hidden);
  const double f = static_cast<double>(model.ffn > 0 ? model.ffn : 4 * model.hidden);
  double per_layer = h * h + 2 * h;  // rmsnorm-gemm, save-chain (upper bound)
  if (model.kind == models::ModelKind::kMlp) per_layer = 2 * h * f + h;
  if (model.kind == models::ModelKind::kTransformer || model.kind == models::ModelKind::kGpt)
    per_layer = 4 * h * h + 2 * h * f + 2 * h;
  if (model.kind == models::ModelKind::kLlama) per_layer = 4 * h * h + 3 * h * f + 2 * h;
  if (model.kind == models::ModelKind::kMoe)
    per_layer = static_cast<double>(model.experts) * (h * h + h) + 2 * h;
  const bool text = models::is_text_model(model.kind);
  // gpt, llama: the embedding and the head, vocab x hidden each.
  const double vocab_rows = text ? 2.0 * static_cast<double>(model.vocab) * h : 0.0;
  const double weights = 4.0 * (per_layer * static_cast<double>(model.layers) + vocab_rows);
  if (weights > kMaxWeightBytes) {
    reader.fail_at(
        reader.blame(text ? std::vector<std::string>{"model.vocab", "model.layers", "model.hidden",
                                                     "model.ffn"}
                          : std::vector<std::string>{"model.layers", "model.hidden", "model.ffn"}),
        "the " + std::string(to_string(model.kind)) + " model of " + std::to_string(model.layers) +
            " layers with hidden " + std::to_string(model.hidden) + " holds about " +
            format_number(weights / (1LL << 30)) + " GiB of float32 weights, more than the " +
            "limit of " + format_number(kMaxWeightBytes / (1LL << 30)) +
            " GiB; lower model.layers, model.hidden or model.ffn" +
            (text ? std::string(" (or model.vocab)") : std::string()));
  }
  const double width =
      std::max(
          h, model.kind == models::ModelKind::kTransformer || model.kind == models::ModelKind::kMlp
                 ? f
                 : h) *
      (model.kind == models::ModelKind::kMoe ? static_cast<double>(model.top_k) : 1.0);
  const double widest = text ? std::max(width, static_cast<double>(model.vocab)) : width;
  const double tokens = models::is_text_model(model.kind)
                            ? static_cast<double>(model.batch * model.seq_len)
                            : static_cast<double>(model.tokens);
  const double activation = 4.0 * tokens * widest;  // text: the logits, tokens x vocab
  if (activation > kMaxActivationBytes) {
    const char* key = models::is_text_model(model.kind) ? "model.batch" : "model.tokens";
    reader.fail_at(
        reader.blame(text
                         ? std::vector<std::string>{"model.vocab", key, "model.hidden", "model.ffn"}
                         : std::vector<std::string>{key, "model.hidden", "model.ffn"}),
        "one activation of " + format_number(tokens) + " tokens x " + format_number(widest) +
            " is about " + format_number(activation / (1LL << 30)) +
            " GiB, more than the limit of " + format_number(kMaxActivationBytes / (1LL << 30)) +
            " GiB per micro-batch; lower " + key + " or the model's width" +
            (text ? std::string(" (or model.vocab)") : std::string()));
  }
}

void check_layers_per_stage(const TrainConfig& config, const ConfigReader& reader) {
  const models::ModelOptions& model = config.model;
  const std::vector<int64_t>& per_stage = config.partition.layers_per_stage;
  if (config.partition.by_cost) {  // Note [Split by cost]
    if (!config.schedule_csv.empty()) {
      reader.fail_at("partition.layers_per_stage",
                     "auto splits for a generated schedule (schedule.kind), not schedule.csv; "
                     "give the layer counts of the imported schedule's stages");
    }
    if (config.remat.policy == models::RematPolicyKind::kCustom || !config.remat.stages.empty()) {
      reader.fail_at("partition.layers_per_stage",
                     "auto profiles the layers under remat.policy none, full or selective; with "
                     "remat.policy custom or remat.stages give the layer counts by hand (pipemat "
                     "plan proposes a split and the remat policy together)");
    }
  }
  const std::vector<int64_t>& budget = config.partition.memory_budget;
  if (!budget.empty() && !config.partition.by_cost) {
    reader.fail_at("partition.memory_budget",
                   "a budget for the split partition.layers_per_stage auto chooses, but "
                   "layers_per_stage is not auto; set it to auto, or remove the budget (pipemat "
                   "plan --memory-budget fits the remat policy of a given split to a budget)");
  }
  if (budget.size() > 1 && budget.size() != static_cast<size_t>(config.schedule.ranks)) {
    reader.fail_at("partition.memory_budget",
                   std::to_string(budget.size()) + " sizes for " +
                       std::to_string(config.schedule.ranks) +
                       " ranks (schedule.ranks); give one for every rank or one per rank");
  }
  if (!per_stage.empty()) {
    int64_t sum = 0;
    for (int64_t entry : per_stage) {
      if (__builtin_add_overflow(sum, entry, &sum)) {
        reader.fail_at("partition.layers_per_stage",
                       "the entries sum to more than 2^63 - 1; give one entry per stage summing "
                       "to model.layers (" +
                           std::to_string(model.layers) + "), or no list for a balanced split");
      }
    }
    if (sum != model.layers) {
      reader.fail_at("partition.layers_per_stage",
                     "the entries sum to " + std::to_string(sum) + " but model.layers is " +
                         std::to_string(model.layers) + "; give one entry per stage summing to " +
                         std::to_string(model.layers) + ", or no list for a balanced split");
    }
  }
}

// Resources a run asks of this machine, refused before any thread starts: compute threads far
// beyond the hardware's (libgomp ends the process when it cannot create them) and ranks as
// threads of one process beyond kMaxLocalRanks.
void check_resources(const TrainConfig& config, const ConfigReader& reader) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  if (config.training.threads > kThreadsPerHardwareThread * hardware) {
    reader.fail_at("training.threads",
                   std::to_string(config.training.threads) + " compute threads per rank, but " +
                       "this machine has " + std::to_string(hardware) +
                       " hardware threads; expected at most " +
                       std::to_string(kThreadsPerHardwareThread) + " per hardware thread (" +
                       std::to_string(kThreadsPerHardwareThread * hardware) +
                       "), or 0 for the hardware threads divided by the ranks");
  }
  const int64_t world = config.schedule.ranks * config.parallel.data;
  if (config.transport.kind == comm::TransportKind::kLocal && world > kMaxLocalRanks) {
    reader.fail_at(reader.blame({"schedule.ranks", "parallel.data"}),
                   "transport.kind local runs the " + std::to_string(world) +
                       " ranks (schedule.ranks x parallel.data) as threads of one process; "
                       "expected at most " +
                       std::to_string(kMaxLocalRanks) +
                       "; run more ranks as processes (transport.kind tcp or mpi, pipemat-run -n)");
  }
}

void check_remat_lists(const models::RematConfig& remat, const ConfigReader& reader) {
  // A stage named `custom` uses remat.checkpoint / exclude; a stage's own lists do not.
  const bool custom_stage =
      std::any_of(remat.stages.begin(), remat.stages.end(), [](const models::StageRemat& stage) {
        return stage.policy == models::RematPolicyKind::kCustom && !stage.own;
      });
  if (remat.policy != models::RematPolicyKind::kCustom && !custom_stage) {
    for (const char* key : {"remat.checkpoint", "remat.exclude"}) {
      const bool is_set = std::string(key) == "remat.checkpoint" ? !remat.custom.checkpoint.empty()
                                                                 : !remat.custom.exclude.empty();
      if (is_set) {
        reader.fail_at(
            key, std::string("only allowed with remat.policy custom, but the policy is '") +
                     to_string(remat.policy) + "'; set remat.policy: custom or remove " + key);
      }
    }
  } else if (remat.custom.checkpoint.empty()) {
    reader.fail_at(custom_stage ? "remat.stages" : "remat.policy",
                   "'custom' needs at least one remat.checkpoint pattern, e.g. checkpoint: "
                   "[\"layers.*\"]");
  }
}

}  // namespace

void check_consistency(const TrainConfig& config, const ConfigReader& reader) {
  check_key_pairs(config, reader);
  check_model_size(config.model, reader);
  check_layers_per_stage(config, reader);
  check_resources(config, reader);
  check_remat_lists(config.remat, reader);
}

}  // namespace pipemat::train::config_detail
