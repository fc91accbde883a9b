#pragma once
// The YAML config of a training run (docs/config.md lists every key):
//
//   model:     {kind: rmsnorm-gemm, layers: 8, hidden: 64, tokens: 32}
//   partition: {layers_per_stage: [4, 4]}
//   schedule:  {kind: 1f1b, ranks: 2, micro_batches: 4, recompute: pretrigger}
//   remat:     {policy: custom, checkpoint: ["layers.*"], exclude: [{path: "layers.*.gemm"}]}
//   transport: {kind: auto, timeout: 300}
//   training:  {steps: 5, optimizer: sgd, lr: 0.05}
//   output:    {metrics: "", timeline_svg: "", progress: true}
//
// Every key is optional; a missing key (or one given as null, `key:` or `key: ~`) keeps the
// default of options.h. Overrides ("key.path=value", the `--set` flag of `pipemat train`) are
// applied on top of the document before validation; the value is parsed as a YAML scalar or flow
// collection, so `partition.layers_per_stage=[2,6]` and `remat.exclude=[{path: layers.*.gemm}]`
// work. Only leaf keys of config_keys() without "[]" can be overridden.
//
// Validation covers each value on its own (type, range, enum spelling) and the checks inside one
// config (partition sum vs model.layers, moe top_k vs experts, transformer hidden vs heads,
// checkpoint / exclude only with remat.policy custom). Checks that need the world size or the
// built schedule (ranks vs world size, micro-batches vs stages, partition entries vs stages) are
// left to the runtime.
//
// Note [Deprecated keys]
// ~~~~~~~~~~~~~~~~~~~~~~
// A renamed key keeps its old name as a deprecated alias: schedule.stages is schedule.ranks
// (pipeline ranks, ScheduleOptions::ranks). The old name reads exactly as
// the new one (same checks, errors name the key as written) and adds one message to
// TrainConfig::warnings, located like an error: "x.yaml:3: schedule.stages: deprecated name of
// schedule.ranks; write schedule.ranks instead". Both names in one section are an error naming
// both. An override of either name (`--set schedule.stages=2`) replaces the document's value
// under either name. config_to_yaml, config_keys() and docs/config.md hold the new name only.
//
// Errors: every function throws pipemat::ConfigError whose message starts with where the bad
// value is and names the key path, the value found and what is allowed:
//   configs/x.yaml:7: schedule.kind: 'zb-x' is not allowed; allowed: gpipe, 1f1b, interleaved, ...
//   configs/x.yaml:3:9: malformed YAML: end of map flow not found
//   --set: model.layer: unknown key; did you mean 'model.layers'?
// Lines (and columns) are 1-based. A value that came from an override is located as "--set".
// Threading: all functions are pure (no global state) and may be called concurrently.

#include <string>
#include <vector>

#include "pipemat/train/options.h"

namespace pipemat::train {

// Parses and validates `yaml_text`, then returns the config. `source_name` names the text in
// errors (usually the file path). An empty document gives the defaults of options.h. What is
// read but deprecated is in the returned config's `warnings` (Note [Deprecated keys]); this
// function prints nothing.
TrainConfig parse_config(const std::string& yaml_text, const std::string& source_name,
                         const std::vector<std::string>& overrides = {});

// Reads `path` and calls parse_config with it as the source name. ConfigError naming the path
// when the file cannot be read.
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The config as a YAML document holding every key of config_keys() (the effective config a run
// echoes). parse_config(config_to_yaml(c), ...) returns a config equal to `c` for every config
// parse_config can return (transport.timeout is kept in whole milliseconds).
std::string config_to_yaml(const TrainConfig& config);

// Every key path parse_config accepts, in document order: "model.kind", ..., with list entries
// of remat.exclude as "remat.exclude[].path" and "remat.exclude[].save_output". Deprecated names
// (Note [Deprecated keys]) are not listed.
std::vector<std::string> config_keys();

// The reference row of one key in docs/config.md: the cells of its table row.
struct ConfigKeyDoc {
  std::string key;            // "model.layers"
  std::string type;           // "integer"
  std::string default_value;  // "`8`": the default as config_to_yaml writes it, or a note
  std::string allowed;        // ">= 1" (may be empty)
  std::string meaning;        // "number of layers (gpt: decoder blocks)"
  // "| `model.layers` | integer | `8` | >= 1 | number of layers (gpt: decoder blocks) |"
  std::string row() const;
};

// One ConfigKeyDoc per key of config_keys(), in the same order.
std::vector<ConfigKeyDoc> config_key_docs();

// The key tables of docs/config.md: per section (the key's first part, in key order) a line
// "### <section>", a blank line, the header "| key | type | default | allowed | meaning |", the
// rule and the section's rows, then a blank line (`pipemat config --keys` prints it).
std::string config_key_tables();

}  // namespace pipemat::train
