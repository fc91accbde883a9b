// The codecs of the config's structured keys (config_fields.h): the pattern lists and exclude
// rules of remat, remat.stages, transport.timeout and transport.master. The scalar keys use the
// generic codecs of config_fields.h.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config_fields.h"
#include "pipemat/core/parse.h"
#include "pipemat/remat/policy.h"

namespace pipemat::train::config_detail {
namespace {

// A year: far beyond any sensible deadline, far below clock overflow.
constexpr double kMaxTimeoutSeconds = 365.0 * 24 * 3600;

std::string read_pattern(const ConfigReader& r, const YAML::Node& node, const std::string& key) {
  std::string pattern = r.read_string(node, key, "a module path pattern, e.g. \"layers.*.gemm\"");
  if (pattern.empty()) {
    r.fail(key, node.Mark(), "'' is empty; expected a module path pattern, e.g. \"layers.*.gemm\"");
  }
  const std::string problem = remat::pattern_problem(pattern);
  if (!problem.empty()) {
    r.fail(key, node.Mark(),
           "'" + pattern + "' is not a module path pattern: " + problem +
               "; expected e.g. \"layers.*.gemm\" (shell wildcards within a component)");
  }
  return pattern;
}

std::vector<std::string> read_patterns(ConfigReader& r, const YAML::Node& v,
                                       const std::string& key) {
  std::vector<std::string> patterns;
  r.for_each_item(v, key, "a list of module path patterns, e.g. [\"layers.*\"]",
                  [&](size_t, const std::string& item_key, const YAML::Node& item) {
                    patterns.push_back(read_pattern(r, item, item_key));
                  });
  return patterns;
}

void write_patterns(YAML::Emitter& out, const std::vector<std::string>& patterns) {
  out << YAML::Flow << YAML::BeginSeq;
  for (const std::string& pattern : patterns) out << YAML::DoubleQuoted << pattern;
  out << YAML::EndSeq;
}

remat::ExcludeRule read_exclude_rule(ConfigReader& r, const YAML::Node& node,
                                     const std::string& path) {
  const std::string expected = "{path: PATTERN, save_output: BOOL}, e.g. {path: \"layers.*.gemm\"}";
  if (!node.IsMap()) {
    r.fail(path, node.Mark(), describe(node) + " is not a mapping; expected " + expected);
  }
  remat::ExcludeRule rule;
  bool has_path = false;
  r.for_each_entry(node, path, section_keys("remat.exclude[]"),
                   [&](const std::string& name, const std::string& key, const YAML::Node& value) {
                     if (name == "path") {
                       rule.path = read_pattern(r, value, key);
                       has_path = true;
                     } else {
                       rule.save_output = r.read_bool(value, key);
                     }
                   });
  if (!has_path) r.fail(path, node.Mark(), "'path' is missing; expected " + expected);
  return rule;
}

std::vector<remat::ExcludeRule> read_exclude_rules(ConfigReader& r, const YAML::Node& v,
                                                   const std::string& key) {
  std::vector<remat::ExcludeRule> rules;
  r.for_each_item(v, key, "a list of {path: PATTERN, save_output: BOOL}",
                  [&](size_t, const std::string& item_key, const YAML::Node& item) {
                    rules.push_back(read_exclude_rule(r, item, item_key));
                  });
  return rules;
}

// Flow mappings in a block list (`flow`: in a flow list), or [] when empty.
void write_exclude_rules(YAML::Emitter& out, const std::vector<remat::ExcludeRule>& rules,
                         bool flow) {
  if (rules.empty() || flow) out << YAML::Flow;
  out << YAML::BeginSeq;
  for (const remat::ExcludeRule& rule : rules) {
    out << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "path" << YAML::Value << YAML::DoubleQuoted << rule.path;
    out << YAML::Key << "save_output" << YAML::Value << rule.save_output;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
}

// One entry of remat.stages: a policy name or {checkpoint: [...], exclude: [...]}.
models::StageRemat read_stage_remat(ConfigReader& r, const YAML::Node& node,
                                    const std::string& key) {
  if (!node.IsMap())
    return models::StageRemat::named(r.read_enum(node, key, models::remat_policy_values()));
  models::StageRemat entry = models::StageRemat::of({}, {});
  r.for_each_entry(
      node, key, section_keys("remat.stages[]"),
      [&](const std::string& name, const std::string& item_key, const YAML::Node& value) {
        if (name == "checkpoint") {
          entry.lists.checkpoint = read_patterns(r, value, item_key);
        } else {
          entry.lists.exclude = read_exclude_rules(r, value, item_key);
        }
      });
  if (entry.lists.checkpoint.empty()) {
    r.fail(key, node.Mark(),
           "a stage's own policy needs at least one checkpoint pattern, e.g. {checkpoint: "
           "[\"layers.0\"]}; write none for a stage without recompute");
  }
  return entry;
}

}  // namespace

// A key of a list entry (remat.exclude[].path): read and written with its list.
Codec list_entry_key(std::string type) { return {std::move(type), nullptr, nullptr}; }

// remat.checkpoint.
Codec pattern_list() {
  return {"list of strings",
          [](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            c.remat.custom.checkpoint = read_patterns(r, v, key);
          },
          [](YAML::Emitter& out, const TrainConfig& c) {
            write_patterns(out, c.remat.custom.checkpoint);
          }};
}

// remat.exclude.
Codec exclude_list() {
  return {"list of mappings",
          [](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            c.remat.custom.exclude = read_exclude_rules(r, v, key);
          },
          [](YAML::Emitter& out, const TrainConfig& c) {
            write_exclude_rules(out, c.remat.custom.exclude, false);
          }};
}

// remat.stages: a flow list of names, or a block list when an entry is a mapping.
Codec stage_list() {
  return {"list",
          [](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            std::vector<models::StageRemat>& stages = c.remat.stages;
            stages.clear();
            r.for_each_item(v, key,
                            "a list with one entry per model stage: a policy name or {checkpoint: "
                            "[...], exclude: [...]}",
                            [&](size_t, const std::string& item_key, const YAML::Node& item) {
                              stages.push_back(read_stage_remat(r, item, item_key));
                            });
          },
          [](YAML::Emitter& out, const TrainConfig& c) {
            const std::vector<models::StageRemat>& stages = c.remat.stages;
            const bool any_own = std::any_of(stages.begin(), stages.end(),
                                             [](const models::StageRemat& s) { return s.own; });
            if (!any_own) out << YAML::Flow;
            out << YAML::BeginSeq;
            for (const models::StageRemat& stage : stages) {
              if (!stage.own) {
                out << to_string(stage.policy);
                continue;
              }
              out << YAML::Flow << YAML::BeginMap;
              out << YAML::Key << "checkpoint" << YAML::Value;
              write_patterns(out, stage.lists.checkpoint);
              out << YAML::Key << "exclude" << YAML::Value;
              write_exclude_rules(out, stage.lists.exclude, true);
              out << YAML::EndMap;
            }
            out << YAML::EndSeq;
          }};
}

// transport.timeout: seconds in YAML, whole milliseconds in TransportOptions.
Codec timeout_codec() {
  return {"number (seconds)",
          [](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            const double seconds = r.read_number(v, key, 0, false, kMaxTimeoutSeconds);
            const auto ms = static_cast<int64_t>(std::llround(seconds * 1000.0));
            if (seconds > 0 && ms == 0) {
              r.fail(key, v.Mark(),
                     describe(v) + " is below the 1 ms resolution; expected 0 (the default) or " +
                         "at least 0.001 seconds");
            }
            c.transport.timeout = std::chrono::milliseconds(ms);
          },
          [](YAML::Emitter& out, const TrainConfig& c) {
            out << format_number(static_cast<double>(c.transport.timeout.count()) / 1000.0);
          }};
}

// transport.master: host:port, or empty.
Codec master_codec() {
  return {"string",
          [](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            const std::string expected =
                "host:port with a port in [1, 65535], e.g. \"127.0.0.1:29500\" (empty: "
                "PIPEMAT_MASTER)";
            std::string master = r.read_string(v, key, expected);
            if (!master.empty() && !parse_host_port(master)) {
              r.fail(key, v.Mark(), describe(v) + " is not host:port; expected " + expected);
            }
            c.transport.master = master;
          },
          [](YAML::Emitter& out, const TrainConfig& c) {
            out << YAML::DoubleQuoted << c.transport.master;
          }};
}

Codec layer_split_codec() {
  const Codec counts = integer_list(
      [](auto& c) -> auto& { return c.partition.layers_per_stage; },
      "auto, or a list of layer counts, one per stage, e.g. [4, 4]", 1);
  return {"`auto` or list of integers",
          [counts](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            c.partition.by_cost = v.IsScalar() && v.Scalar() == "auto";
            if (c.partition.by_cost) {
              c.partition.layers_per_stage.clear();
              return;
            }
            counts.read(r, v, key, c);
          },
          [counts](YAML::Emitter& out, const TrainConfig& c) {
            if (c.partition.by_cost) {
              out << "auto";
            } else {
              counts.write(out, c);
            }
          }};
}

// partition.memory_budget: a size ("2GiB", "512MiB", 4096) or a list of them.
Codec memory_budget_codec() {
  return {"size or list of sizes",
          [](ConfigReader& r, const YAML::Node& v, const std::string& key, TrainConfig& c) {
            std::vector<int64_t>& budget = c.partition.memory_budget;
            budget.clear();
            const auto read_size = [&](const YAML::Node& item, const std::string& item_key) {
              const std::string text = r.read_string(item, item_key, "a size such as 2GiB");
              int64_t bytes = 0;
              try {
                bytes = parse_bytes(text, "memory size");
              } catch (const ConfigError& e) {
                r.fail(item_key, item.Mark(), e.what());
              }
              if (bytes <= 0) {
                r.fail(item_key, item.Mark(), describe(item) + " is not above 0 bytes");
              }
              budget.push_back(bytes);
            };
            if (v.IsSequence()) {
              r.for_each_item(v, key, "sizes, one for every rank or one per rank",
                              [&](size_t, const std::string& item_key, const YAML::Node& item) {
                                read_size(item, item_key);
                              });
            } else {
              read_size(v, key);
            }
          },
          [](YAML::Emitter& out, const TrainConfig& c) {
            out << YAML::Flow << YAML::BeginSeq;
            for (int64_t bytes : c.partition.memory_budget) out << bytes;
            out << YAML::EndSeq;
          }};
}

}  // namespace pipemat::train::config_detail
