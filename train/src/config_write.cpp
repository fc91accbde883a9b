// Writing a config back: config_to_yaml (the effective config that --print-config and checkpoint
// manifests hold) and the key lists and docs rows of the field table (Note [Config field table]).

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "config_fields.h"
#include "pipemat/core/error.h"
#include "pipemat/train/config.h"

namespace pipemat::train {

using config_detail::config_fields;
using config_detail::ConfigField;

std::string config_to_yaml(const TrainConfig& config) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const std::string& section : config_detail::section_names()) {
    out << YAML::Key << section << YAML::Value << YAML::BeginMap;
    for (const ConfigField& field : config_fields()) {
      if (field.section != section) continue;
      out << YAML::Key << field.name << YAML::Value;
      field.codec.write(out, config);
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  PIPEMAT_INTERNAL_ASSERT(out.good(), "emitting the config failed: ", out.GetLastError());
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const ConfigField& field : config_fields()) keys.push_back(field.path());
  return keys;
}

std::vector<ConfigKeyDoc> config_key_docs() {
  const TrainConfig defaults;
  std::vector<ConfigKeyDoc> docs;
  for (const ConfigField& field : config_fields()) {
    std::string default_text = field.default_doc;
    if (default_text.empty()) {
      YAML::Emitter out;
      field.codec.write(out, defaults);
      default_text = std::string("`") + out.c_str() + "`";
    }
    docs.push_back({field.path(), field.codec.type, default_text, field.allowed, field.meaning});
  }
  return docs;
}

std::string config_key_tables() {
  std::string text;
  std::string section;
  for (const ConfigKeyDoc& doc : config_key_docs()) {
    const std::string first = doc.key.substr(0, doc.key.find('.'));
    if (first != section) {
      if (!section.empty()) text += "\n";
      section = first;
      text += "### " + section + "\n\n| key | type | default | allowed | meaning |\n";
      text += "|---|---|---|---|---|\n";
    }
    text += doc.row() + "\n";
  }
  return text;
}

std::string ConfigKeyDoc::row() const {
  std::string text = "|";
  for (const std::string& cell : {"`" + key + "`", type, default_value, allowed, meaning}) {
    text += cell.empty() ? " |" : " " + cell + " |";  // an empty cell as "| |"
  }
  return text;
}

}  // namespace pipemat::train
