// Spellings of the training options' word-valued choices (options.h).

#include "pipemat/train/options.h"

#include "pipemat/core/spelled.h"

namespace pipemat::train {
namespace {

const Spelled<OptimizerKind>& optimizers() {
  static const Spelled<OptimizerKind> kTable = {{OptimizerKind::kSgd, "sgd"},
                                                {OptimizerKind::kAdamW, "adamw"}};
  return kTable;
}

const Spelled<LrDecay>& lr_decays() {
  static const Spelled<LrDecay> kTable = {{LrDecay::kNone, "none"}, {LrDecay::kCosine, "cosine"}};
  return kTable;
}

const Spelled<DataFormat>& data_formats() {
  static const Spelled<DataFormat> kTable = {{DataFormat::kText, "text"},
                                             {DataFormat::kIndexed, "indexed"}};
  return kTable;
}

}  // namespace

const char* to_string(DataFormat format) { return spelling_of(data_formats(), format); }
const std::vector<DataFormat>& data_format_values() {
  static const std::vector<DataFormat> kValues = values_of(data_formats());
  return kValues;
}

const char* to_string(OptimizerKind optimizer) { return spelling_of(optimizers(), optimizer); }
const char* to_string(LrDecay decay) { return spelling_of(lr_decays(), decay); }

std::optional<OptimizerKind> parse_optimizer(const std::string& text) {
  return value_of(optimizers(), text);
}
std::optional<LrDecay> parse_lr_decay(const std::string& text) {
  return value_of(lr_decays(), text);
}

const std::vector<OptimizerKind>& optimizer_values() {
  static const std::vector<OptimizerKind> kValues = values_of(optimizers());
  return kValues;
}
const std::vector<LrDecay>& lr_decay_values() {
  static const std::vector<LrDecay> kValues = values_of(lr_decays());
  return kValues;
}

const std::vector<pp::Precision>& precision_values() {
  static const std::vector<pp::Precision> kValues = {pp::Precision::kFloat32,
                                                     pp::Precision::kBFloat16};
  return kValues;
}

}  // namespace pipemat::train
