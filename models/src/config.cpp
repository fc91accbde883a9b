#include "pipemat/models/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/parse.h"

namespace pipemat::models {
namespace {

using Names = std::vector<std::string>;

constexpr const char* kOverrideSource = "--set";

// Upper bounds of sizes: a typo must be a config error naming the key, never a crash in the
// allocator. Together with kMaxWeightBytes / kMaxActivationBytes (check_consistency) they keep
// every model the zoo builds inside this kind of machine.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxWidth = 65536;  // hidden, ffn, heads
constexpr int64_t kMaxTokens = 1 << 20;
constexpr int64_t kMaxExperts = 1024;
constexpr double kMaxRate = 1e6;  // learning rate (float32 optimizers overflow far above)
constexpr double kMaxWeightBytes = 16.0 * (1LL << 30);
constexpr double kMaxActivationBytes = 4.0 * (1LL << 30);

// The accepted keys, section by section, in document order. The readers below handle exactly
// these names (an unhandled one trips an internal assert in the tests' full-config parse).
struct Section {
  std::string name;
  Names keys;
};

bool contains(const Names& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

const std::vector<Section>& schema() {
  static const std::vector<Section> kSchema = {
      {"model",
       {"kind", "layers", "hidden", "tokens", "heads", "ffn", "experts", "top_k", "seq_len",
        "batch", "dropout"}},
      {"data", {"path", "validation"}},
      {"partition", {"layers_per_stage"}},
      {"schedule", {"kind", "stages", "micro_batches", "virtual_stages", "recompute", "csv"}},
      {"remat", {"policy", "early_stop", "checkpoint", "exclude", "stages"}},
      {"transport", {"kind", "timeout", "master", "connect_retries"}},
      {"training",
       {"steps", "optimizer", "lr", "momentum", "weight_decay", "clip_grad_norm", "seed", "threads",
        "warmup", "lr_decay", "min_lr", "eval_every", "eval_batches", "stop_after"}},
      {"checkpoint", {"dir", "every", "keep_last", "resume"}},
      {"sample", {"tokens", "prompt", "temperature", "top_k", "seed"}},
      {"output", {"metrics", "timeline_svg", "loss_svg", "progress"}},
  };
  return kSchema;
}

const Names& exclude_keys() {
  static const Names kKeys = {"path", "save_output"};
  return kKeys;
}

const Names& section_names() {
  static const Names kNames = [] {
    Names names;
    for (const Section& section : schema()) names.push_back(section.name);
    return names;
  }();
  return kNames;
}

const Names& section_keys(const std::string& section) {
  for (const Section& s : schema()) {
    if (s.name == section) return s.keys;
  }
  PIPEMAT_INTERNAL_ASSERT(false, "no config section '", section, "'");
}

// "training.steps" for "steps" when `path` is not "training": a key given in the wrong section.
std::string key_in_other_section(const std::string& name, const std::string& path) {
  for (const Section& section : schema()) {
    if (section.name != path && contains(section.keys, name)) return section.name + "." + name;
  }
  return "";
}

// Keys that `--set` accepts: every leaf key of a section (lists are set whole).
Names overridable_keys() {
  Names keys;
  for (const Section& section : schema()) {
    for (const std::string& key : section.keys) keys.push_back(section.name + "." + key);
  }
  return keys;
}

const Names& model_kinds() {
  static const Names kNames = {"gpt", "mlp", "rmsnorm-gemm", "transformer", "moe", "save-chain"};
  return kNames;
}
const Names& lr_decays() {
  static const Names kNames = {"none", "cosine"};
  return kNames;
}
const Names& remat_policies() {
  static const Names kNames = {"none", "full", "selective", "custom"};
  return kNames;
}
const Names& optimizers() {
  static const Names kNames = {"sgd", "adamw"};
  return kNames;
}

// Enum spellings come from the modules that own the enums, so a rename there shows up here.
const std::vector<schedule::ScheduleKind>& schedule_kinds() {
  // kImported is read from a torch CSV, not configurable by name.
  static const std::vector<schedule::ScheduleKind> kKinds = {
      schedule::ScheduleKind::kGPipe,        schedule::ScheduleKind::kOneFOneB,
      schedule::ScheduleKind::kInterleaved,  schedule::ScheduleKind::kZeroBubbleH1,
      schedule::ScheduleKind::kZeroBubbleH2, schedule::ScheduleKind::kZeroBubbleV,
  };
  return kKinds;
}
const std::vector<schedule::RecomputeMode>& recompute_modes() {
  static const std::vector<schedule::RecomputeMode> kModes = {schedule::RecomputeMode::kNone,
                                                              schedule::RecomputeMode::kLazy,
                                                              schedule::RecomputeMode::kPretrigger};
  return kModes;
}
const std::vector<comm::TransportKind>& transport_kinds() {
  static const std::vector<comm::TransportKind> kKinds = {
      comm::TransportKind::kAuto, comm::TransportKind::kMpi, comm::TransportKind::kTcp,
      comm::TransportKind::kLocal};
  return kKinds;
}

template <typename Enum>
Names spellings(const std::vector<Enum>& values) {
  Names names;
  for (Enum value : values) names.emplace_back(to_string(value));
  return names;
}

// Edits (insert, delete, substitute, swap two neighbours) that turn `a` into `b`: the optimal
// string alignment distance, so the common typo "modle" is one edit from "model".
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The candidate closest to `name` when it is close enough to be a typo (at most one edit per
// three characters, at least one), else "".
std::string closest(const std::string& name, const Names& candidates) {
  const size_t limit = std::max<size_t>(1, name.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const std::string& candidate : candidates) {
    const size_t distance = edit_distance(name, candidate);
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

// "model.layers" from "model" and "layers"; "model" from "" and "model" (the document level).
std::string child_key(const std::string& path, const std::string& name) {
  if (path.empty()) return name;
  std::string key = path;
  key += '.';
  key += name;
  return key;
}

std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  const auto last = text.find_last_not_of(" \t");
  return text.substr(first, last - first + 1);
}

// How a value shows up in messages: scalars quoted as written, collections by their kind.
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return "'" + node.Scalar() + "'";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

// A quoted scalar ("8", '8') is a string in YAML even when it spells a number.
bool is_quoted(const YAML::Node& node) { return node.Tag() == "!"; }

bool parse_double(const std::string& text, double* value) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  const double parsed = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(parsed)) return false;
  *value = parsed;
  return true;
}

// The shortest decimal text that reads back as exactly `value`; whole numbers without exponent.
std::string format_number(double value) {
  char buffer[40];
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
    return buffer;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  return buffer;
}

std::string int_range_text(int64_t min, int64_t max) {
  if (max == std::numeric_limits<int64_t>::max()) return "an integer >= " + std::to_string(min);
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

// Walks a parsed (and overridden) document into a TrainConfig, checking every value on the way.
// Errors name the source and line of the offending node, or "--set" for overridden keys.
class ConfigReader {
 public:
  ConfigReader(std::string source, Names overridden)
      : source_(std::move(source)), overridden_(std::move(overridden)) {}

  TrainConfig read(const YAML::Node& root) {
    TrainConfig config;
    for_each_entry(root, "", section_names(),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "model") {
                       read_model(value, key, config.model);
                     } else if (name == "data") {
                       read_data(value, key, config.data);
                     } else if (name == "partition") {
                       read_partition(value, key, config.partition);
                     } else if (name == "schedule") {
                       read_schedule(value, key, config.schedule, config.schedule_csv);
                     } else if (name == "remat") {
                       read_remat(value, key, config.remat);
                     } else if (name == "transport") {
                       read_transport(value, key, config.transport);
                     } else if (name == "training") {
                       read_training(value, key, config.training);
                     } else if (name == "checkpoint") {
                       read_checkpoint(value, key, config.checkpoint);
                     } else if (name == "sample") {
                       read_sample(value, key, config.sample);
                     } else if (name == "output") {
                       read_output(value, key, config.output);
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config section '", name, "' has no reader");
                     }
                   });
    check_consistency(config);
    return config;
  }

 private:
  bool from_override(const std::string& key) const {
    for (const std::string& path : overridden_) {
      if (key == path) return true;
      if (key.size() > path.size() && key.compare(0, path.size(), path) == 0 &&
          (key[path.size()] == '.' || key[path.size()] == '[')) {
        return true;
      }
    }
    return false;
  }

  std::string where(const std::string& key, const YAML::Mark& mark) const {
    if (from_override(key)) return kOverrideSource;
    if (mark.is_null() || mark.line < 0) return source_;
    return source_ + ":" + std::to_string(mark.line + 1);
  }

  [[noreturn]] void fail(const std::string& key, const YAML::Mark& mark,
                         const std::string& message) const {
    if (key.empty()) PIPEMAT_THROW(ConfigError, where(key, mark), ": ", message);
    PIPEMAT_THROW(ConfigError, where(key, mark), ": ", key, ": ", message);
  }

  // A failure about a key read earlier (checks across keys): located at that key's value, or at
  // the source alone when the key was not given.
  [[noreturn]] void fail_at(const std::string& key, const std::string& message) const {
    const auto it = marks_.find(key);
    fail(key, it == marks_.end() ? YAML::Mark::null_mark() : it->second, message);
  }

  bool given(const std::string& key) const { return marks_.count(key) != 0; }

  // Calls fn(name, key path, value) for every entry of the mapping `node` (the value at `path`;
  // "" for the document) whose value is not null, after checking that the key is one of
  // `allowed` and is not repeated.
  template <typename Fn>
  void for_each_entry(const YAML::Node& node, const std::string& path, const Names& allowed,
                      Fn&& fn) {
    if (!node.IsDefined() || node.IsNull()) return;
    if (!node.IsMap()) {
      fail(path, node.Mark(),
           (path.empty() ? "the document is " + describe(node) + ", not a mapping"
                         : describe(node) + " is not a mapping") +
               "; expected a mapping with keys " + join(allowed, ", "));
    }
    std::map<std::string, int> first_line;
    for (const auto& entry : node) {
      const YAML::Node& key_node = entry.first;
      const YAML::Node& value = entry.second;
      if (!key_node.IsScalar()) {
        fail(path, key_node.Mark(),
             "a key is " + describe(key_node) + "; expected one of " + join(allowed, ", "));
      }
      const std::string& name = key_node.Scalar();
      const std::string key = child_key(path, name);
      if (!contains(allowed, name)) {
        std::string message = "unknown key; ";
        std::string suggestion = closest(name, allowed);
        if (!suggestion.empty()) {
          suggestion = child_key(path, suggestion);
        } else {
          suggestion = key_in_other_section(name, path);
        }
        if (!suggestion.empty()) message += "did you mean '" + suggestion + "'? ";
        message +=
            (path.empty() ? std::string("allowed top-level keys: ") : "allowed in " + path + ": ") +
            join(allowed, ", ");
        fail(key, key_node.Mark(), message);
      }
      const auto [it, inserted] = first_line.emplace(name, key_node.Mark().line + 1);
      if (!inserted) {
        fail(key, key_node.Mark(),
             "given twice (first on line " + std::to_string(it->second) + "); keep one");
      }
      const YAML::Mark mark = value.Mark().is_null() ? key_node.Mark() : value.Mark();
      marks_[key] = mark;
      if (value.IsNull()) continue;
      fn(name, key, value);
    }
  }

  // Calls fn(index, item key path, item) for every entry of the list `node`.
  template <typename Fn>
  void for_each_item(const YAML::Node& node, const std::string& key, const std::string& expected,
                     Fn&& fn) {
    if (!node.IsSequence())
      fail(key, node.Mark(), describe(node) + " is not a list; expected " + expected);
    size_t index = 0;
    for (const YAML::Node& item : node) {
      fn(index, key + "[" + std::to_string(index) + "]", item);
      ++index;
    }
  }

  int64_t read_int(const YAML::Node& node, const std::string& key, int64_t min,
                   int64_t max = std::numeric_limits<int64_t>::max()) {
    const std::string expected = int_range_text(min, max);
    if (!node.IsScalar())
      fail(key, node.Mark(), describe(node) + " is not an integer; expected " + expected);
    int64_t value = 0;
    const IntParse result = parse_int64(node.Scalar(), &value);
    if (result == IntParse::kNotANumber) {
      fail(key, node.Mark(), describe(node) + " is not an integer; expected " + expected);
    }
    if (is_quoted(node)) {
      fail(key, node.Mark(),
           describe(node) + " is a quoted string, not an integer; drop the quotes");
    }
    if (result == IntParse::kOverflow || value < min || value > max) {
      fail(key, node.Mark(), describe(node) + " is out of range; expected " + expected);
    }
    return value;
  }

  uint64_t read_uint64(const YAML::Node& node, const std::string& key) {
    const std::string expected = "an integer >= 0";
    if (!node.IsScalar())
      fail(key, node.Mark(), describe(node) + " is not an integer; expected " + expected);
    uint64_t value = 0;
    const IntParse result = parse_uint64(node.Scalar(), &value);
    if (result == IntParse::kNotANumber) {
      int64_t negative = 0;
      const bool is_negative = parse_int64(node.Scalar(), &negative) != IntParse::kNotANumber;
      fail(key, node.Mark(),
           describe(node) + (is_negative ? " is out of range" : " is not an integer") +
               "; expected " + expected);
    }
    if (result == IntParse::kOverflow) {
      fail(key, node.Mark(),
           describe(node) + " is out of range; expected an integer in [0, " +
               std::to_string(std::numeric_limits<uint64_t>::max()) + "]");
    }
    if (is_quoted(node)) {
      fail(key, node.Mark(),
           describe(node) + " is a quoted string, not an integer; drop the quotes");
    }
    return value;
  }

  // A finite number >= min (> min when `exclusive`) and <= max.
  double read_number(const YAML::Node& node, const std::string& key, double min, bool exclusive,
                     double max = std::numeric_limits<double>::infinity()) {
    std::string expected =
        std::string("a number ") + (exclusive ? "> " : ">= ") + format_number(min);
    if (std::isfinite(max)) {
      expected = std::string("a number in ") + (exclusive ? "(" : "[") + format_number(min) + ", " +
                 format_number(max) + "]";
    }
    if (!node.IsScalar())
      fail(key, node.Mark(), describe(node) + " is not a number; expected " + expected);
    double value = 0;
    if (!parse_double(node.Scalar(), &value)) {
      fail(key, node.Mark(), describe(node) + " is not a number; expected " + expected);
    }
    if (is_quoted(node)) {
      fail(key, node.Mark(), describe(node) + " is a quoted string, not a number; drop the quotes");
    }
    if (value < min || (exclusive && value == min) || value > max) {
      fail(key, node.Mark(), describe(node) + " is out of range; expected " + expected);
    }
    return value;
  }

  bool read_bool(const YAML::Node& node, const std::string& key) {
    if (node.IsScalar() && !is_quoted(node)) {
      const std::string& text = node.Scalar();
      if (text == "true" || text == "True" || text == "TRUE") return true;
      if (text == "false" || text == "False" || text == "FALSE") return false;
    }
    fail(key, node.Mark(), describe(node) + " is not a boolean; expected true or false");
  }

  std::string read_string(const YAML::Node& node, const std::string& key,
                          const std::string& expected) {
    if (!node.IsScalar())
      fail(key, node.Mark(), describe(node) + " is not a string; expected " + expected);
    return node.Scalar();
  }

  std::string read_choice(const YAML::Node& node, const std::string& key, const Names& allowed) {
    if (!node.IsScalar() || !contains(allowed, node.Scalar())) {
      fail(key, node.Mark(), describe(node) + " is not allowed; allowed: " + join(allowed, ", "));
    }
    return node.Scalar();
  }

  template <typename Enum>
  Enum read_enum(const YAML::Node& node, const std::string& key, const std::vector<Enum>& values) {
    const std::string text = read_choice(node, key, spellings(values));
    for (Enum value : values) {
      if (text == to_string(value)) return value;
    }
    PIPEMAT_INTERNAL_ASSERT(false, "spelling '", text, "' of ", key, " has no value");
  }

  void read_model(const YAML::Node& node, const std::string& path, ModelOptions& model) {
    for_each_entry(node, path, section_keys("model"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "kind") {
                       model.kind = read_choice(value, key, model_kinds());
                     } else if (name == "layers") {
                       model.layers = read_int(value, key, 1, kMaxLayers);
                     } else if (name == "hidden") {
                       model.hidden = read_int(value, key, 1, kMaxWidth);
                     } else if (name == "tokens") {
                       model.tokens = read_int(value, key, 1, kMaxTokens);
                     } else if (name == "heads") {
                       model.heads = read_int(value, key, 1, kMaxWidth);
                     } else if (name == "ffn") {
                       model.ffn = read_int(value, key, 0, kMaxWidth);
                     } else if (name == "experts") {
                       model.experts = read_int(value, key, 1, kMaxExperts);
                     } else if (name == "top_k") {
                       model.top_k = read_int(value, key, 1, kMaxExperts);
                     } else if (name == "seq_len") {
                       model.seq_len = read_int(value, key, 1, kMaxTokens);
                     } else if (name == "batch") {
                       model.batch = read_int(value, key, 1, kMaxTokens);
                     } else if (name == "dropout") {
                       model.dropout = read_number(value, key, 0, false, 0.9);
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
                     }
                   });
  }

  void read_data(const YAML::Node& node, const std::string& path, DataOptions& data) {
    for_each_entry(node, path, section_keys("data"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "path") {
                       data.path = read_string(value, key,
                                               "a text file or a directory of text "
                                               "files, e.g. /usr/share/games/fortunes");
                     } else if (name == "validation") {
                       data.validation = read_number(value, key, 0, true, 0.5);
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
                     }
                   });
  }

  void read_sample(const YAML::Node& node, const std::string& path, SampleOptions& sample) {
    for_each_entry(node, path, section_keys("sample"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "tokens") {
                       sample.tokens = read_int(value, key, 0, kMaxTokens);
                     } else if (name == "prompt") {
                       sample.prompt = read_string(value, key, "the text the sample continues");
                     } else if (name == "temperature") {
                       sample.temperature = read_number(value, key, 0, true, 100);
                     } else if (name == "top_k") {
                       sample.top_k = read_int(value, key, 0, 256);
                     } else if (name == "seed") {
                       sample.seed = read_uint64(value, key);
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
                     }
                   });
  }

  void read_partition(const YAML::Node& node, const std::string& path,
                      PartitionOptions& partition) {
    for_each_entry(node, path, section_keys("partition"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     PIPEMAT_INTERNAL_ASSERT(name == "layers_per_stage", "config key '", key,
                                             "' has no reader");
                     partition.layers_per_stage.clear();
                     for_each_item(
                         value, key, "a list of layer counts, one per stage, e.g. [4, 4]",
                         [&](size_t, const std::string& item_key, const YAML::Node& item) {
                           partition.layers_per_stage.push_back(read_int(item, item_key, 1));
                         });
                   });
  }

  void read_schedule(const YAML::Node& node, const std::string& path,
                     schedule::ScheduleOptions& options, std::string& csv) {
    constexpr int64_t kIntMax = std::numeric_limits<int>::max();
    for_each_entry(node, path, section_keys("schedule"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "kind") {
                       options.kind = read_enum(value, key, schedule_kinds());
                     } else if (name == "stages") {
                       options.stages = static_cast<int>(read_int(value, key, 1, kIntMax));
                     } else if (name == "micro_batches") {
                       options.micro_batches = static_cast<int>(read_int(value, key, 1, kIntMax));
                     } else if (name == "virtual_stages") {
                       options.virtual_stages = static_cast<int>(read_int(value, key, 1, kIntMax));
                     } else if (name == "recompute") {
                       options.recompute = read_enum(value, key, recompute_modes());
                     } else if (name == "csv") {
                       csv = read_string(value, key,
                                         "the path of a torch.distributed.pipelining "
                                         "CSV schedule, e.g. \"my-schedule.csv\"");
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
                     }
                   });
  }

  void read_remat(const YAML::Node& node, const std::string& path, RematConfig& remat) {
    for_each_entry(
        node, path, section_keys("remat"),
        [&](const std::string& name, const std::string& key, const YAML::Node& value) {
          if (name == "policy") {
            remat.policy = read_choice(value, key, remat_policies());
          } else if (name == "early_stop") {
            remat.early_stop = read_bool(value, key);
          } else if (name == "checkpoint") {
            remat.custom.checkpoint.clear();
            for_each_item(value, key, "a list of module path patterns, e.g. [\"layers.*\"]",
                          [&](size_t, const std::string& item_key, const YAML::Node& item) {
                            remat.custom.checkpoint.push_back(read_pattern(item, item_key));
                          });
          } else if (name == "stages") {
            remat.stages.clear();
            for_each_item(value, key, "a list of policy names, one per model stage",
                          [&](size_t, const std::string& item_key, const YAML::Node& item) {
                            remat.stages.push_back(read_choice(item, item_key, remat_policies()));
                          });
          } else if (name == "exclude") {
            remat.custom.exclude.clear();
            for_each_item(value, key, "a list of {path: PATTERN, save_output: BOOL}",
                          [&](size_t, const std::string& item_key, const YAML::Node& item) {
                            remat.custom.exclude.push_back(read_exclude_rule(item, item_key));
                          });
          } else {
            PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
          }
        });
    remat.custom.checkpoint_options.early_stop = remat.early_stop;
  }

  std::string read_pattern(const YAML::Node& node, const std::string& key) {
    std::string pattern = read_string(node, key, "a module path pattern, e.g. \"layers.*.gemm\"");
    if (pattern.empty()) {
      fail(key, node.Mark(), "'' is empty; expected a module path pattern, e.g. \"layers.*.gemm\"");
    }
    return pattern;
  }

  remat::ExcludeRule read_exclude_rule(const YAML::Node& node, const std::string& path) {
    const std::string expected =
        "{path: PATTERN, save_output: BOOL}, e.g. {path: \"layers.*.gemm\"}";
    if (!node.IsMap())
      fail(path, node.Mark(), describe(node) + " is not a mapping; expected " + expected);
    remat::ExcludeRule rule;
    bool has_path = false;
    for_each_entry(node, path, exclude_keys(),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "path") {
                       rule.path = read_pattern(value, key);
                       has_path = true;
                     } else {
                       rule.save_output = read_bool(value, key);
                     }
                   });
    if (!has_path) fail(path, node.Mark(), "'path' is missing; expected " + expected);
    return rule;
  }

  void read_transport(const YAML::Node& node, const std::string& path,
                      comm::TransportOptions& transport) {
    // A year: far beyond any sensible deadline, far below clock overflow.
    constexpr double kMaxTimeoutSeconds = 365.0 * 24 * 3600;
    for_each_entry(
        node, path, section_keys("transport"),
        [&](const std::string& name, const std::string& key, const YAML::Node& value) {
          if (name == "kind") {
            transport.kind = read_enum(value, key, transport_kinds());
          } else if (name == "timeout") {
            const double seconds = read_number(value, key, 0, false, kMaxTimeoutSeconds);
            const auto ms = static_cast<int64_t>(std::llround(seconds * 1000.0));
            if (seconds > 0 && ms == 0) {
              fail(key, value.Mark(),
                   describe(value) + " is below the 1 ms resolution; expected 0 (the default) or " +
                       "at least 0.001 seconds");
            }
            transport.timeout = std::chrono::milliseconds(ms);
          } else if (name == "master") {
            transport.master = read_master(value, key);
          } else if (name == "connect_retries") {
            transport.connect_retries =
                static_cast<int>(read_int(value, key, 1, std::numeric_limits<int>::max()));
          } else {
            PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
          }
        });
  }

  std::string read_master(const YAML::Node& node, const std::string& key) {
    const std::string expected =
        "host:port with a port in [1, 65535], e.g. \"127.0.0.1:29500\" (empty: PIPEMAT_MASTER)";
    std::string master = read_string(node, key, expected);
    if (master.empty()) return master;
    if (!parse_host_port(master)) {
      fail(key, node.Mark(), describe(node) + " is not host:port; expected " + expected);
    }
    return master;
  }

  void read_training(const YAML::Node& node, const std::string& path, TrainingOptions& training) {
    for_each_entry(node, path, section_keys("training"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "steps") {
                       training.steps = read_int(value, key, 1);
                     } else if (name == "optimizer") {
                       training.optimizer = read_choice(value, key, optimizers());
                     } else if (name == "lr") {
                       training.lr = read_number(value, key, 0, true, kMaxRate);
                     } else if (name == "momentum") {
                       training.momentum = read_number(value, key, 0, false);
                     } else if (name == "weight_decay") {
                       training.weight_decay = read_number(value, key, 0, false);
                     } else if (name == "clip_grad_norm") {
                       training.clip_grad_norm = read_number(value, key, 0, false);
                     } else if (name == "seed") {
                       training.seed = read_uint64(value, key);
                     } else if (name == "threads") {
                       training.threads = read_int(value, key, 0, 1024);
                     } else if (name == "warmup") {
                       training.warmup = read_int(value, key, 0);
                     } else if (name == "lr_decay") {
                       training.lr_decay = read_choice(value, key, lr_decays());
                     } else if (name == "min_lr") {
                       training.min_lr = read_number(value, key, 0, false, kMaxRate);
                     } else if (name == "eval_every") {
                       training.eval_every = read_int(value, key, 0);
                     } else if (name == "eval_batches") {
                       training.eval_batches = read_int(value, key, 1, 1 << 20);
                     } else if (name == "stop_after") {
                       training.stop_after = read_int(value, key, 0);
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
                     }
                   });
  }

  void read_checkpoint(const YAML::Node& node, const std::string& path,
                       CheckpointOptions& checkpoint) {
    for_each_entry(node, path, section_keys("checkpoint"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "dir") {
                       checkpoint.dir =
                           read_string(value, key, "a directory (empty: no checkpoints)");
                     } else if (name == "every") {
                       checkpoint.every = read_int(value, key, 0);
                     } else if (name == "keep_last") {
                       checkpoint.keep_last = read_int(value, key, 0, 1000000);
                     } else if (name == "resume") {
                       checkpoint.resume = read_string(
                           value, key, "a step-NNNNNN directory or latest (empty: step 0)");
                     } else {
                       PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
                     }
                   });
  }

  void read_output(const YAML::Node& node, const std::string& path, OutputOptions& output) {
    for_each_entry(
        node, path, section_keys("output"),
        [&](const std::string& name, const std::string& key, const YAML::Node& value) {
          if (name == "metrics") {
            output.metrics = read_string(value, key, "a file path (empty: no metrics file)");
          } else if (name == "timeline_svg") {
            output.timeline_svg = read_string(value, key, "a file path (empty: no timeline)");
          } else if (name == "loss_svg") {
            output.loss_svg = read_string(value, key, "a file path (empty: no loss curve)");
          } else if (name == "progress") {
            output.progress = read_bool(value, key);
          } else {
            PIPEMAT_INTERNAL_ASSERT(false, "config key '", key, "' has no reader");
          }
        });
  }

  // Checks between keys of one config; world size and schedule checks belong to the runtime.
  void check_consistency(const TrainConfig& config) const {
    const ModelOptions& model = config.model;
    if (model.kind == "moe" && model.top_k > model.experts) {
      fail_at(given("model.top_k") ? "model.top_k" : "model.experts",
              "top_k " + std::to_string(model.top_k) + " is larger than experts " +
                  std::to_string(model.experts) + "; expected 1 <= model.top_k <= model.experts");
    }
    const CheckpointOptions& checkpoint = config.checkpoint;
    if (checkpoint.dir.empty() && (checkpoint.every > 0 || checkpoint.resume == "latest")) {
      fail_at(checkpoint.every > 0 ? "checkpoint.every" : "checkpoint.resume",
              "needs checkpoint.dir, the directory the checkpoints are written to / read from");
    }
    if (model.kind == "gpt" && config.data.path.empty()) {
      fail_at("model.kind",
              "gpt trains on text and needs data.path, a text file or a directory "
              "of text files (e.g. /usr/share/games/fortunes)");
    }
    if (model.kind == "gpt" && config.sample.tokens > 0 && config.checkpoint.dir.empty()) {
      fail_at("sample.tokens",
              "the sample is drawn from the final checkpoint and needs "
              "checkpoint.dir");
    }
    if (model.kind != "gpt" && (config.sample.tokens > 0 || config.training.eval_every > 0)) {
      fail_at(config.sample.tokens > 0 ? "sample.tokens" : "training.eval_every",
              "only for model.kind gpt (the zoo's synthetic data has no text to sample or "
              "validate on)");
    }
    if (config.training.min_lr > config.training.lr) {
      fail_at("training.min_lr", "min_lr " + format_number(config.training.min_lr) +
                                     " is larger than training.lr " +
                                     format_number(config.training.lr));
    }
    if ((model.kind == "transformer" || model.kind == "gpt") && model.hidden % model.heads != 0) {
      fail_at(given("model.heads") ? "model.heads" : "model.hidden",
              "hidden " + std::to_string(model.hidden) + " is not divisible by heads " +
                  std::to_string(model.heads) + "; expected model.hidden % model.heads == 0");
    }

    // Weights (float32) of the whole model and one layer's widest activation per micro-batch.
    const double h = static_cast<double>(model.hidden);
    const double f = static_cast<double>(model.ffn > 0 ? model.ffn : 4 * model.hidden);
    double per_layer = h * h + 2 * h;  // rmsnorm-gemm, save-chain (upper bound)
    if (model.kind == "mlp") per_layer = 2 * h * f + h;
    if (model.kind == "transformer" || model.kind == "gpt")
      per_layer = 4 * h * h + 2 * h * f + 2 * h;
    if (model.kind == "moe") per_layer = static_cast<double>(model.experts) * (h * h + h) + 2 * h;
    const double weights = 4.0 * per_layer * static_cast<double>(model.layers);
    if (weights > kMaxWeightBytes) {
      fail_at(given("model.layers") ? "model.layers" : "model.hidden",
              "the " + model.kind + " model of " + std::to_string(model.layers) +
                  " layers with hidden " + std::to_string(model.hidden) + " holds about " +
                  format_number(weights / (1LL << 30)) + " GiB of float32 weights, more than the " +
                  "limit of " + format_number(kMaxWeightBytes / (1LL << 30)) +
                  " GiB; lower model.layers, model.hidden or model.ffn");
    }
    const double width = std::max(h, model.kind == "transformer" || model.kind == "mlp" ? f : h) *
                         (model.kind == "moe" ? static_cast<double>(model.top_k) : 1.0);
    const double tokens = model.kind == "gpt" ? static_cast<double>(model.batch * model.seq_len)
                                              : static_cast<double>(model.tokens);
    const double activation = 4.0 * tokens * width;
    if (activation > kMaxActivationBytes) {
      const char* key = model.kind == "gpt" ? "model.batch" : "model.tokens";
      fail_at(given(key) ? key : "model.hidden",
              "one activation of " + format_number(tokens) + " tokens x " + format_number(width) +
                  " is about " + format_number(activation / (1LL << 30)) +
                  " GiB, more than the limit of " +
                  format_number(kMaxActivationBytes / (1LL << 30)) +
                  " GiB per micro-batch; lower model.tokens or the model's width");
    }

    const std::vector<int64_t>& per_stage = config.partition.layers_per_stage;
    if (!per_stage.empty()) {
      const int64_t sum = std::accumulate(per_stage.begin(), per_stage.end(), int64_t{0});
      if (sum != model.layers) {
        fail_at("partition.layers_per_stage",
                "the entries sum to " + std::to_string(sum) + " but model.layers is " +
                    std::to_string(model.layers) + "; give one entry per stage summing to " +
                    std::to_string(model.layers) + ", or no list for a balanced split");
      }
    }

    const RematConfig& remat = config.remat;
    const bool custom_stage =
        std::find(remat.stages.begin(), remat.stages.end(), "custom") != remat.stages.end();
    if (remat.policy != "custom" && !custom_stage) {
      for (const char* key : {"remat.checkpoint", "remat.exclude"}) {
        const bool is_set = std::string(key) == "remat.checkpoint"
                                ? !remat.custom.checkpoint.empty()
                                : !remat.custom.exclude.empty();
        if (is_set) {
          fail_at(key, std::string("only allowed with remat.policy custom, but the policy is '") +
                           remat.policy + "'; set remat.policy: custom or remove " + key);
        }
      }
    } else if (remat.custom.checkpoint.empty()) {
      fail_at(custom_stage ? "remat.stages" : "remat.policy",
              "'custom' needs at least one remat.checkpoint pattern, e.g. checkpoint: "
              "[\"layers.*\"]");
    }
  }

  const std::string source_;
  const Names overridden_;
  std::map<std::string, YAML::Mark> marks_;  // key path -> where its value was given
};

[[noreturn]] void throw_yaml_error(const std::string& source, const YAML::Exception& error,
                                   const std::string& what) {
  std::string where = source;
  if (!error.mark.is_null()) {
    where +=
        ":" + std::to_string(error.mark.line + 1) + ":" + std::to_string(error.mark.column + 1);
  }
  PIPEMAT_THROW(ConfigError, where, ": ", what, ": ", error.msg);
}

// Applies "key.path=value" overrides to `root` (a mapping); returns the key paths set.
Names apply_overrides(YAML::Node& root, const std::vector<std::string>& overrides) {
  const Names keys = overridable_keys();
  Names applied;
  for (const std::string& text : overrides) {
    const auto equals = text.find('=');
    const std::string key = equals == std::string::npos ? "" : trim(text.substr(0, equals));
    PIPEMAT_CHECK(!key.empty(), ConfigError, kOverrideSource, ": '", text,
                  "' is not key.path=value; expected e.g. --set schedule.kind=zb-v");
    PIPEMAT_CHECK(key.find('[') == std::string::npos, ConfigError, kOverrideSource, ": ", key,
                  ": list entries cannot be set one by one; set the whole list, e.g. --set "
                  "remat.exclude=[{path: layers.*.gemm}]");
    if (!contains(keys, key)) {
      std::string suggestion = closest(key, keys);
      const auto dot = key.rfind('.');
      if (suggestion.empty() && dot != std::string::npos) {
        suggestion = key_in_other_section(key.substr(dot + 1), key.substr(0, dot));
      }
      PIPEMAT_THROW(ConfigError, kOverrideSource, ": ", key, ": unknown key; ",
                    suggestion.empty() ? "allowed: " + join(keys, ", ")
                                       : "did you mean '" + suggestion + "'?");
    }
    const std::string value_text = text.substr(equals + 1);
    YAML::Node value;
    try {
      value = YAML::Load(value_text);
    } catch (const YAML::Exception& error) {
      PIPEMAT_THROW(ConfigError, kOverrideSource, ": ", key, ": '", value_text,
                    "' is not a YAML value (", error.msg,
                    "); expected a scalar or a flow list/mapping, e.g. [2, 6]");
    }
    const auto dot = key.find('.');
    const std::string section = key.substr(0, dot);
    const std::string field = key.substr(dot + 1);
    // A section that is not a mapping cannot take the key; the reader reports the section.
    YAML::Node section_node = root[section];
    if (section_node.IsDefined() && !section_node.IsNull() && !section_node.IsMap()) continue;
    root[section][field] = value;
    applied.push_back(key);
  }
  return applied;
}

}  // namespace

namespace {

// Where a second document with content starts, if any. Events only, no nodes are built:
// yaml-cpp's LoadAll never ends on some malformed input (a document that is just ",") and
// allocates until the process dies, so documents are counted here with a bound.
class DocumentCounter final : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override { content = false; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override { saw(mark); }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                const std::string&) override {
    saw(mark);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    saw(mark);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    saw(mark);
  }
  void OnMapEnd() override {}

  YAML::Mark first;  // of the current document's first node
  bool content = false;

 private:
  void saw(const YAML::Mark& mark) {
    if (!content) first = mark;
    content = true;
  }
};

std::optional<YAML::Mark> second_document(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentCounter counter;
  int documents = 0;
  for (int i = 0; i < 64 && parser.HandleNextDocument(counter); ++i) {
    if (counter.content && ++documents == 2) return counter.first;
  }
  return std::nullopt;
}

}  // namespace

TrainConfig parse_config(const std::string& yaml_text, const std::string& source_name,
                         const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    const std::optional<YAML::Mark> second = second_document(yaml_text);
    if (second) {
      PIPEMAT_THROW(ConfigError, source_name,
                    second->is_null() ? std::string() : ":" + std::to_string(second->line + 1),
                    ": a second YAML document starts here; expected the whole config in one "
                    "document (remove the '---')");
    }
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& error) {
    throw_yaml_error(source_name, error, "malformed YAML");
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  try {
    Names overridden;
    if (root.IsMap()) overridden = apply_overrides(root, overrides);
    return ConfigReader(source_name, std::move(overridden)).read(root);
  } catch (const YAML::Exception& error) {
    // Not expected for a document that parsed; kept so that no yaml-cpp type escapes.
    throw_yaml_error(source_name, error, "cannot read the YAML");
  }
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code error;
  PIPEMAT_CHECK(!std::filesystem::is_directory(path, error), ConfigError, path,
                ": is a directory; expected a YAML config file, e.g. configs/default.yaml");
  std::ifstream in(path, std::ios::binary);
  PIPEMAT_CHECK(in.is_open(), ConfigError, path, ": cannot open the config file (",
                std::strerror(errno),
                "); expected a readable YAML file, e.g. configs/default.yaml");
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  PIPEMAT_CHECK(!in.bad(), ConfigError, path, ": reading the config file failed (",
                std::strerror(errno), ")");
  return parse_config(text, path, overrides);
}

std::string config_to_yaml(const TrainConfig& config) {
  YAML::Emitter out;
  const auto key = [&out](const char* name) -> YAML::Emitter& {
    return out << YAML::Key << name << YAML::Value;
  };
  out << YAML::BeginMap;

  const ModelOptions& model = config.model;
  key("model") << YAML::BeginMap;
  key("kind") << model.kind;
  key("layers") << model.layers;
  key("hidden") << model.hidden;
  key("tokens") << model.tokens;
  key("heads") << model.heads;
  key("ffn") << model.ffn;
  key("experts") << model.experts;
  key("top_k") << model.top_k;
  key("seq_len") << model.seq_len;
  key("batch") << model.batch;
  key("dropout") << format_number(model.dropout);
  out << YAML::EndMap;

  key("data") << YAML::BeginMap;
  key("path") << YAML::DoubleQuoted << config.data.path;
  key("validation") << format_number(config.data.validation);
  out << YAML::EndMap;

  key("partition") << YAML::BeginMap;
  key("layers_per_stage") << YAML::Flow << YAML::BeginSeq;
  for (int64_t layers : config.partition.layers_per_stage) out << layers;
  out << YAML::EndSeq << YAML::EndMap;

  const schedule::ScheduleOptions& schedule = config.schedule;
  key("schedule") << YAML::BeginMap;
  key("kind") << schedule::to_string(schedule.kind);
  key("stages") << schedule.stages;
  key("micro_batches") << schedule.micro_batches;
  key("virtual_stages") << schedule.virtual_stages;
  key("recompute") << schedule::to_string(schedule.recompute);
  key("csv") << YAML::DoubleQuoted << config.schedule_csv;
  out << YAML::EndMap;

  const RematConfig& remat = config.remat;
  key("remat") << YAML::BeginMap;
  key("policy") << remat.policy;
  key("early_stop") << remat.early_stop;
  key("checkpoint") << YAML::Flow << YAML::BeginSeq;
  for (const std::string& pattern : remat.custom.checkpoint) out << YAML::DoubleQuoted << pattern;
  out << YAML::EndSeq;
  key("exclude");
  if (remat.custom.exclude.empty()) out << YAML::Flow;
  out << YAML::BeginSeq;
  for (const remat::ExcludeRule& rule : remat.custom.exclude) {
    out << YAML::Flow << YAML::BeginMap;
    key("path") << YAML::DoubleQuoted << rule.path;
    key("save_output") << rule.save_output;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  key("stages") << YAML::Flow << YAML::BeginSeq;
  for (const std::string& name : remat.stages) out << name;
  out << YAML::EndSeq << YAML::EndMap;

  const comm::TransportOptions& transport = config.transport;
  key("transport") << YAML::BeginMap;
  key("kind") << comm::to_string(transport.kind);
  key("timeout") << format_number(static_cast<double>(transport.timeout.count()) / 1000.0);
  key("master") << YAML::DoubleQuoted << transport.master;
  key("connect_retries") << transport.connect_retries;
  out << YAML::EndMap;

  const TrainingOptions& training = config.training;
  key("training") << YAML::BeginMap;
  key("steps") << training.steps;
  key("optimizer") << training.optimizer;
  key("lr") << format_number(training.lr);
  key("momentum") << format_number(training.momentum);
  key("weight_decay") << format_number(training.weight_decay);
  key("clip_grad_norm") << format_number(training.clip_grad_norm);
  key("seed") << std::to_string(training.seed);
  key("threads") << training.threads;
  key("warmup") << training.warmup;
  key("lr_decay") << training.lr_decay;
  key("min_lr") << format_number(training.min_lr);
  key("eval_every") << training.eval_every;
  key("eval_batches") << training.eval_batches;
  key("stop_after") << training.stop_after;
  out << YAML::EndMap;

  const CheckpointOptions& checkpoint = config.checkpoint;
  key("checkpoint") << YAML::BeginMap;
  key("dir") << YAML::DoubleQuoted << checkpoint.dir;
  key("every") << checkpoint.every;
  key("keep_last") << checkpoint.keep_last;
  key("resume") << YAML::DoubleQuoted << checkpoint.resume;
  out << YAML::EndMap;

  const SampleOptions& sample = config.sample;
  key("sample") << YAML::BeginMap;
  key("tokens") << sample.tokens;
  key("prompt") << YAML::DoubleQuoted << sample.prompt;
  key("temperature") << format_number(sample.temperature);
  key("top_k") << sample.top_k;
  key("seed") << std::to_string(sample.seed);
  out << YAML::EndMap;

  const OutputOptions& output = config.output;
  key("output") << YAML::BeginMap;
  key("metrics") << YAML::DoubleQuoted << output.metrics;
  key("timeline_svg") << YAML::DoubleQuoted << output.timeline_svg;
  key("loss_svg") << YAML::DoubleQuoted << output.loss_svg;
  key("progress") << output.progress;
  out << YAML::EndMap;

  out << YAML::EndMap;
  PIPEMAT_INTERNAL_ASSERT(out.good(), "emitting the config failed: ", out.GetLastError());
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const Section& section : schema()) {
    for (const std::string& key : section.keys) {
      keys.push_back(section.name + "." + key);
      if (section.name == "remat" && key == "exclude") {
        for (const std::string& rule_key : exclude_keys()) {
          keys.push_back("remat.exclude[]." + rule_key);
        }
      }
    }
  }
  return keys;
}

}  // namespace pipemat::models
