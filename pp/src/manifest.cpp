// A checkpoint's manifest.json: manifest.h.

#include "manifest.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/json.h"
#include "pipemat/core/parse.h"

namespace pipemat::pp::detail {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

[[noreturn]] void damaged(const std::string& path, const std::string& what) {
  PIPEMAT_THROW(PipelineError, "load_checkpoint: ", path, ": ", what, "; the manifest is damaged");
}

// Whether `v` is an integer within [min, max]. nlohmann reads every integer >= 0 as unsigned (so
// 0 too, and values above int64's range): both bounds hold for it as well.
bool integer_in(const Json& v, int64_t min, int64_t max) {
  if (!v.is_number_integer()) return false;
  if (!v.is_number_unsigned()) return v.get<int64_t>() >= min && v.get<int64_t>() <= max;
  const auto u = v.get<uint64_t>();
  return u <= static_cast<uint64_t>(max) && (min <= 0 || u >= static_cast<uint64_t>(min));
}

// The integer field `name` of `m`, within [min, max].
int64_t integer(const Json& m, const char* name, int64_t min, int64_t max,
                const std::string& path) {
  if (!m.contains(name)) damaged(path, std::string("field '") + name + "' is missing");
  const Json& v = m.at(name);
  if (!integer_in(v, min, max)) {
    damaged(path, std::string("field '") + name + "' is " + v.dump() +
                      "; expected an integer from " + std::to_string(min) + " to " +
                      std::to_string(max));
  }
  return v.get<int64_t>();
}

std::string text(const Json& m, const char* name, const std::string& path) {
  if (!m.contains(name)) damaged(path, std::string("field '") + name + "' is missing");
  const Json& v = m.at(name);
  if (!v.is_string())
    damaged(path, std::string("field '") + name + "' is " + v.dump() + "; expected a string");
  return v.get<std::string>();
}

// What a file name of a checkpoint directory is: a rank file "rank-R.pt" (replicas 0) or an
// optimizer shard "rank-R.shard-D-of-K.pt", spelt as pipemat writes it; nothing for any other
// name.
struct CheckpointFile {
  int rank = -1;
  int replica = -1;
  int replicas = 0;
};
std::optional<CheckpointFile> checkpoint_file(const std::string& name) {
  constexpr std::string_view kPrefix = "rank-", kSuffix = ".pt", kShard = ".shard-", kOf = "-of-";
  if (name.size() <= kPrefix.size() + kSuffix.size() || name.rfind(kPrefix, 0) != 0 ||
      name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
    return std::nullopt;
  }
  const std::string body =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  const auto number = [](const std::string& text) {
    return parse_int_in(text, 0, std::numeric_limits<int>::max());
  };
  CheckpointFile f;
  const size_t shard = body.find(kShard);
  const size_t of = body.find(kOf);
  if (shard == std::string::npos) {
    const auto rank = number(body);
    if (!rank) return std::nullopt;
    f.rank = static_cast<int>(*rank);
  } else {
    if (of == std::string::npos || of < shard) return std::nullopt;
    const auto rank = number(body.substr(0, shard));
    const auto replica = number(body.substr(shard + kShard.size(), of - shard - kShard.size()));
    const auto replicas = number(body.substr(of + kOf.size()));
    if (!rank || !replica || !replicas || *replica >= *replicas) return std::nullopt;
    f = {static_cast<int>(*rank), static_cast<int>(*replica), static_cast<int>(*replicas)};
  }
  // Only the spelling pipemat writes ("rank-01.pt" or "rank-+1.pt" is another file).
  const std::string canonical =
      f.replicas == 0 ? rank_file_name(f.rank) : shard_file_name(f.rank, f.replica, f.replicas);
  if (canonical != name) return std::nullopt;
  return f;
}

// "2 ranks", "1 replica".
std::string count(long long n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// The world size and the replica counts that the names `names` (of a files record or of a
// directory) imply: one past the highest rank of a rank file, the K of every shard file.
struct Implied {
  long long ranks = 0;
  std::map<int, std::string> replica_counts;  // each replica count K: its first shard file
};
template <typename Names>
Implied implied_by(const Names& names) {
  Implied out;
  for (const std::string& name : names) {
    const auto f = checkpoint_file(name);
    if (!f) continue;
    if (f->replicas == 0) {
      out.ranks = std::max(out.ranks, static_cast<long long>(f->rank) + 1);
    } else {
      out.replica_counts.emplace(f->replicas, name);
    }
  }
  return out;
}

}  // namespace

std::string rank_file_name(int rank) { return "rank-" + std::to_string(rank) + ".pt"; }

std::string shard_file_name(int rank, int replica, int replicas) {
  return "rank-" + std::to_string(rank) + ".shard-" + std::to_string(replica) + "-of-" +
         std::to_string(replicas) + ".pt";
}

std::string manifest_path(const std::string& dir) {
  return (fs::path(dir) / "manifest.json").string();
}

Json parse_manifest_json(const std::string& text, const std::string& path) {
  Json m;
  try {
    m = parse_json(text);  // Note [Strict JSON]: a field twice is an error, not the last one
  } catch (const JsonError& e) {
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", path, " is not valid JSON: ", e.what(),
                  "; the manifest is damaged");
  }
  PIPEMAT_CHECK(m.is_object(), PipelineError, "load_checkpoint: ", path, " is a JSON ",
                m.type_name(), ", not a pipemat manifest (an object)");
  return m;
}

CheckpointManifest manifest_from_json(const Json& m, const std::string& path) {
  CheckpointManifest out;
  PIPEMAT_CHECK(m.contains("format") && m["format"].is_number_integer(), PipelineError,
                "load_checkpoint: ", path, " has no format version; it is not a pipemat manifest");
  const Json& format = m["format"];
  const bool newer = format.is_number_unsigned() ? format.get<uint64_t>() > kShardedFormat
                                                 : format.get<int64_t>() > kShardedFormat;
  PIPEMAT_CHECK(!newer && format.get<int64_t>() >= kOldestFormat, PipelineError,
                "load_checkpoint: ", path, " is of format ", format.dump(),
                "; this pipemat reads formats ", kOldestFormat, " to ", kShardedFormat,
                (newer ? " (it was written by a newer pipemat)" : ""));
  out.format = format.get<int>();
  out.step = integer(m, "step", 0, std::numeric_limits<int64_t>::max(), path);
  out.world_size = static_cast<int>(integer(m, "world_size", 1, kMaxManifestRanks, path));
  out.schedule_kind = text(m, "schedule_kind", path);
  out.stages = static_cast<int>(integer(m, "stages", 1, kMaxManifestRanks, path));
  out.micro_batches =
      static_cast<int>(integer(m, "micro_batches", 1, std::numeric_limits<int>::max(), path));
  if (!m.contains("stage_to_rank") || !m["stage_to_rank"].is_array()) {
    damaged(path, "field 'stage_to_rank' is " +
                      (m.contains("stage_to_rank") ? m["stage_to_rank"].dump() : "missing") +
                      "; expected an array of ranks, one per stage");
  }
  for (const Json& r : m["stage_to_rank"]) {
    if (!integer_in(r, 0, out.world_size - 1)) {
      damaged(path, "field 'stage_to_rank' holds " + r.dump() + "; expected ranks from 0 to " +
                        std::to_string(out.world_size - 1) + " (field 'world_size' is " +
                        std::to_string(out.world_size) + ")");
    }
    out.stage_to_rank.push_back(r.get<int>());
  }
  PIPEMAT_CHECK(out.stage_to_rank.size() == static_cast<size_t>(out.stages), PipelineError,
                "load_checkpoint: ", path, " has ", out.stages, " stages but a stage map of ",
                out.stage_to_rank.size());
  if (m.contains("metadata")) out.metadata = text(m, "metadata", path);
  if (m.contains(kRunKey)) {
    const Json& run = m[kRunKey];
    if (!run.is_object()) damaged(path, "field 'run' is " + run.dump() + "; expected an object");
    out.run_id = text(run, "id", path);
    out.config_digest = text(run, "config_digest", path);
  }
  if (out.format >= kShardedFormat) {
    out.replicas = static_cast<int>(integer(m, "replicas", 1, kMaxManifestReplicas, path));
  }
  if (out.format < 2) return out;
  // The files record: the digest of every file, and no file that the fields above do not have.
  if (!m.contains(kFilesKey) || !m[kFilesKey].is_object()) {
    damaged(path, "field 'files' is " + (m.contains(kFilesKey) ? m[kFilesKey].dump() : "missing") +
                      "; expected the record of every rank file's SHA-256 and size");
  }
  std::vector<std::string> names;
  for (const auto& item : m[kFilesKey].items()) {
    const Json& f = item.value();
    const bool ok = f.is_object() && f.contains("sha256") && f["sha256"].is_string() &&
                    f["sha256"].get<std::string>().size() == 64 && f.contains("bytes") &&
                    f["bytes"].is_number_unsigned();
    if (!ok) {
      damaged(path, "field 'files' records " + item.key() + " as " + f.dump() +
                        "; expected {\"sha256\": 64 hex digits, \"bytes\": a size}");
    }
    names.push_back(item.key());
  }
  const Implied implied = implied_by(names);
  if (implied.ranks != out.world_size) {
    damaged(path, "field 'world_size' is " + std::to_string(out.world_size) +
                      " but field 'files' records the rank files of " +
                      count(implied.ranks, "rank"));
  }
  for (const auto& [k, example] : implied.replica_counts) {
    if (k != out.replicas) {
      damaged(path, "field 'replicas' is " +
                        (out.format >= kShardedFormat
                             ? std::to_string(out.replicas)
                             : std::string("missing (format ") + std::to_string(out.format) + ")") +
                        " but field 'files' records the optimizer shards of " +
                        count(k, "replica") + " (" + example + ")");
    }
  }
  return out;
}

CheckpointManifest parse_manifest(const std::string& text, const std::string& path) {
  return manifest_from_json(parse_manifest_json(text, path), path);
}

void check_manifest_dir(const CheckpointManifest& manifest, const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& item : fs::directory_iterator(dir, ec)) {
    names.push_back(item.path().filename().string());
  }
  std::sort(names.begin(), names.end());  // the example a message names: the first by name
  const Implied held = implied_by(names);
  const std::string path = manifest_path(dir);
  if (held.ranks > manifest.world_size) {
    damaged(path, "field 'world_size' is " + std::to_string(manifest.world_size) + " but " + dir +
                      " holds rank files of " + count(held.ranks, "rank") + " (up to " +
                      rank_file_name(static_cast<int>(held.ranks - 1)) + ")");
  }
  if (manifest.format >= kShardedFormat && !held.replica_counts.empty() &&
      held.replica_counts.count(manifest.replicas) == 0) {
    const auto& [k, example] = *held.replica_counts.begin();
    damaged(path, "field 'replicas' is " + std::to_string(manifest.replicas) + " but " + dir +
                      " holds the optimizer shards of " + count(k, "replica") + " (" + example +
                      ")");
  }
}

CheckpointManifest read_manifest(const std::string& dir, Json& json) {
  const std::string path = manifest_path(dir);
  std::error_code ec;
  PIPEMAT_CHECK(fs::exists(path, ec), PipelineError, "load_checkpoint: ", dir,
                " is not a complete checkpoint (no manifest.json; a save that was interrupted "
                "leaves none): give a step-NNNNNN directory that has one (--resume latest and "
                "pp::latest_checkpoint() pick the newest)");
  json = parse_manifest_json(
      read_whole_file<PipelineError>(path, "load_checkpoint", kMaxManifestBytes), path);
  CheckpointManifest manifest = manifest_from_json(json, path);
  check_manifest_dir(manifest, dir);
  return manifest;
}

}  // namespace pipemat::pp::detail
