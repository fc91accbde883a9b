// Reading a config: the YAML document (one only), the --set overrides on top of it, and the walk
// of ConfigReader over sections and keys of the field table (Note [Config field table]), with
// suggestions for unknown keys and the deprecated names of Note [Deprecated keys].

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "config_fields.h"
#include "config_reader.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/train/config.h"

namespace pipemat::train {
namespace config_detail {
namespace {

// The candidate closest to `name` when it is close enough to be a typo (at most one edit per
// three characters, at least one), else "".
std::string closest(const std::string& name, const Names& candidates) {
  return nearest_name(name, candidates, std::max<size_t>(1, name.size() / 3));
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

// "training.steps" for "steps" when `path` is not "training": a key given in the wrong section.
std::string key_in_other_section(const std::string& name, const std::string& path) {
  for (const std::string& section : section_names()) {
    if (section != path && contains(section_keys(section), name)) return section + "." + name;
  }
  return "";
}

// "did you mean 'schedule.ranks' (formerly 'schedule.stages')?" for a key close to a deprecated
// name: the key to write, and the name that was close.
std::string did_you_mean(const std::string& key, const std::string& deprecated = "") {
  std::string text = "did you mean '" + key + "'";
  if (!deprecated.empty()) text += " (formerly '" + deprecated + "')";
  return text + "?";
}

// The message for `name`, not a key of `path`: the closest key (also by its deprecated name) or
// the section that has it, and the keys allowed.
std::string unknown_key(const std::string& name, const std::string& path, const Names& allowed,
                        const std::map<std::string, std::string>& aliases) {
  Names candidates = allowed;
  for (const auto& entry : aliases) candidates.push_back(entry.first);
  std::string message = "unknown key; ";
  const std::string suggestion = closest(name, candidates);
  if (aliases.count(suggestion) != 0) {
    message +=
        did_you_mean(child_key(path, aliases.at(suggestion)), child_key(path, suggestion)) + " ";
  } else if (!suggestion.empty()) {
    message += did_you_mean(child_key(path, suggestion)) + " ";
  } else if (const std::string other = key_in_other_section(name, path); !other.empty()) {
    message += did_you_mean(other) + " ";
  }
  return message +
         (path.empty() ? std::string("allowed top-level keys: ") : "allowed in " + path + ": ") +
         join(allowed, ", ");
}

}  // namespace

ConfigReader::ConfigReader(std::string source, Names overridden)
    : source_(std::move(source)), overridden_(std::move(overridden)) {}

TrainConfig ConfigReader::read(const YAML::Node& root) {
  TrainConfig config;
  for_each_entry(root, "", section_names(),
                 [&](const std::string& name, const std::string&, const YAML::Node& value) {
                   read_section(value, name, config);
                 });
  // remat.early_stop also holds for the checkpoint units of a custom policy.
  config.remat.custom.checkpoint_options.early_stop = config.remat.early_stop;
  apply_model_from(config, *this);
  check_consistency(config, *this);
  config.warnings = warnings_;
  return config;
}

void ConfigReader::read_section(const YAML::Node& node, const std::string& section,
                                TrainConfig& config) {
  for_each_entry(
      node, section, section_keys(section),
      [&](const std::string& name, const std::string& key, const YAML::Node& value) {
        const ConfigField* field = find_field(section, name);
        PIPEMAT_INTERNAL_ASSERT(field != nullptr && field->codec.read, "config key '", key,
                                "' has no reader");
        field->codec.read(*this, value, key, config);
      },
      section_aliases(section));
}

bool ConfigReader::from_override(const std::string& key) const {
  for (const std::string& path : overridden_) {
    if (key == path) return true;
    if (key.size() > path.size() && key.compare(0, path.size(), path) == 0 &&
        (key[path.size()] == '.' || key[path.size()] == '[')) {
      return true;
    }
  }
  return false;
}

std::string ConfigReader::blame(const std::vector<std::string>& keys) const {
  PIPEMAT_INTERNAL_ASSERT(!keys.empty(), "blame of no keys");
  for (const std::string& key : keys) {
    if (from_override(key)) return key;
  }
  for (const std::string& key : keys) {
    if (given(key)) return key;
  }
  return keys.back();
}

std::string ConfigReader::where(const std::string& key, const YAML::Mark& mark) const {
  if (from_override(key)) return kOverrideSource;
  if (mark.is_null() || mark.line < 0) return source_;
  return source_ + ":" + std::to_string(mark.line + 1);
}

void ConfigReader::fail(const std::string& key, const YAML::Mark& mark,
                        const std::string& message) const {
  if (key.empty()) PIPEMAT_THROW(ConfigError, where(key, mark), ": ", message);
  PIPEMAT_THROW(ConfigError, where(key, mark), ": ", key, ": ", message);
}

void ConfigReader::fail_at(const std::string& key, const std::string& message) const {
  const auto it = marks_.find(key);
  fail(key, it == marks_.end() ? YAML::Mark::null_mark() : it->second, message);
}

void ConfigReader::for_each_entry(const YAML::Node& node, const std::string& path,
                                  const Names& allowed, const EntryFn& fn,
                                  const std::map<std::string, std::string>& aliases) {
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
    const auto alias = aliases.find(name);
    if (!contains(allowed, name) && alias == aliases.end()) {
      fail(key, key_node.Mark(), unknown_key(name, path, allowed, aliases));
    }
    const auto [it, inserted] = first_line.emplace(name, key_node.Mark().line + 1);
    if (!inserted) {
      fail(key, key_node.Mark(),
           "given twice (first on line " + std::to_string(it->second) + "); keep one");
    }
    const YAML::Mark mark = value.Mark().is_null() ? key_node.Mark() : value.Mark();
    // Note [Deprecated keys]: one key under two names is an error naming both; the old name
    // alone reads as the new one, with a warning.
    for (const auto& [old_name, new_name] : aliases) {
      const std::string& other = name == old_name ? new_name : old_name;
      if ((name != old_name && name != new_name) || first_line.count(other) == 0) continue;
      fail(key, key_node.Mark(),
           "given together with " + child_key(path, other) + " (line " +
               std::to_string(first_line.at(other)) + "); " + child_key(path, old_name) +
               " is the deprecated name of " + child_key(path, new_name) + ": keep only " +
               child_key(path, new_name));
    }
    marks_[key] = mark;
    if (alias != aliases.end()) {
      const std::string new_key = child_key(path, alias->second);
      marks_[new_key] = mark;
      warnings_.push_back(where(key, mark) + ": " + key + ": deprecated name of " + new_key +
                          "; write " + new_key + " instead");
    }
    if (value.IsNull()) continue;
    fn(name, key, value);
  }
}

void ConfigReader::for_each_item(const YAML::Node& node, const std::string& key,
                                 const std::string& expected, const ItemFn& fn) const {
  if (!node.IsSequence())
    fail(key, node.Mark(), describe(node) + " is not a list; expected " + expected);
  size_t index = 0;
  for (const YAML::Node& item : node) {
    fn(index, key + "[" + std::to_string(index) + "]", item);
    ++index;
  }
}

namespace {

[[noreturn]] void throw_yaml_error(const std::string& source, const YAML::Exception& error,
                                   const std::string& what) {
  std::string where = source;
  if (!error.mark.is_null()) {
    where +=
        ":" + std::to_string(error.mark.line + 1) + ":" + std::to_string(error.mark.column + 1);
  }
  PIPEMAT_THROW(ConfigError, where, ": ", what, ": ", error.msg);
}

// Keys that `--set` accepts: every key outside list entries (lists are set whole).
Names overridable_keys() {
  Names keys;
  for (const ConfigField& field : config_fields()) {
    if (!field.in_list_entry()) keys.push_back(field.path());
  }
  return keys;
}

// Deprecated key path -> key path, over every section.
std::map<std::string, std::string> deprecated_keys() {
  std::map<std::string, std::string> keys;
  for (const ConfigField& field : config_fields()) {
    if (!field.alias.empty()) keys[field.section + "." + field.alias] = field.path();
  }
  return keys;
}

// Applies "key.path=value" overrides to `root` (a mapping); returns the key paths set.
Names apply_overrides(YAML::Node& root, const std::vector<std::string>& overrides) {
  const Names keys = overridable_keys();
  const std::map<std::string, std::string> deprecated = deprecated_keys();
  Names candidates = keys;  // for suggestions: the deprecated names too
  for (const auto& entry : deprecated) candidates.push_back(entry.first);
  Names applied;
  for (const std::string& text : overrides) {
    const auto equals = text.find('=');
    const std::string key = equals == std::string::npos ? "" : trim(text.substr(0, equals));
    PIPEMAT_CHECK(!key.empty(), ConfigError, kOverrideSource, ": '", text,
                  "' is not key.path=value; expected e.g. --set schedule.kind=zb-v");
    PIPEMAT_CHECK(key.find('[') == std::string::npos, ConfigError, kOverrideSource, ": ", key,
                  ": list entries cannot be set one by one; set the whole list, e.g. --set "
                  "remat.exclude=[{path: layers.*.gemm}]");
    if (!contains(keys, key) && deprecated.count(key) == 0) {
      const std::string suggestion = closest(key, candidates);
      std::string hint;
      if (deprecated.count(suggestion) != 0) {
        hint = did_you_mean(deprecated.at(suggestion), suggestion);
      } else if (!suggestion.empty()) {
        hint = did_you_mean(suggestion);
      } else if (const auto dot = key.rfind('.'); dot != std::string::npos) {
        const std::string other = key_in_other_section(key.substr(dot + 1), key.substr(0, dot));
        if (!other.empty()) hint = did_you_mean(other);
      }
      PIPEMAT_THROW(ConfigError, kOverrideSource, ": ", key, ": unknown key; ",
                    hint.empty() ? "allowed: " + join(keys, ", ") : hint);
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
    // The key replaces the document's value under either name (Note [Deprecated keys]).
    const ConfigField* spec = find_field(section, field);
    if (section_node.IsMap() && spec != nullptr && !spec->alias.empty()) {
      section_node.remove(field == spec->alias ? spec->name : spec->alias);
    }
    root[section][field] = value;
    applied.push_back(key);
  }
  return applied;
}

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

}  // namespace config_detail

using config_detail::ConfigReader;
using config_detail::Names;

TrainConfig parse_config(const std::string& yaml_text, const std::string& source_name,
                         const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    const std::optional<YAML::Mark> second = config_detail::second_document(yaml_text);
    if (second) {
      PIPEMAT_THROW(ConfigError, source_name,
                    second->is_null() ? std::string() : ":" + std::to_string(second->line + 1),
                    ": a second YAML document starts here; expected the whole config in one "
                    "document (remove the '---')");
    }
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& error) {
    config_detail::throw_yaml_error(source_name, error, "malformed YAML");
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  try {
    Names overridden;
    if (root.IsMap()) overridden = config_detail::apply_overrides(root, overrides);
    return ConfigReader(source_name, std::move(overridden)).read(root);
  } catch (const YAML::Exception& error) {
    // Not expected for a document that parsed; kept so that no yaml-cpp type escapes.
    config_detail::throw_yaml_error(source_name, error, "cannot read the YAML");
  }
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  // A config is small: a larger file is not one (Note [Opening an input file]).
  constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
  return parse_config(read_whole_file<ConfigError>(path, "config", kMaxConfigBytes), path,
                      overrides);
}

}  // namespace pipemat::train
