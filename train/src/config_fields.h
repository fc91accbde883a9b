#pragma once
// Private to the config (config_*.cpp): the table of its keys.
//
// Note [Config field table]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Every key of the config is one ConfigField of config_fields() (config_fields.cpp), in
// document order: its YAML path, the TrainConfig member it fills, how its value is read (type,
// range or choices, with the messages of ConfigReader) and written back, and its row of the key
// reference in docs/config.md. Everything that lists keys walks this one table: the allowed keys
// of each section and their order (ConfigReader::read, unknown-key suggestions), --set, the
// emitter (config_to_yaml, so --print-config), config_keys() and config_key_docs() (whose rows
// tests/train/config_test.cpp finds in docs/config.md). A new key is one new entry. Checks
// across keys are code after the table pass (config_check.cpp).

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "config_reader.h"
#include "pipemat/train/options.h"

namespace pipemat::train::config_detail {

// How one key's value is read and written, and the type its docs row names.
struct Codec {
  std::string type;  // "integer", "list of strings", ...
  // Reads `value` (never null) at key path `key` into `config`, failing through `reader`.
  std::function<void(ConfigReader& reader, const YAML::Node& value, const std::string& key,
                     TrainConfig& config)>
      read;
  // Emits the value of `config`'s member (the value only; the caller emits the key).
  std::function<void(YAML::Emitter& out, const TrainConfig& config)> write;
};

struct ConfigField {
  ConfigField(std::string section_, std::string name_, Codec codec_, std::string allowed_,
              std::string meaning_, std::string default_doc_ = "", std::string alias_ = "")
      : section(std::move(section_)),
        name(std::move(name_)),
        codec(std::move(codec_)),
        allowed(std::move(allowed_)),
        meaning(std::move(meaning_)),
        default_doc(std::move(default_doc_)),
        alias(std::move(alias_)) {}

  std::string section;  // "model"; "remat.exclude[]" for the keys of a remat.exclude entry
  std::string name;     // "layers"
  Codec codec;          // none for the keys of a list entry (read with their list)
  std::string allowed;  // the "allowed" cell of the docs row ("" for none)
  std::string meaning;  // the "meaning" cell of the docs row
  // The "default" cell when the emitted default of TrainConfig{} does not say it (e.g.
  // "(required)"); "": the emitted value in backquotes.
  std::string default_doc;
  // A deprecated name of this key in the same section, still read with a warning (Note
  // [Deprecated keys] in config.h); "": none.
  std::string alias;

  std::string path() const { return section + "." + name; }
  bool in_list_entry() const { return section.find("[]") != std::string::npos; }
};

// Every key, in document order (Note [Config field table]).
const std::vector<ConfigField>& config_fields();

// The top-level sections ("model", ..., "output"), in document order.
const Names& section_names();
// The keys of `section` (a top-level section or "remat.exclude[]"), without deprecated names.
const Names& section_keys(const std::string& section);
// Deprecated name -> key of `section`.
const std::map<std::string, std::string>& section_aliases(const std::string& section);
// The field `name` of `section` names, by its name or its deprecated name; nullptr for none.
const ConfigField* find_field(const std::string& section, const std::string& name);

// ---- codecs ------------------------------------------------------------------------------
// `get` is a generic lambda returning the member of a (const or mutable) TrainConfig, e.g.
// PIPEMAT_MEMBER(model.layers) of config_fields.cpp.

template <typename Get>
Codec integer(Get get, int64_t min, int64_t max = std::numeric_limits<int64_t>::max()) {
  return {"integer",
          [get, min, max](ConfigReader& r, const YAML::Node& v, const std::string& key,
                          TrainConfig& c) {
            auto& member = get(c);
            member = static_cast<std::decay_t<decltype(member)>>(r.read_int(v, key, min, max));
          },
          [get](YAML::Emitter& out, const TrainConfig& c) { out << get(c); }};
}

// 0 .. 2^64 - 1 (seeds).
template <typename Get>
Codec unsigned_integer(Get get) {
  return {"integer",
          [get](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            get(c) = r.read_uint64(v, key);
          },
          [get](YAML::Emitter& out, const TrainConfig& c) { out << std::to_string(get(c)); }};
}

// A finite number >= min (> min when `exclusive`) and <= max.
template <typename Get>
Codec number(Get get, double min, bool exclusive,
             double max = std::numeric_limits<double>::infinity()) {
  return {"number",
          [get, min, exclusive, max](ConfigReader& r, const YAML::Node& v, const std::string& key,
                                     TrainConfig& c) {
            get(c) = r.read_number(v, key, min, exclusive, max);
          },
          [get](YAML::Emitter& out, const TrainConfig& c) { out << format_number(get(c)); }};
}

template <typename Get>
Codec boolean(Get get) {
  return {"boolean",
          [get](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            get(c) = r.read_bool(v, key);
          },
          [get](YAML::Emitter& out, const TrainConfig& c) { out << get(c); }};
}

// Any string; `expected` says what it should be when the value is not a scalar.
template <typename Get>
Codec text(Get get, std::string expected) {
  return {"string",
          [get, expected](ConfigReader& r, const YAML::Node& v, const std::string& key,
                          TrainConfig& c) { get(c) = r.read_string(v, key, expected); },
          [get](YAML::Emitter& out, const TrainConfig& c) { out << YAML::DoubleQuoted << get(c); }};
}

// One of `values`, spelled as their to_string.
template <typename Get, typename Enum>
Codec choice(Get get, std::vector<Enum> values) {
  return {"string",
          [get, values](ConfigReader& r, const YAML::Node& v, const std::string& key,
                        TrainConfig& c) { get(c) = r.read_enum(v, key, values); },
          [get](YAML::Emitter& out, const TrainConfig& c) { out << to_string(get(c)); }};
}

// A list of `type` ("list of integers", ...); the list given replaces the default one. Each item
// is read by `read_item(reader, item, item_key)` (`expected` says what the list should be when
// it is not one) and written by `write_item(out, item)` into a flow sequence.
template <typename Get, typename ReadItem, typename WriteItem>
Codec list_of(std::string type, Get get, std::string expected, ReadItem read_item,
              WriteItem write_item) {
  return {std::move(type),
          [get, expected, read_item](ConfigReader& r, const YAML::Node& v, const std::string& key,
                                     TrainConfig& c) {
            auto& list = get(c);
            list.clear();
            r.for_each_item(v, key, expected,
                            [&](size_t, const std::string& item_key, const YAML::Node& item) {
                              list.push_back(read_item(r, item, item_key));
                            });
          },
          [get, write_item](YAML::Emitter& out, const TrainConfig& c) {
            out << YAML::Flow << YAML::BeginSeq;
            for (const auto& value : get(c)) write_item(out, value);
            out << YAML::EndSeq;
          }};
}

// A list of integers >= item_min.
template <typename Get>
Codec integer_list(Get get, std::string expected, int64_t item_min) {
  return list_of(
      "list of integers", get, std::move(expected),
      [item_min](ConfigReader& r, const YAML::Node& item, const std::string& item_key) {
        return r.read_int(item, item_key, item_min);
      },
      [](YAML::Emitter& out, int64_t value) { out << value; });
}

// The codecs of the structured keys (config_codecs.cpp).
Codec list_entry_key(std::string type);  // a key of a list entry: read and written with its list
Codec pattern_list();                    // remat.checkpoint
Codec exclude_list();                    // remat.exclude
Codec stage_list();                      // remat.stages
Codec timeout_codec();                   // transport.timeout: seconds in YAML
Codec master_codec();                    // transport.master: host:port, or empty
Codec layer_split_codec();               // partition.layers_per_stage: auto or counts
Codec memory_budget_codec();             // partition.memory_budget: sizes

}  // namespace pipemat::train::config_detail
