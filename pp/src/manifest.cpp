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
#include "pipemat/weights/safetensors.h"

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
// The integer field `name` of `m`, within [min, max]; `where` (a tensor of the index) prefixes
// the error when given.
int64_t integer(const Json& m, const char* name, int64_t min, int64_t max, const std::string& path,
                const std::string& where = "") {
  const std::string field = (where.empty() ? "" : where + ": ") + "field '" + name + "'";
  if (!m.contains(name)) damaged(path, field + " is missing");
  const Json& v = m.at(name);
  if (!integer_in(v, min, max)) {
    damaged(path, field + " is " + v.dump() + "; expected an integer from " + std::to_string(min) +
                      " to " + std::to_string(max));
  }
  return v.get<int64_t>();
}

std::string text(const Json& m, const char* name, const std::string& path,
                 const std::string& where = "") {
  const std::string field = (where.empty() ? "" : where + ": ") + "field '" + name + "'";
  if (!m.contains(name)) damaged(path, field + " is missing");
  const Json& v = m.at(name);
  if (!v.is_string()) damaged(path, field + " is " + v.dump() + "; expected a string");
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
std::optional<CheckpointFile> checkpoint_file(const std::string& name, int format) {
  constexpr std::string_view kPrefix = "rank-", kShard = ".shard-", kOf = "-of-";
  const std::string_view kSuffix = format >= kGlobalFormat ? ".safetensors" : ".pt";
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
  const std::string canonical = f.replicas == 0
                                    ? rank_file_name(f.rank, format)
                                    : shard_file_name(f.rank, f.replica, f.replicas, format);
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
Implied implied_by(const Names& names, int format) {
  Implied out;
  for (const std::string& name : names) {
    const auto f = checkpoint_file(name, format);
    if (!f) continue;
    if (f->replicas == 0) {
      out.ranks = std::max(out.ranks, static_cast<long long>(f->rank) + 1);
    } else {
      out.replica_counts.emplace(f->replicas, name);
    }
  }
  return out;
}

// Format 4: the tensor index and the ties of `m`, each entry checked (a known dtype, a shape
// whose size fits, pieces in a recorded file that cover the tensor's elements once, in order);
// into `out`.
void read_index(const Json& m, const std::string& path, CheckpointManifest& out) {
  if (!m.contains(kTensorsKey) || !m[kTensorsKey].is_object()) {
    damaged(path, std::string("field 'tensors' is ") +
                      (m.contains(kTensorsKey) ? m[kTensorsKey].dump().substr(0, 80) : "missing") +
                      "; expected the index of every tensor");
  }
  const Json& files = m[kFilesKey];
  for (const auto& item : m[kTensorsKey].items()) {
    const std::string& name = item.key();
    const Json& t = item.value();
    const std::string where = "tensor '" + name + "'";
    if (name.empty() || !t.is_object()) damaged(path, where + " is not an object");
    CheckpointTensor tensor;
    tensor.name = name;
    tensor.dtype = text(t, "dtype", path, where);
    const auto dtype = weights::dtype_from_string(tensor.dtype);
    if (!dtype) {
      damaged(path, where + " has the dtype '" + tensor.dtype +
                        "', which safetensors does not have (F64, F32, F16, BF16, I64, I32, I16, "
                        "I8, U8, BOOL)");
    }
    if (!t.contains("shape") || !t["shape"].is_array() || t["shape"].size() > 16)
      damaged(path, where + " has no shape (an array of at most 16 sizes)");
    int64_t numel = 1;
    for (const Json& d : t["shape"]) {
      if (!integer_in(d, 0, kMaxManifestElements) ||
          (d.get<int64_t>() > 0 && numel > kMaxManifestElements / d.get<int64_t>()))
        damaged(path, where + " has the shape " + t["shape"].dump() + "; too large or not sizes");
      tensor.shape.push_back(d.get<int64_t>());
      numel *= d.get<int64_t>();
    }
    tensor.stage = static_cast<int>(integer(t, "stage", -1, out.stages - 1, path, where));
    if (!t.contains("pieces") || !t["pieces"].is_array() || t["pieces"].empty())
      damaged(path, where + " has no pieces");
    int64_t at = 0;
    for (const Json& p : t["pieces"]) {
      if (!p.is_object()) damaged(path, where + " has a piece that is not an object");
      CheckpointPiece piece;
      piece.file = text(p, "file", path, where);
      piece.key = text(p, "key", path, where);
      piece.begin = integer(p, "begin", 0, numel, path, where);
      piece.end = integer(p, "end", 0, numel, path, where);
      piece.sha256 = text(p, "sha256", path, where);
      if (!files.contains(piece.file))
        damaged(path, where + " lies in " + piece.file + ", which field 'files' does not record");
      if (piece.sha256.size() != 64 || piece.key.empty())
        damaged(path, where + " has a piece without a key or a SHA-256");
      if (piece.begin != at || piece.end < piece.begin || (piece.end == at && numel > 0))
        damaged(path, where + "'s pieces do not cover its " + std::to_string(numel) +
                          " elements once, in order (a piece starts at " +
                          std::to_string(piece.begin) + ", expected " + std::to_string(at) + ")");
      at = piece.end;
      tensor.pieces.push_back(std::move(piece));
    }
    if (at != numel)
      damaged(path, where + "'s pieces cover " + std::to_string(at) + " of its " +
                        std::to_string(numel) + " elements");
    out.tensors.push_back(std::move(tensor));
  }
  if (!m.contains(kTiesKey) || !m[kTiesKey].is_object())
    damaged(path, "field 'ties' is missing; expected an object (empty without tied weights)");
  for (const auto& item : m[kTiesKey].items()) {
    if (!item.value().is_string() || out.find(item.value().get<std::string>()) == nullptr)
      damaged(path, "field 'ties' maps '" + item.key() + "' to " + item.value().dump() +
                        ", which is no tensor of the index");
    out.ties[item.key()] = item.value().get<std::string>();
  }
}

}  // namespace
}  // namespace pipemat::pp::detail

namespace pipemat::pp {

int64_t CheckpointTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const CheckpointTensor* CheckpointManifest::find(const std::string& name) const {
  const auto it =
      std::lower_bound(tensors.begin(), tensors.end(), name,
                       [](const CheckpointTensor& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

}  // namespace pipemat::pp

namespace pipemat::pp::detail {

std::string rank_file_name(int rank, int format) {
  return "rank-" + std::to_string(rank) + (format >= kGlobalFormat ? ".safetensors" : ".pt");
}

std::string shard_file_name(int rank, int replica, int replicas, int format) {
  return "rank-" + std::to_string(rank) + ".shard-" + std::to_string(replica) + "-of-" +
         std::to_string(replicas) + (format >= kGlobalFormat ? ".safetensors" : ".pt");
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
  const bool newer = format.is_number_unsigned() ? format.get<uint64_t>() > kNewestFormat
                                                 : format.get<int64_t>() > kNewestFormat;
  PIPEMAT_CHECK(!newer && format.get<int64_t>() >= kOldestFormat, PipelineError,
                "load_checkpoint: ", path, " is of format ", format.dump(),
                "; this pipemat reads formats ", kOldestFormat, " to ", kNewestFormat,
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
    out.sharded = out.format == kShardedFormat;  // format 4 says so below
  }
  if (out.format >= kGlobalFormat) {
    if (!m.contains("sharded") || !m["sharded"].is_boolean())
      damaged(path, "field 'sharded' is " +
                        (m.contains("sharded") ? m["sharded"].dump() : "missing") +
                        "; expected true or false");
    out.sharded = m["sharded"].get<bool>();
    out.optimizer = text(m, "optimizer", path);
    out.seed = text(m, "seed", path);
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
    out.files.push_back({item.key(), f["sha256"].get<std::string>(), f["bytes"].get<uint64_t>()});
  }
  const Implied implied = implied_by(names, out.format);
  if (implied.ranks != out.world_size) {
    damaged(path, "field 'world_size' is " + std::to_string(out.world_size) +
                      " but field 'files' records the rank files of " +
                      count(implied.ranks, "rank"));
  }
  if (out.format >= kGlobalFormat) read_index(m, path, out);
  for (const auto& [k, example] : implied.replica_counts) {
    if (out.format >= kGlobalFormat && !out.sharded) {
      damaged(path, "field 'sharded' is false but field 'files' records the optimizer shards of " +
                        count(k, "replica") + " (" + example + ")");
    }
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
  const Implied held = implied_by(names, manifest.format);
  const std::string path = manifest_path(dir);
  if (held.ranks > manifest.world_size) {
    damaged(path, "field 'world_size' is " + std::to_string(manifest.world_size) + " but " + dir +
                      " holds rank files of " + count(held.ranks, "rank") + " (up to " +
                      rank_file_name(static_cast<int>(held.ranks - 1), manifest.format) + ")");
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
