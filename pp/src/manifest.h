#pragma once
// A checkpoint's manifest.json (Note [Checkpoint layout] in pipemat/pp/checkpoint.h): its names,
// reading it, and every check of its fields against themselves and against the files of its
// directory. Without LibTorch, so the fuzz target of the manifest builds it alone.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "pipemat/pp/checkpoint_manifest.h"

namespace pipemat::pp::detail {

// The format versions (Note [Checkpoint layout]): 1 recorded no digests (its checkpoints still
// load, without those checks); 2 records each rank file's SHA-256 and size and names the run in
// each rank file; 3 is a sharded optimizer's (Note [Sharded optimizer]): the rank files hold no
// optimizer state, each replica's shard file of each rank does, and "replicas" says how many.
// 4 stores every tensor by its global name in safetensors files and indexes each in the manifest
// ("tensors"), so it resumes on any layout; save_checkpoint writes it, the older ones still load
// on the layout that wrote them.
constexpr int kOldestFormat = 1;
constexpr int kFormat = 2;
constexpr int kShardedFormat = 3;
constexpr int kGlobalFormat = 4;
constexpr int kNewestFormat = kGlobalFormat;

// The limits a manifest's numbers are checked against: far above any job, far below what would
// make a loop over them or an allocation sized by them a hang or a crash.
constexpr int64_t kMaxManifestRanks = int64_t{1} << 20;
constexpr int64_t kMaxManifestReplicas = 65536;
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;

// The manifest's record of each rank and shard file: {"rank-0.pt": {"sha256": ..., "bytes": ...}}.
constexpr const char* kFilesKey = "files";
// The manifest's "run" object: {"id": ..., "config_digest": ...}.
constexpr const char* kRunKey = "run";

// "rank-1.pt" (format 4: "rank-1.safetensors").
std::string rank_file_name(int rank, int format = kFormat);
// Replica `replica` of `replicas`' optimizer shard of rank `rank`: "rank-1.shard-0-of-2.pt"
// (format 4: "rank-1.shard-0-of-2.safetensors").
std::string shard_file_name(int rank, int replica, int replicas, int format = kFormat);
// The manifest's tensor index (format 4): {"<name>": {"dtype", "shape", "stage", "pieces":
// [{"file", "key", "begin", "end", "sha256"}]}}, and the ties: {"<tie key>": "<name>"}.
constexpr const char* kTensorsKey = "tensors";
constexpr const char* kTiesKey = "ties";
// The largest tensor a manifest may index (elements), far above any model's.
constexpr int64_t kMaxManifestElements = int64_t{1} << 48;
// "<dir>/manifest.json".
std::string manifest_path(const std::string& dir);

// The manifest's text as JSON (Note [Strict JSON] in pipemat/core/json.h): an object, every key
// once. PipelineError naming `path`, with the parser's line, column and reason, otherwise.
nlohmann::json parse_manifest_json(const std::string& text, const std::string& path);

// What the manifest `m` (of the file `path`) says, every field checked: present, of its type,
// within its limits, consistent with the others (the stage map with the stages and ranks, the
// files record with the world size and the replicas). PipelineError naming the file and the
// field otherwise.
CheckpointManifest manifest_from_json(const nlohmann::json& m, const std::string& path);

// parse_manifest_json and manifest_from_json of a manifest's text (the fuzz target's entry).
CheckpointManifest parse_manifest(const std::string& text, const std::string& path);

// The fields of `manifest` against the files `dir` holds: rank files of more ranks than
// world_size, or optimizer shards of another replica count and none of its own, name the field.
// (A file that is missing is named when it is opened.)
void check_manifest_dir(const CheckpointManifest& manifest, const std::string& dir);

// The manifest of the checkpoint `dir`, read (Note [Opening an input file] in
// pipemat/core/files.h) and checked by all of the above; its JSON in `json`. PipelineError when
// the checkpoint is incomplete (no manifest.json) or anything is wrong with it.
CheckpointManifest read_manifest(const std::string& dir, nlohmann::json& json);

}  // namespace pipemat::pp::detail
