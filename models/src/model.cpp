// Spellings of the model's word-valued choices (model.h), and StageRemat's construction and
// equality.

#include "pipemat/models/model.h"

#include <algorithm>
#include <utility>

#include "pipemat/core/spelled.h"

namespace pipemat::models {
namespace {

const Spelled<ModelKind>& model_kinds() {
  static const Spelled<ModelKind> kTable = {{ModelKind::kGpt, "gpt"},
                                            {ModelKind::kLlama, "llama"},
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

}  // namespace

const char* to_string(ModelKind kind) { return spelling_of(model_kinds(), kind); }
const char* to_string(RematPolicyKind policy) { return spelling_of(remat_policies(), policy); }

std::optional<ModelKind> parse_model_kind(const std::string& text) {
  return value_of(model_kinds(), text);
}
std::optional<RematPolicyKind> parse_remat_policy(const std::string& text) {
  return value_of(remat_policies(), text);
}

const std::vector<ModelKind>& model_kind_values() {
  static const std::vector<ModelKind> kValues = values_of(model_kinds());
  return kValues;
}
const std::vector<RematPolicyKind>& remat_policy_values() {
  static const std::vector<RematPolicyKind> kValues = values_of(remat_policies());
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
