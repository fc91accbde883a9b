// Saving a checkpoint (format 4, Note [Checkpoint layout] in pipemat/pp/checkpoint.h): every
// writer's safetensors file, its index, and the manifest rank 0 writes from every index.

#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <streambuf>
#include <string>
#include <vector>

#include "checkpoint_common.h"
#include "checkpoint_files.h"
#include "checkpoint_state.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/pp/checkpoint.h"

namespace pipemat::pp {
namespace {

namespace fs = std::filesystem;
using detail::kGlobalFormat;
using detail::manifest_path;
using detail::NamedTensor;
using detail::publish;
using detail::rank_file_name;
using detail::shard_file_name;
using Json = nlohmann::json;

// Rank 0, before a save into `dir`: a complete checkpoint of another run there is refused; one
// of the same run (a resumed run passing that step again) loses its manifest first, so the
// rank files written next never sit beside the old manifest. Returns whether `dir` is new.
bool prepare_step_dir(const std::string& dir, const CheckpointRun& run) {
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  if (existed && fs::exists(manifest_path(dir), ec)) {
    const CheckpointManifest old = read_checkpoint_manifest(dir);
    PIPEMAT_CHECK(!old.run_id.empty() && old.run_id == run.id, PipelineError,
                  "save_checkpoint: ", dir, " holds a complete checkpoint of another run (",
                  old.run_id.empty() ? std::string("written before checkpoints named their run")
                                     : "run " + old.run_id,
                  "); this run (", run.id, ") never overwrites it: save into another directory");
    fs::remove(manifest_path(dir), ec);
    PIPEMAT_CHECK(!ec, PipelineError, "save_checkpoint: cannot remove the old ", manifest_path(dir),
                  ": ", ec.message());
    detail::sync_path(dir);
  }
  fs::create_directories(dir, ec);
  PIPEMAT_CHECK(!ec, PipelineError, "save_checkpoint: cannot create ", dir, ": ", ec.message());
  return !existed;
}

// A stream into a file descriptor that digests what it writes. A write that fails keeps its
// error (error()) and drops the rest, so the writer above it never sees a failure midway.
class DigestingFile : public std::streambuf {
 public:
  explicit DigestingFile(int fd) : fd_(fd) {}
  int error() const { return error_; }
  FileDigest digest() {
    FileDigest d;
    d.sha256 = sha_.finish_hex();
    d.bytes = bytes_;
    return d;
  }

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    put(s, static_cast<size_t>(n));
    return n;
  }
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    const char ch = traits_type::to_char_type(c);
    put(&ch, 1);
    return c;
  }

 private:
  void put(const char* at, size_t n) {
    if (error_ != 0) return;
    sha_.update(at, n);
    bytes_ += n;
    error_ = write_fully(fd_, at, n);
  }
  int fd_;
  int error_ = 0;
  Sha256 sha_;
  uint64_t bytes_ = 0;
};

// The tensors `tensors` as the safetensors file `name` of `dir`: written to a temporary name,
// synced and published. Returns the file's entry for rank 0: {"file", "sha256", "bytes",
// "tensors": [{"name", "dtype", "shape", "stage", "begin", "end", "key", "sha256"}]}, the
// digests computed from the bytes written.
Json write_state_file(const Pipeline& pipeline, const std::string& dir, const std::string& name,
                      const std::vector<NamedTensor>& tensors, const CheckpointRun& run) {
  const int rank = pipeline.rank();
  const std::string final_path = (fs::path(dir) / name).string();
  std::error_code ec;
  fs::create_directories(dir, ec);  // the ranks of other hosts
  PIPEMAT_CHECK(!ec, PipelineError, "save_checkpoint: rank ", rank, " cannot create ", dir, ": ",
                ec.message());
  std::vector<at::Tensor> host;  // alive until the file is written
  std::vector<weights::TensorBytes> bytes;
  Json index = Json::array();
  for (const NamedTensor& t : tensors) {
    int64_t whole = 1;
    for (int64_t d : t.shape) whole *= d;
    const bool piece = t.begin != 0 || t.end != whole;
    // A piece that is the whole tensor (a sharded parameter one replica holds all of) is stored
    // in the tensor's shape, under its name.
    host.push_back(piece ? t.value.to(at::kCPU).contiguous()
                         : t.value.to(at::kCPU).contiguous().reshape(t.shape));
    const at::Tensor& h = host.back();
    const std::string key = piece ? t.name + "@" + std::to_string(t.begin) : t.name;
    const std::string_view data(static_cast<const char*>(h.data_ptr()),
                                static_cast<size_t>(h.nbytes()));
    const weights::Dtype dtype = safetensors_dtype(h.scalar_type(), "save_checkpoint: " + t.what);
    bytes.push_back({key, dtype, h.sizes().vec(), data});
    index.push_back({{"name", t.name},
                     {"dtype", weights::to_string(dtype)},
                     {"shape", t.shape},
                     {"stage", t.stage},
                     {"begin", t.begin},
                     {"end", t.end},
                     {"key", key},
                     {"sha256", sha256_hex(data)}});
  }
  const std::string tmp = final_path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  PIPEMAT_CHECK(fd >= 0, PipelineError, "save_checkpoint: rank ", rank, " cannot create ", tmp,
                ": ", std::strerror(errno));
  DigestingFile file(fd);
  try {
    std::ostream out(&file);
    weights::write_safetensors(
        out, std::move(bytes),
        {{"pipemat.run", run.id}, {"pipemat.step", std::to_string(pipeline.step())}});
  } catch (const std::exception& e) {
    ::close(fd);
    fs::remove(tmp, ec);
    PIPEMAT_THROW(PipelineError, "save_checkpoint: rank ", rank, " cannot write ", tmp, ": ",
                  std::string(e.what()).substr(0, 300));
  }
  int error = file.error();
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error != 0) {
    fs::remove(tmp, ec);
    PIPEMAT_THROW(PipelineError, "save_checkpoint: rank ", rank, " cannot write ", tmp, ": ",
                  std::strerror(error));
  }
  detail::maybe_crash("rank-file", pipeline.step(), rank, tmp);
  publish(tmp, final_path);
  const FileDigest digest = file.digest();
  return {{"file", name}, {"sha256", digest.sha256}, {"bytes", digest.bytes}, {"tensors", index}};
}

// Rank 0: the manifest from every rank's part ({"run", "ties", "files": [file entries]}, in rank
// order), written last. PipelineError when the parts disagree: another run, or two stages that
// store one name (only the copies of a tied weight share a name, and those are stored once).
void write_manifest(const Pipeline& pipeline, const std::string& dir, const CheckpointRun& run,
                    const std::string& metadata, const std::vector<Json>& parts) {
  Json m = detail::layout_of(pipeline, kGlobalFormat);
  m["replicas"] = detail::PipelineAccess::replicas(pipeline);
  m["sharded"] = pipeline.shards_optimizer();
  m["optimizer"] = detail::PipelineAccess::optimizer_kind(pipeline);
  m["seed"] = detail::PipelineAccess::seed(pipeline);
  m["metadata"] = metadata;
  m[detail::kRunKey] = {{"id", run.id}, {"config_digest", run.config_digest}};
  Json files = Json::object(), tensors = Json::object(), ties = Json::object();
  for (size_t r = 0; r < parts.size(); ++r) {
    const Json& part = parts[r];
    PIPEMAT_CHECK(part.at("run") == run.id, PipelineError, "save_checkpoint: rank ", r, " saved ",
                  dir, " as run '", part.at("run").get<std::string>(), "' but rank 0 as run '",
                  run.id,
                  "'; every rank must pass the same CheckpointRun (make it once, e.g. on rank 0, "
                  "and share it); the checkpoint stays incomplete");
    for (const auto& [key, name] : part.at("ties").items()) ties[key] = name;
    for (const Json& f : part.at("files")) {
      files[f.at("file").get<std::string>()] = {{"sha256", f.at("sha256")},
                                                {"bytes", f.at("bytes")}};
      for (const Json& t : f.at("tensors")) {
        const std::string name = t.at("name");
        Json& entry = tensors[name];
        if (entry.is_null()) {
          entry = {{"dtype", t.at("dtype")},
                   {"shape", t.at("shape")},
                   {"stage", t.at("stage")},
                   {"pieces", Json::array()}};
        }
        PIPEMAT_CHECK(entry["stage"] == t.at("stage") && entry["shape"] == t.at("shape"),
                      PipelineError, "save_checkpoint: stages ", entry["stage"].dump(), " and ",
                      t.at("stage").dump(), " both hold a tensor named '", name,
                      "'; two stages give one name only to the copies of a tied weight "
                      "(PipelineStage::tied), which is stored once (Note [Global names])");
        entry["pieces"].push_back({{"file", f.at("file")},
                                   {"key", t.at("key")},
                                   {"begin", t.at("begin")},
                                   {"end", t.at("end")},
                                   {"sha256", t.at("sha256")}});
      }
    }
  }
  for (auto& [name, entry] : tensors.items()) {
    Json& pieces = entry["pieces"];
    std::sort(pieces.begin(), pieces.end(),
              [](const Json& a, const Json& b) { return a.at("begin") < b.at("begin"); });
    int64_t at = 0;
    for (const Json& p : pieces) {
      PIPEMAT_CHECK(p.at("begin").get<int64_t>() == at, PipelineError, "save_checkpoint: '", name,
                    "' is stored twice or in part (a piece at ", p.at("begin").dump(),
                    ", expected ", at,
                    "); two stages give one name only to the copies of a tied "
                    "weight");
      at = p.at("end").get<int64_t>();
    }
    int64_t numel = 1;
    for (const Json& d : entry.at("shape")) numel *= d.get<int64_t>();
    PIPEMAT_CHECK(at == numel, PipelineError, "save_checkpoint: '", name, "' is stored in part (",
                  at, " of its ", numel, " elements)");
  }
  m[detail::kFilesKey] = files;
  m[detail::kTensorsKey] = tensors;
  m[detail::kTiesKey] = ties;
  const std::string manifest = manifest_path(dir);
  {
    std::ofstream out(manifest + ".tmp");
    out << m.dump(1) << "\n";
    out.flush();
    PIPEMAT_CHECK(out.good(), PipelineError, "save_checkpoint: cannot write ", manifest,
                  ".tmp: ", std::strerror(errno));
  }
  publish(manifest + ".tmp", manifest);
}

// Rank 0, once `written` is complete: removes the oldest complete checkpoints of `run` beyond
// the newest keep_last, `written` counted first and always kept. A removal that fails is a
// warning: the new checkpoint is complete, nothing is lost.
void prune(const std::string& root, const std::string& written, const CheckpointRun& run,
           int keep_last) {
  std::vector<CheckpointEntry> same_run;
  for (const CheckpointEntry& e : list_checkpoints(root)) {
    if (e.complete && e.run_id == run.id && fs::path(e.dir) != fs::path(written)) {
      same_run.push_back(e);
    }
  }
  // Newest first: keep keep_last - 1 of them beside the new one.
  std::reverse(same_run.begin(), same_run.end());
  for (size_t i = static_cast<size_t>(keep_last) - 1; i < same_run.size(); ++i) {
    try {
      remove_checkpoint(same_run[i].dir);
    } catch (const PipelineError& e) {
      std::fprintf(stderr, "pipemat: warning: keep_last: %s\n", e.what());
    }
  }
}

// The part of one writer: its files' entries (each from write_state_file), the ties it stores
// and its run, as text ("+" then JSON; "-" when it could not write).
std::string part_text(const std::vector<Json>& files,
                      const std::map<std::string, std::string>& ties, const CheckpointRun& run) {
  return "+" + Json{{"run", run.id}, {"ties", ties}, {"files", files}}.dump();
}

Json parse_part(const std::string& text) {
  PIPEMAT_INTERNAL_ASSERT(!text.empty() && text[0] == '+', "a part that failed is not parsed");
  return Json::parse(text.substr(1));
}

// This replica's optimizer shard file (Note [Sharded optimizer]): its pieces' state.
Json write_shard(Pipeline& pipeline, const std::string& dir, const CheckpointRun& run) {
  std::map<std::string, std::string> none;
  const std::vector<NamedTensor> state =
      detail::PipelineAccess::saved(pipeline, /*weights=*/false, /*optimizer=*/true, none);
  const comm::Transport& data = *pipeline.data_group();
  return write_state_file(
      pipeline, dir,
      shard_file_name(pipeline.rank(), data.rank(), data.world_size(), kGlobalFormat), state, run);
}

// A replica other than 0 (Note [Sharded optimizer]): waits for replica 0 of its rank to prepare
// `dir`, writes its optimizer shard there, sends replica 0 its entry (or that it failed) and
// waits for how the save ended; the same outcome as replica 0's, or its own error.
std::string save_shard(Pipeline& pipeline, comm::Transport& data, const std::string& dir,
                       const CheckpointRun& run) {
  const int rank = pipeline.rank();
  uint8_t go = 0;
  data.recv(0, detail::kAgreementTag, &go, 1)->wait();
  PIPEMAT_CHECK(go == 1, PeerFailedError, "save_checkpoint: replica 0 of pipeline rank ", rank,
                " could not prepare ", dir, " (its error says why); nothing was written");
  std::string text = "-";
  std::exception_ptr own;
  try {
    text = "+" + write_shard(pipeline, dir, run).dump();
  } catch (const std::exception&) {
    own = std::current_exception();
  }
  detail::send_text(data, 0, text);
  uint8_t done = 0;
  data.recv(0, detail::kAgreementTag, &done, 1)->wait();
  if (own) std::rethrow_exception(own);
  PIPEMAT_CHECK(done == 1, PeerFailedError, "save_checkpoint: replica 0 of pipeline rank ", rank,
                " could not complete ", dir, " (its error says why); the save was abandoned");
  return dir;
}

// Replica 0 of this rank: its own files (the rank file; sharded, also its optimizer shard), then
// every other replica's shard entry. PipelineError naming the first that failed.
std::vector<Json> write_own_files(Pipeline& pipeline, comm::Transport* data, const std::string& dir,
                                  const CheckpointRun& run,
                                  std::map<std::string, std::string>& ties) {
  std::vector<Json> files;
  std::exception_ptr first;
  try {
    const std::vector<NamedTensor> state = detail::PipelineAccess::saved(
        pipeline, /*weights=*/true, /*optimizer=*/data == nullptr, ties);
    files.push_back(write_state_file(pipeline, dir, rank_file_name(pipeline.rank(), kGlobalFormat),
                                     state, run));
    if (data != nullptr) files.push_back(write_shard(pipeline, dir, run));
  } catch (const std::exception&) {
    first = std::current_exception();
  }
  // The replicas' entries are received even when this rank's own files failed.
  for (int d = 1; data != nullptr && d < data->world_size(); ++d) {
    const std::string text = detail::recv_text(*data, d);
    if (!text.empty() && text[0] == '+') {
      files.push_back(parse_part(text));
    } else if (!first) {
      try {
        PIPEMAT_THROW(
            PipelineError, "save_checkpoint: replica ", d, " of pipeline rank ", pipeline.rank(),
            " could not write its optimizer shard ",
            (fs::path(dir) / shard_file_name(pipeline.rank(), d, data->world_size(), kGlobalFormat))
                .string(),
            " (its error says why)");
      } catch (const std::exception&) {
        first = std::current_exception();
      }
    }
  }
  if (first) std::rethrow_exception(first);
  return files;
}

// Every rank's part on rank 0, in rank order (the others get an empty list).
std::vector<Json> gather_parts(comm::Transport& transport, const std::string& mine) {
  if (transport.rank() != 0) {
    detail::send_text(transport, 0, mine);
    return {};
  }
  std::vector<Json> out{parse_part(mine)};
  for (int r = 1; r < transport.world_size(); ++r)
    out.push_back(parse_part(detail::recv_text(transport, r)));
  return out;
}

}  // namespace

std::string save_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& root,
                            const CheckpointRun& run, int keep_last, const std::string& metadata) {
  PIPEMAT_CHECK(!root.empty(), ConfigError, "save_checkpoint: the checkpoint directory is empty");
  PIPEMAT_CHECK(!run.id.empty(), ConfigError,
                "save_checkpoint: the run has no id: make one with pp::new_checkpoint_run() when "
                "a run starts, or continue a checkpoint's with pp::resumed_run(dir)");
  PIPEMAT_CHECK(keep_last >= 0, ConfigError, "save_checkpoint: keep_last is ", keep_last,
                "; expected 0 (keep all) or more");
  const std::string dir = (fs::path(root) / detail::step_dir_name(pipeline.step())).string();
  const int rank = pipeline.rank();
  // Note [Sharded optimizer]: every replica writes its optimizer shard; replica 0 the rest.
  comm::Transport* data = pipeline.shards_optimizer() ? pipeline.data_group() : nullptr;
  if (data != nullptr && data->rank() != 0) return save_shard(pipeline, *data, dir, run);
  // Replica 0 tells the other replicas of this rank that they may write (after the directory is
  // prepared) and how the save ended (whatever it is: they wait for both).
  const auto tell = [&](uint8_t what) {
    if (data == nullptr) return;
    std::vector<comm::WorkPtr> sends;
    for (int d = 1; d < data->world_size(); ++d)
      sends.push_back(data->send(d, detail::kAgreementTag, &what, 1));
    for (auto& w : sends) w->wait();
  };
  bool created = false;
  try {
    detail::agree_on(
        transport, "save_checkpoint",
        [&] {
          if (rank == 0) created = prepare_step_dir(dir, run);
        },
        [&](int) {
          return "refused to save into " + dir + " (its error says why); nothing was written";
        });
  } catch (...) {
    tell(0);
    throw;
  }
  tell(1);
  try {
    std::vector<Json> parts;
    try {
      std::vector<Json> files;
      std::map<std::string, std::string> ties;
      detail::agree_on(
          transport, "save_checkpoint",
          [&] { files = write_own_files(pipeline, data, dir, run, ties); },
          [&](int r) {
            return "could not write its part of " + dir + " (" +
                   (fs::path(dir) / rank_file_name(r, kGlobalFormat)).string() +
                   (data ? " or a replica's optimizer shard" : "") +
                   "; its error says why); the save was abandoned";
          });
      parts = gather_parts(transport, part_text(files, ties, run));
    } catch (...) {
      // Every rank is done writing: an incomplete directory this save made goes away.
      std::error_code ec;
      if (rank == 0 && created) fs::remove_all(dir, ec);
      throw;
    }
    detail::maybe_crash("manifest", pipeline.step(), rank);
    detail::agree_on(
        transport, "save_checkpoint",
        [&] {
          if (rank == 0) write_manifest(pipeline, dir, run, metadata, parts);
        },
        [&](int) { return "could not write the manifest of " + dir + " (its error says why)"; });
  } catch (...) {
    tell(0);
    throw;
  }
  tell(1);
  if (rank == 0 && keep_last > 0) prune(root, dir, run, keep_last);
  return dir;
}

}  // namespace pipemat::pp
