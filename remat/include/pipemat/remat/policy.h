#pragma once
// Declaring checkpoint units and SAVE regions by module path, from code or from YAML:
//
//   remat:
//     checkpoint: ["layers.*"]
//     exclude:
//       - {path: "layers.*.gemm"}
//       - {path: "layers.*.up", save_output: false}
//
// Paths are the names of torch::nn::Module::named_modules(). A pattern is matched component by
// component (split at '.') with shell wildcards inside a component (`*`, `?`, `[...]`), so `*`
// matches one whole component and `s*` the components starting with s; a component `**` matches
// any number of components (including none).

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "pipemat/remat/options.h"

namespace pipemat::remat {

struct ExcludeRule {
  std::string path;
  bool save_output = true;
};

struct RematPolicy {
  std::vector<std::string> checkpoint;
  std::vector<ExcludeRule> exclude;
  CheckpointOptions checkpoint_options;  // early_stop, preserve_rng_state for every unit
  // Skip patterns that match no module instead of failing: for one policy of a whole model
  // applied to each of its pipeline stages, which hold only some of the modules.
  bool allow_unmatched = false;
};

// A pattern of a policy that matches no module path: its list ("checkpoint" or "exclude"), its
// index there, the pattern, and the module path nearest to it by edits ("" without paths).
struct UnmatchedPattern {
  std::string list;
  size_t index = 0;
  std::string pattern;
  std::string nearest;
};

struct PolicyResult {
  std::vector<std::string> checkpointed;  // module paths declared checkpoint units
  std::vector<std::string> excluded;      // module paths declared SAVE regions
};

// "" when `pattern` is a well-formed path pattern; else what is wrong with it: it is empty, it
// has an empty component ("a..b"), or a component opens a '[' set that it never closes ("[").
std::string pattern_problem(const std::string& pattern);

// The module paths under `root` (without root itself), as apply_policy matches them.
std::vector<std::string> module_paths(torch::nn::Module& root);

// The patterns of `policy` that match none of `paths`, in list order (checkpoint, then exclude).
// For one policy over several module trees (the stages of a pipeline) pass the paths of them all:
// a pattern is unmatched only when it matches on none.
std::vector<UnmatchedPattern> unmatched_patterns(const RematPolicy& policy,
                                                 const std::vector<std::string>& paths);

// Applies `policy` to the module tree under `root`: Sequential entries are rerouted in place;
// modules held by Remat<H> or wrapped AnyModules get the declaration. Throws RematError naming
// the path for: a malformed pattern (pattern_problem), a pattern that matches no module (unless
// allow_unmatched; the message names the nearest module path), a module matched by two
// conflicting rules, nested checkpoint units, and a matched module that its parent calls directly
// (declare that member as Remat<H>, or put it in a Sequential).
PolicyResult apply_policy(torch::nn::Module& root, const RematPolicy& policy);

// True when `path` matches `pattern` (see above).
bool path_matches(const std::string& pattern, const std::string& path);

}  // namespace pipemat::remat
