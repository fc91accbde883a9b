#pragma once
// Private to the config (config_*.cpp): the reader that walks one YAML document into a
// TrainConfig. Its value readers (config_values.cpp) check one value each and fail with the
// messages docs/config.md shows; the walk over sections and keys, with unknown-key suggestions
// and deprecated keys, is config_read.cpp; the fields it fills are the table of
// config_fields.cpp (Note [Config field table] in config_fields.h).
//
// Errors: every failure throws ConfigError "<where>: <key>: <message>", where <where> is
// "<source>:<line>" of the value, "<source>" when the value has no position, or "--set" when the
// key (or a parent of it) came from an override. Not thread-safe (one reader per parse).

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/spelled.h"
#include "pipemat/train/options.h"

namespace pipemat::train::config_detail {

using Names = std::vector<std::string>;

constexpr const char* kOverrideSource = "--set";

bool contains(const Names& names, const std::string& name);

// How a value shows up in messages: scalars quoted as written, collections by their kind.
std::string describe(const YAML::Node& node);

// The shortest decimal text that reads back as exactly `value`; whole numbers without exponent.
std::string format_number(double value);

class ConfigReader {
 public:
  // `overridden`: the key paths that --set gave (their values are located as "--set").
  ConfigReader(std::string source, Names overridden);

  // The config of `root` (a mapping, or null for the defaults), after the checks across keys.
  TrainConfig read(const YAML::Node& root);

  [[noreturn]] void fail(const std::string& key, const YAML::Mark& mark,
                         const std::string& message) const;
  // A failure about a key read earlier (checks across keys): located at that key's value, or at
  // the source alone when the key was not given.
  [[noreturn]] void fail_at(const std::string& key, const std::string& message) const;
  bool given(const std::string& key) const { return marks_.count(key) != 0; }
  // Of the keys a check across keys involves, the one its error names: the first set by --set
  // (the value the user just gave), else the first given in the document, else the last.
  std::string blame(const std::vector<std::string>& keys) const;

  using EntryFn =
      std::function<void(const std::string& name, const std::string& key, const YAML::Node&)>;
  using ItemFn = std::function<void(size_t index, const std::string& key, const YAML::Node&)>;

  // Calls fn(name, key path, value) for every entry of the mapping `node` (the value at `path`;
  // "" for the document) whose value is not null, after checking that the key is one of
  // `allowed` or of the deprecated names `aliases` (alias -> name; Note [Deprecated keys] in
  // config.h) and is not repeated.
  void for_each_entry(const YAML::Node& node, const std::string& path, const Names& allowed,
                      const EntryFn& fn, const std::map<std::string, std::string>& aliases = {});
  // Calls fn(index, item key path, item) for every entry of the list `node`.
  void for_each_item(const YAML::Node& node, const std::string& key, const std::string& expected,
                     const ItemFn& fn) const;

  // One value each (config_values.cpp); `key` names it in errors.
  int64_t read_int(const YAML::Node& node, const std::string& key, int64_t min,
                   int64_t max = std::numeric_limits<int64_t>::max()) const;
  uint64_t read_uint64(const YAML::Node& node, const std::string& key) const;
  // A finite number >= min (> min when `exclusive`) and <= max.
  double read_number(const YAML::Node& node, const std::string& key, double min, bool exclusive,
                     double max = std::numeric_limits<double>::infinity()) const;
  bool read_bool(const YAML::Node& node, const std::string& key) const;
  std::string read_string(const YAML::Node& node, const std::string& key,
                          const std::string& expected) const;
  std::string read_choice(const YAML::Node& node, const std::string& key,
                          const Names& allowed) const;
  // One of `values`, spelled as their to_string.
  template <typename Enum>
  Enum read_enum(const YAML::Node& node, const std::string& key,
                 const std::vector<Enum>& values) const {
    const std::string text = read_choice(node, key, spellings(values));
    for (Enum value : values) {
      if (text == to_string(value)) return value;
    }
    PIPEMAT_INTERNAL_ASSERT(false, "spelling '", text, "' of ", key, " has no value");
  }

 private:
  bool from_override(const std::string& key) const;
  std::string where(const std::string& key, const YAML::Mark& mark) const;
  void read_section(const YAML::Node& node, const std::string& section, TrainConfig& config);

  const std::string source_;
  const Names overridden_;
  std::map<std::string, YAML::Mark> marks_;  // key path -> where its value was given
  Names warnings_;
};

// The checks between keys of one config (config_check.cpp), failing through `reader`.
void check_consistency(const TrainConfig& config, const ConfigReader& reader);

// model.from (config_from.cpp): the llama keys read from <model.from>/config.json, a Hugging
// Face LlamaConfig; then model.from is cleared, so the config a run writes (a checkpoint's
// manifest, `pipemat config`) holds the keys themselves. Fails through `reader` naming model.from
// and the JSON field, or the key that was given in the YAML too.
void apply_model_from(TrainConfig& config, const ConfigReader& reader);

}  // namespace pipemat::train::config_detail
