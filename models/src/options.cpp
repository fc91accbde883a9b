// Spellings of the word-valued choices of options.h, and StageRemat's construction and equality.

#include "pipemat/models/options.h"

#include <algorithm>
#include <utility>

namespace pipemat::models {
namespace {

// One table per enum: every value with its spelling, in the order of *_values().
template <typename Enum>
using Spelled = std::vector<std::pair<Enum, const char*>>;

const Spelled<ModelKind>& model_kinds() {
  static const Spelled<ModelKind> kTable = {{ModelKind::kGpt, "gpt"},
                                            {ModelKind::kMlp, "mlp"},
                                            {ModelKind::kRmsNormGemm, "rmsnorm-gemm"},
                                            {ModelKind::kTransformer, "transformer"},
                                            {ModelKind::kMoe, "moe"},
                                            {ModelKind::kSaveChain, "save-chain"}};
  return kTable;
}

const Spelled<RematPolicyKind>& remat_policies() {
  static const Spelled<RematPolicyKind> kTable = {{RematPolicyKind::kNone, "none"},
                                                  {RematPolicyKind::kFull, "full"},
                                                  {RematPolicyKind::kSelective, "selective"},
                                                  {RematPolicyKind::kCustom, "custom"}};
  return kTable;
}

const Spelled<OptimizerKind>& optimizers() {
  static const Spelled<OptimizerKind> kTable = {{OptimizerKind::kSgd, "sgd"},
                                                {OptimizerKind::kAdamW, "adamw"}};
  return kTable;
}

const Spelled<LrDecay>& lr_decays() {
  static const Spelled<LrDecay> kTable = {{LrDecay::kNone, "none"}, {LrDecay::kCosine, "cosine"}};
  return kTable;
}

template <typename Enum>
const char* spelling_of(const Spelled<Enum>& table, Enum value) {
  for (const auto& [entry, name] : table) {
    if (entry == value) return name;
  }
  return "?";  // not a value of the enum (a cast of an arbitrary integer)
}

template <typename Enum>
std::optional<Enum> value_of(const Spelled<Enum>& table, const std::string& text) {
  for (const auto& [entry, name] : table) {
    if (text == name) return entry;
  }
  return std::nullopt;
}

template <typename Enum>
std::vector<Enum> values_of(const Spelled<Enum>& table) {
  std::vector<Enum> values;
  for (const auto& entry : table) values.push_back(entry.first);
  return values;
}

}  // namespace

const char* to_string(ModelKind kind) { return spelling_of(model_kinds(), kind); }
const char* to_string(RematPolicyKind policy) { return spelling_of(remat_policies(), policy); }
const char* to_string(OptimizerKind optimizer) { return spelling_of(optimizers(), optimizer); }
const char* to_string(LrDecay decay) { return spelling_of(lr_decays(), decay); }

std::optional<ModelKind> parse_model_kind(const std::string& text) {
  return value_of(model_kinds(), text);
}
std::optional<RematPolicyKind> parse_remat_policy(const std::string& text) {
  return value_of(remat_policies(), text);
}
std::optional<OptimizerKind> parse_optimizer(const std::string& text) {
  return value_of(optimizers(), text);
}
std::optional<LrDecay> parse_lr_decay(const std::string& text) {
  return value_of(lr_decays(), text);
}

const std::vector<ModelKind>& model_kind_values() {
  static const std::vector<ModelKind> kValues = values_of(model_kinds());
  return kValues;
}
const std::vector<RematPolicyKind>& remat_policy_values() {
  static const std::vector<RematPolicyKind> kValues = values_of(remat_policies());
  return kValues;
}
const std::vector<OptimizerKind>& optimizer_values() {
  static const std::vector<OptimizerKind> kValues = values_of(optimizers());
  return kValues;
}
const std::vector<LrDecay>& lr_decay_values() {
  static const std::vector<LrDecay> kValues = values_of(lr_decays());
  return kValues;
}

StageRemat StageRemat::of(std::vector<std::string> checkpoint,
                          std::vector<remat::ExcludeRule> exclude) {
  StageRemat entry{RematPolicyKind::kCustom, true, {}};
  entry.lists.checkpoint = std::move(checkpoint);
  entry.lists.exclude = std::move(exclude);
  return entry;
}

bool operator==(const StageRemat& a, const StageRemat& b) {
  if (a.policy != b.policy || a.own != b.own) return false;
  if (!a.own) return true;
  const auto same_rule = [](const remat::ExcludeRule& x, const remat::ExcludeRule& y) {
    return x.path == y.path && x.save_output == y.save_output;
  };
  return a.lists.checkpoint == b.lists.checkpoint &&
         std::equal(a.lists.exclude.begin(), a.lists.exclude.end(), b.lists.exclude.begin(),
                    b.lists.exclude.end(), same_rule);
}

}  // namespace pipemat::models
