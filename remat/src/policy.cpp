#include "pipemat/remat/policy.h"

#include <torch/nn/modules/container/sequential.h>

#include <fnmatch.h>

#include <map>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/remat/any_module.h"
#include "pipemat/remat/wrappers.h"

namespace pipemat::remat {
namespace {

bool match_parts(const std::vector<std::string>& pat, size_t i,
                 const std::vector<std::string>& path, size_t j) {
  if (i == pat.size()) return j == path.size();
  if (pat[i] == "**") {
    for (size_t k = j; k <= path.size(); ++k) {
      if (match_parts(pat, i + 1, path, k)) return true;
    }
    return false;
  }
  if (j == path.size()) return false;
  if (fnmatch(pat[i].c_str(), path[j].c_str(), 0) != 0) return false;
  return match_parts(pat, i + 1, path, j + 1);
}

std::string parent_of(const std::string& path) {
  auto dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

bool is_prefix_path(const std::string& outer, const std::string& inner) {
  return inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
         inner[outer.size()] == '.';
}

}  // namespace

bool path_matches(const std::string& pattern, const std::string& path) {
  return match_parts(split(pattern, '.'), 0, split(path, '.'), 0);
}

std::string pattern_problem(const std::string& pattern) {
  if (pattern.empty()) return "it is empty";
  for (const std::string& part : split(pattern, '.')) {
    if (part.empty()) return "it has an empty component (two dots, or a dot at an end)";
    for (size_t i = 0; i < part.size(); ++i) {
      if (part[i] == '\\') {
        ++i;  // an escaped character
      } else if (part[i] == '[') {
        size_t j = i + 1;
        if (j < part.size() && (part[j] == '!' || part[j] == '^')) ++j;
        if (j < part.size() && part[j] == ']') ++j;  // a ']' first is one of the set
        const size_t close = part.find(']', j);
        if (close == std::string::npos) {
          return "component '" + part + "' opens a '[' set that it never closes (write '[[]' " +
                 "for a literal '[')";
        }
        i = close;
      }
    }
  }
  return "";
}

std::vector<std::string> module_paths(torch::nn::Module& root) {
  std::vector<std::string> paths;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    paths.push_back(item.key());
  }
  return paths;
}

std::vector<UnmatchedPattern> unmatched_patterns(const RematPolicy& policy,
                                                 const std::vector<std::string>& paths) {
  std::vector<UnmatchedPattern> out;
  const auto check = [&](const char* list, size_t index, const std::string& pattern) {
    for (const std::string& path : paths) {
      if (path_matches(pattern, path)) return;
    }
    out.push_back({list, index, pattern, nearest_name(pattern, paths)});
  };
  for (size_t i = 0; i < policy.checkpoint.size(); ++i) {
    check("checkpoint", i, policy.checkpoint[i]);
  }
  for (size_t i = 0; i < policy.exclude.size(); ++i) check("exclude", i, policy.exclude[i].path);
  return out;
}

namespace {

using ModuleMap = std::map<std::string, std::shared_ptr<torch::nn::Module>>;

// The first module paths, for an error about a path that matches none.
std::string known_paths(const ModuleMap& by_path) {
  std::vector<std::string> names;
  for (const auto& [p, m] : by_path) names.push_back(p);
  if (names.size() > 20) {
    names.resize(20);
    names.push_back("...");
  }
  return join(names, ", ");
}

// "; the nearest is 'x'" for a pattern that matches none.
std::string nearest_of(const std::string& pattern, const ModuleMap& by_path) {
  std::vector<std::string> names;
  for (const auto& [p, m] : by_path) names.push_back(p);
  const std::string nearest = nearest_name(pattern, names);
  return nearest.empty() ? "" : "; the nearest to '" + pattern + "' is '" + nearest + "'";
}

// What the policy declares for one module path, and the rule that declared it.
struct Decl {
  bool checkpoint = false;
  bool save = false;
  bool save_output = true;
  std::string rule;
};
using Decls = std::map<std::string, Decl>;

void declare_checkpoints(const ModuleMap& by_path, const RematPolicy& policy, Decls& decls) {
  for (const auto& pattern : policy.checkpoint) {
    PIPEMAT_CHECK(!pattern.empty(), RematError, "remat policy: a checkpoint path is empty");
    const std::string problem = pattern_problem(pattern);
    PIPEMAT_CHECK(problem.empty(), RematError, "remat policy: checkpoint path '", pattern,
                  "' is malformed: ", problem);
    bool any = false;
    for (const auto& [path, m] : by_path) {
      if (!path_matches(pattern, path)) continue;
      any = true;
      decls[path].checkpoint = true;
      decls[path].rule = "checkpoint '" + pattern + "'";
    }
    PIPEMAT_CHECK(any || policy.allow_unmatched, RematError, "remat policy: checkpoint path '",
                  pattern, "' matches no module. Module paths are: ", known_paths(by_path),
                  nearest_of(pattern, by_path));
  }
}

// After declare_checkpoints: a module is a checkpoint unit or a SAVE region, not both.
void declare_excludes(const ModuleMap& by_path, const RematPolicy& policy, Decls& decls) {
  for (const auto& rule : policy.exclude) {
    PIPEMAT_CHECK(!rule.path.empty(), RematError, "remat policy: an exclude path is empty");
    const std::string problem = pattern_problem(rule.path);
    PIPEMAT_CHECK(problem.empty(), RematError, "remat policy: exclude path '", rule.path,
                  "' is malformed: ", problem);
    bool any = false;
    for (const auto& [path, m] : by_path) {
      if (!path_matches(rule.path, path)) continue;
      any = true;
      Decl& d = decls[path];
      PIPEMAT_CHECK(!d.checkpoint, RematError, "remat policy: module '", path, "' is matched by ",
                    d.rule, " and by exclude '", rule.path,
                    "'; a module is either a checkpoint unit or a SAVE region");
      PIPEMAT_CHECK(!d.save || d.save_output == rule.save_output, RematError,
                    "remat policy: module '", path, "' is matched by ", d.rule, " and by exclude '",
                    rule.path, "' with a different save_output");
      d.save = true;
      d.save_output = rule.save_output;
      d.rule = "exclude '" + rule.path + "'";
    }
    PIPEMAT_CHECK(any || policy.allow_unmatched, RematError, "remat policy: exclude path '",
                  rule.path, "' matches no module. Module paths are: ", known_paths(by_path),
                  nearest_of(rule.path, by_path));
  }
}

// Nested units are not supported.
void check_not_nested(const Decls& decls) {
  for (const auto& [outer, d1] : decls) {
    if (!d1.checkpoint) continue;
    for (const auto& [inner, d2] : decls) {
      PIPEMAT_CHECK(!(d2.checkpoint && is_prefix_path(outer, inner)), RematError,
                    "remat policy: checkpoint unit '", inner,
                    "' is nested inside checkpoint unit '", outer,
                    "'; nested checkpoint units are not supported");
    }
  }
}

// Declares `d` on the slot of the module at `path` and records it in `result`.
void apply_decl(torch::nn::Module& root, const ModuleMap& by_path, const std::string& path,
                const Decl& d, const RematPolicy& policy, PolicyResult& result) {
  auto module = by_path.at(path);
  const std::string parent_path = parent_of(path);
  torch::nn::Module* parent = parent_path.empty()          ? &root
                              : by_path.count(parent_path) ? by_path.at(parent_path).get()
                                                           : nullptr;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(parent)) {
    for (auto& any : *seq) {
      if (any.ptr().get() == module.get()) make_any_module_region(any);
    }
  }
  PIPEMAT_CHECK(slot_is_interceptable(module.get()), RematError, "remat policy: module '", path,
                "' (", module->name(), ") matched ", d.rule,
                " but its parent calls it directly, so a declaration cannot take effect. "
                "Declare that member as pipemat::remat::Remat<...> (a one-line change of the "
                "member declaration), hold it in a torch::nn::Sequential, or wrap its "
                "AnyModule with checkpoint_wrapper / checkpoint_exclude_wrapper");
  auto slot = find_slot(module.get());
  slot->reset();
  slot->set_name(path);
  if (d.checkpoint) {
    CheckpointOptions options = policy.checkpoint_options;
    options.name = path;
    slot->declare_checkpoint(options);
    result.checkpointed.push_back(path);
  } else {
    SaveRegionOptions options;
    options.save_output = d.save_output;
    options.name = path;
    slot->declare_save(options);
    result.excluded.push_back(path);
  }
}

}  // namespace

PolicyResult apply_policy(torch::nn::Module& root, const RematPolicy& policy) {
  auto modules = root.named_modules("", /*include_self=*/false);
  ModuleMap by_path;
  for (const auto& item : modules) by_path[item.key()] = item.value();
  Decls decls;  // path -> (kind, rule) with conflict detection
  declare_checkpoints(by_path, policy, decls);
  declare_excludes(by_path, policy, decls);
  check_not_nested(decls);
  PolicyResult result;
  for (const auto& [path, d] : decls) apply_decl(root, by_path, path, d, policy, result);
  return result;
}

}  // namespace pipemat::remat
