#include "pipemat/pp/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "checkpoint_files.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/finite.h"

namespace pipemat::pp {
namespace {

namespace fs = std::filesystem;
using detail::kFilesKey;
using detail::kFormat;
using detail::kShardedFormat;
using detail::manifest_path;
using detail::publish;
using detail::rank_file_name;
using detail::shard_file_name;
using detail::step_dir_name;

std::string rank_file(const std::string& dir, int rank) {
  return (fs::path(dir) / rank_file_name(rank)).string();
}

std::string key_of(const std::string& path) {
  std::string key = path;
  std::replace(key.begin(), key.end(), '.', '|');
  return key;
}

// Note [Non-finite values at load]: PipelineError naming the tensor `name` of `file` unless
// every element of `value` is finite.
void check_finite(const at::Tensor& value, const std::string& file, const std::string& name) {
  const auto bad = non_finite(value);
  PIPEMAT_CHECK(!bad, PipelineError, "load_checkpoint: ", file, ": tensor '", name, "' ", *bad,
                "; ", kNonFiniteAdvice);
}

// Reads the parameters and buffers of stage `s` of `module` from `archive` (the file `file`)
// into `copies` (destination, value), checking names, shapes and dtypes, and with `finite` the
// values (where the whole archive was not checked as it was loaded: load_archive).
void read_stage(torch::serialize::InputArchive& archive, const std::string& file, int s,
                const torch::nn::Module& module,
                std::vector<std::pair<at::Tensor, at::Tensor>>& copies, bool finite) {
  const auto read = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
    at::Tensor value;
    const std::string key = kind + "/" + std::to_string(s) + "/" + key_of(name);
    PIPEMAT_CHECK(archive.try_read(key, value), PipelineError, "load_checkpoint: ", file,
                  " has no ", kind == "params" ? "parameter" : "buffer", " '", name, "' of stage ",
                  s, "; it was written by another model");
    PIPEMAT_CHECK(value.sizes() == t.sizes() && value.scalar_type() == t.scalar_type(),
                  PipelineError, "load_checkpoint: ", file, ": stage ", s, " '", name, "' is ",
                  c10::toString(value.scalar_type()), " ", value.sizes(), " in the checkpoint but ",
                  c10::toString(t.scalar_type()), " ", t.sizes(), " in this model");
    if (finite) check_finite(value, file, kind + "/" + std::to_string(s) + "/" + name);
    copies.emplace_back(t, value);
  };
  for (const auto& p : module.named_parameters()) read("params", p.key(), p.value());
  for (const auto& b : module.named_buffers()) read("buffers", b.key(), b.value());
}

// Note [Non-finite values at load]: every floating-point tensor of `archive` (the file `file`),
// nested archives (the optimizer's state) included, under the key path `prefix`.
void check_archive_finite(torch::serialize::InputArchive& archive, const std::string& file,
                          const std::string& prefix = "") {
  for (const std::string& key : archive.keys()) {
    std::string name = prefix + key;
    std::replace(name.begin(), name.end(), '|', '.');
    at::Tensor tensor;
    torch::serialize::InputArchive nested;
    if (archive.try_read(key, tensor)) {
      check_finite(tensor, file, name);
    } else if (archive.try_read(key, nested)) {
      check_archive_finite(nested, file, name + "/");
    }
  }
}

// Loads the archive of `file` (opened by open_checkpoint_file); PipelineError naming it when it
// is damaged, or unless `allow_non_finite` when a tensor of it is not finite.
void load_archive(torch::serialize::InputArchive& archive, const InputFile& file,
                  bool allow_non_finite) {
  const auto read = [&file](uint64_t pos, void* buf, size_t nbytes) -> size_t {
    const int64_t n = file.read_at(static_cast<int64_t>(pos), buf, static_cast<int64_t>(nbytes));
    PIPEMAT_CHECK(n >= 0, PipelineError, "load_checkpoint: reading ", file.path(),
                  " failed: ", std::strerror(errno));
    return static_cast<size_t>(n);
  };
  try {
    archive.load_from(read, [&file] { return static_cast<size_t>(file.size()); });
  } catch (const PipelineError&) {
    throw;
  } catch (const std::exception& e) {
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", file.path(),
                  " cannot be read (truncated or "
                  "damaged): ",
                  std::string(e.what()).substr(0, 200));
  }
  if (!allow_non_finite) check_archive_finite(archive, file.path());
}

// Note [Verified checkpoints]
// Nothing of a rank file is used unless it is, byte for byte, the file its rank wrote. The
// writer digests the bytes as they go to the file (SHA-256, the archive's own per-record CRCs
// are not checked by LibTorch's reader), the ranks send their digests to rank 0, and the
// manifest records each rank file's digest and size: a flipped byte, a truncated or extended
// file, or a file copied in from another checkpoint fails the check on load, before the
// archive is opened, naming the file, both digests and both sizes. Each rank file also names
// its run and step, checked against the manifest, so a rank file of another run cannot be
// taken for this one's even where the manifest itself was rewritten by hand. Checkpoints of
// format 1 (before the digests) load without these two checks.
// Opens `name` of the checkpoint in `dir` (Note [Opening an input file] in pipemat/core/files.h:
// a FIFO or a device is refused at once) and, from format 2 on, verifies it against the
// manifest `m`: its size first (a file of another size is not read), then its SHA-256. The
// archive is then read from the same open file (load_archive), never from the path again.
InputFile open_checkpoint_file(const nlohmann::json& m, int format, const std::string& dir,
                               const std::string& name, int rank) {
  const std::string file = (fs::path(dir) / name).string();
  const std::string manifest = manifest_path(dir);
  std::error_code ec;
  PIPEMAT_CHECK(fs::exists(file, ec), PipelineError, "load_checkpoint: ", file,
                " is missing: the checkpoint has no state for rank ", rank);
  InputFile in = open_input_file<PipelineError>(file, "load_checkpoint");
  if (format < 2) return in;
  std::string want;
  uint64_t want_bytes = 0;
  try {
    want = m.at(kFilesKey).at(name).at("sha256").get<std::string>();
    want_bytes = m.at(kFilesKey).at(name).at("bytes").get<uint64_t>();
  } catch (const nlohmann::json::exception&) {
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", manifest, " records no digest of ", name,
                  "; the manifest is damaged");
  }
  const std::string damaged = "load_checkpoint: " + file + " is damaged or was replaced: ";
  const std::string recorded = manifest + " recorded " + want.substr(0, 16) + "... (" +
                               std::to_string(want_bytes) +
                               " bytes) when it was written; nothing was loaded. Load an older "
                               "checkpoint";
  PIPEMAT_CHECK(static_cast<uint64_t>(in.size()) == want_bytes, PipelineError, damaged, "it holds ",
                in.size(), " bytes but ", recorded);
  const FileDigest got = sha256_file(in);
  PIPEMAT_CHECK(got.sha256 == want && got.bytes == want_bytes, PipelineError, damaged,
                "its SHA-256 is ", got.sha256.substr(0, 16), "... (", got.bytes, " bytes) but ",
                recorded);
  return in;
}

// The run and step a rank file names, against the manifest's (format 2 and later).
void check_rank_file_run(torch::serialize::InputArchive& archive, const nlohmann::json& m,
                         int format, const std::string& file) {
  if (format < 2) return;
  c10::IValue run;
  PIPEMAT_CHECK(archive.try_read("run", run) && run.isString(), PipelineError,
                "load_checkpoint: ", file, " names no run; it was not written with this manifest");
  std::string want;
  if (m.contains(detail::kRunKey) && m[detail::kRunKey].contains("id") &&
      m[detail::kRunKey]["id"].is_string()) {
    want = m[detail::kRunKey]["id"].get<std::string>();
  }
  PIPEMAT_CHECK(
      run.toStringRef() == want, PipelineError, "load_checkpoint: ", file,
      " is a rank file of run ", run.toStringRef(), ", but the manifest beside it is of run ",
      want.empty() ? std::string("(none)") : want, "; a rank file of another run is never loaded");
}

// Note [Checkpoint crash injection]
// PIPEMAT_TEST_KILL_IN_CHECKPOINT=STEP:POINT[:RANK] makes the save of step STEP kill its own
// process with SIGKILL (no cleanup, no unwinding: what a power cut or the OOM killer does) at
// POINT: "rank-file" with half of the rank file written to its temporary name, "manifest"
// after every rank file is published and before the manifest. Only on rank RANK when given.
// The crash-safety test (tests/e2e/checkpoint_crash.sh) uses it; unset, nothing happens.
void maybe_crash(const char* point, int64_t step, int rank, const std::string& tmp = "") {
  const char* spec = std::getenv("PIPEMAT_TEST_KILL_IN_CHECKPOINT");
  if (spec == nullptr) return;
  const std::string text = spec;
  const auto colon = text.find(':');
  if (colon == std::string::npos) return;
  const std::string rest = text.substr(colon + 1);
  const auto colon2 = rest.find(':');
  const std::string where = rest.substr(0, colon2);
  if (std::atoll(text.substr(0, colon).c_str()) != step || where != point) return;
  if (colon2 != std::string::npos && std::atoi(rest.substr(colon2 + 1).c_str()) != rank) return;
  if (!tmp.empty()) {
    std::error_code ec;
    const auto size = fs::file_size(tmp, ec);
    if (!ec) fs::resize_file(tmp, size / 2, ec);
  }
  std::fprintf(stderr,
               "pipemat: PIPEMAT_TEST_KILL_IN_CHECKPOINT: rank %d killed in the save of "
               "step %lld at %s\n",
               rank, static_cast<long long>(step), point);
  std::fflush(stderr);
  std::raise(SIGKILL);
}

nlohmann::json manifest_of(const Pipeline& pipeline) {
  const schedule::Schedule& plan = pipeline.schedule();
  nlohmann::json j;
  j["format"] = kFormat;
  j["pipemat"] = "0.1.0";
  j["step"] = pipeline.step();
  j["world_size"] = plan.ranks_count;
  j["schedule_kind"] = schedule::to_string(plan.kind);
  j["stages"] = plan.stages_count;
  j["micro_batches"] = plan.micro_batches;
  j["stage_to_rank"] = plan.stage_to_rank;
  return j;
}

}  // namespace

namespace {

// Note [Checkpoint agreement]
// At each point where ranks must act together (every rank can load its part; every rank wrote
// its file; rank 0 may write the manifest), every rank tells every other whether its part
// succeeded: one byte each, tag kAgreementTag, between steps when no pipeline message is in
// flight. This is also the barrier there. A rank whose part failed throws its own error, the
// others one naming it, so every rank ends a load or a save the same way and none waits for a
// peer that has given up.
constexpr int kAgreementTag = comm::kMaxUserTag;

// The lowest rank whose part failed (this one when `failed`), or -1 when every part succeeded.
int first_failed_rank(comm::Transport& transport, bool failed) {
  const uint8_t mine = failed ? 1 : 0;
  std::vector<uint8_t> theirs(static_cast<size_t>(transport.world_size()), 0);
  theirs[static_cast<size_t>(transport.rank())] = mine;
  std::vector<comm::WorkPtr> works;
  for (int r = 0; r < transport.world_size(); ++r) {
    if (r == transport.rank()) continue;
    works.push_back(transport.send(r, kAgreementTag, &mine, 1));
    works.push_back(transport.recv(r, kAgreementTag, &theirs[static_cast<size_t>(r)], 1));
  }
  for (auto& w : works) w->wait();
  for (int r = 0; r < transport.world_size(); ++r) {
    if (theirs[static_cast<size_t>(r)] != 0) return r;
  }
  return -1;
}

// Runs `part` on this rank, then agrees (Note [Checkpoint agreement]): rethrows this rank's own
// error, or throws PeerFailedError "<what>: rank R <failed_part(R)>" when another rank's part
// failed.
template <typename Part>
void agree_on(comm::Transport& transport, const char* what, Part&& part,
              const std::function<std::string(int)>& failed_part) {
  std::exception_ptr error;
  try {
    part();
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  const int failed = first_failed_rank(transport, error != nullptr);
  if (error) std::rethrow_exception(error);
  PIPEMAT_CHECK(failed < 0, PeerFailedError, what, ": rank ", failed, " ", failed_part(failed));
}

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

// This rank's file of the checkpoint in `dir` for `run`, written to a temporary name and
// published; returns its digest, computed from the bytes as they were written.
FileDigest write_archive_file(const Pipeline& pipeline, torch::serialize::OutputArchive& archive,
                              const std::string& final_path);

// This rank's file of the checkpoint in `dir` for `run`; `state` null: no optimizer state in it
// (Note [Sharded optimizer]: the shard files hold it).
FileDigest write_rank_file(Pipeline& pipeline, torch::optim::Optimizer* state,
                           const std::string& dir, const CheckpointRun& run) {
  torch::serialize::OutputArchive archive;
  archive.write("step", at::tensor({pipeline.step()}, at::kLong));
  archive.write("run", c10::IValue(run.id));
  const std::vector<int> mine = pipeline.stages();
  const std::vector<int64_t> stages(mine.begin(), mine.end());
  archive.write("stages", at::tensor(stages, at::kLong));
  for (int s : mine) {
    const auto& module = *pipeline.stage(s).module;
    for (const auto& p : module.named_parameters()) {
      archive.write("params/" + std::to_string(s) + "/" + key_of(p.key()), p.value().detach());
    }
    for (const auto& b : module.named_buffers()) {
      archive.write("buffers/" + std::to_string(s) + "/" + key_of(b.key()), b.value(), true);
    }
  }
  if (state != nullptr) {
    torch::serialize::OutputArchive optimizer;
    state->save(optimizer);
    archive.write("optimizer", optimizer);
  }
  if (pipeline.generator().defined()) {
    archive.write("rng", pipeline.generator().get_state());
  }
  return write_archive_file(pipeline, archive, rank_file(dir, pipeline.rank()));
}

// This replica's optimizer shard of its rank (Note [Sharded optimizer]): step, run and the shard.
FileDigest write_shard_file(const Pipeline& pipeline, const std::string& dir,
                            const CheckpointRun& run) {
  const comm::Transport& data = *pipeline.data_group();
  torch::serialize::OutputArchive archive;
  archive.write("step", at::tensor({pipeline.step()}, at::kLong));
  archive.write("run", c10::IValue(run.id));
  torch::serialize::OutputArchive shard;
  pipeline.save_optimizer_shard(shard);
  archive.write("shard", shard);
  const std::string name = shard_file_name(pipeline.rank(), data.rank(), data.world_size());
  return write_archive_file(pipeline, archive, (fs::path(dir) / name).string());
}

// `archive` to `final_path`: written to a temporary name and published; returns its digest,
// computed from the bytes as they were written.
FileDigest write_archive_file(const Pipeline& pipeline, torch::serialize::OutputArchive& archive,
                              const std::string& final_path) {
  const int rank = pipeline.rank();
  std::error_code ec;
  fs::create_directories(fs::path(final_path).parent_path(), ec);  // the ranks of other hosts
  PIPEMAT_CHECK(!ec, PipelineError, "save_checkpoint: rank ", rank, " cannot create ",
                fs::path(final_path).parent_path().string(), ": ", ec.message());
  const std::string tmp = final_path + ".tmp";
  // LibTorch's archive writer ends with std::terminate when a write fails inside it (its
  // destructor writes the archive's end and throws), so it writes through this function, which
  // never fails towards it: the first error is kept, the rest of the archive dropped, and the
  // error reported here once the writer is done.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  PIPEMAT_CHECK(fd >= 0, PipelineError, "save_checkpoint: rank ", rank, " cannot create ", tmp,
                ": ", std::strerror(errno));
  int write_error = 0;
  Sha256 sha;
  FileDigest digest;
  try {
    archive.save_to([&](const void* data, size_t n) -> size_t {
      if (write_error == 0) {
        sha.update(data, n);
        digest.bytes += n;
      }
      const char* at = static_cast<const char*>(data);
      for (size_t left = n; left > 0 && write_error == 0;) {
        const ssize_t wrote = ::write(fd, at, left);
        if (wrote < 0 && errno == EINTR) continue;
        if (wrote <= 0) {
          write_error = wrote < 0 ? errno : EIO;
          break;
        }
        at += wrote;
        left -= static_cast<size_t>(wrote);
      }
      return n;
    });
  } catch (const std::exception& e) {
    ::close(fd);
    fs::remove(tmp, ec);
    PIPEMAT_THROW(PipelineError, "save_checkpoint: rank ", rank,
                  " cannot serialize its state: ", std::string(e.what()).substr(0, 300));
  }
  if (write_error == 0 && ::fsync(fd) != 0) write_error = errno;
  if (::close(fd) != 0 && write_error == 0) write_error = errno;
  if (write_error != 0) {
    fs::remove(tmp, ec);
    PIPEMAT_THROW(PipelineError, "save_checkpoint: rank ", rank, " cannot write ", tmp, ": ",
                  std::strerror(write_error));
  }
  maybe_crash("rank-file", pipeline.step(), rank, tmp);
  publish(tmp, final_path);
  digest.sha256 = sha.finish_hex();
  return digest;
}

// What each rank's file holds, as rank 0 learns it for the manifest.
struct RankPart {
  FileDigest digest;
  std::string run_id;              // the run the rank saved as (the first 64 characters)
  std::vector<FileDigest> shards;  // Note [Sharded optimizer]: its replicas' shard files
};

// A file's digest on the wire; `ok` 0: the file could not be written.
struct DigestWire {
  char sha256[64];
  uint64_t bytes;
  uint8_t ok;
};
DigestWire to_wire(const FileDigest& d) {
  DigestWire w{};
  PIPEMAT_INTERNAL_ASSERT(d.sha256.size() == sizeof(w.sha256), "a SHA-256 has 64 digits");
  std::memcpy(w.sha256, d.sha256.data(), sizeof(w.sha256));
  w.bytes = d.bytes;
  w.ok = 1;
  return w;
}
FileDigest from_wire(const DigestWire& w) {
  return {std::string(w.sha256, sizeof(w.sha256)), w.bytes};
}

// Every rank's part on rank 0 (the others get an empty list): each sends its digest and run
// after the write agreement, then its replicas' shard digests (all ranks have as many), in order
// per peer and tag, so it cannot meet another message.
std::vector<RankPart> gather_parts(comm::Transport& transport, const FileDigest& mine,
                                   const CheckpointRun& run,
                                   const std::vector<FileDigest>& shards) {
  struct Wire {
    DigestWire file;
    char run[64];
  };
  Wire own{};
  own.file = to_wire(mine);
  std::memcpy(own.run, run.id.data(), std::min(run.id.size(), sizeof(own.run)));
  std::vector<DigestWire> own_shards;
  for (const FileDigest& d : shards) own_shards.push_back(to_wire(d));
  const size_t shard_bytes = own_shards.size() * sizeof(DigestWire);
  if (transport.rank() != 0) {
    transport.send(0, kAgreementTag, &own, sizeof(own))->wait();
    if (shard_bytes > 0) transport.send(0, kAgreementTag, own_shards.data(), shard_bytes)->wait();
    return {};
  }
  const size_t ranks = static_cast<size_t>(transport.world_size());
  std::vector<Wire> wires(ranks);
  std::vector<std::vector<DigestWire>> shard_wires(ranks, own_shards);
  wires[0] = own;
  std::vector<comm::WorkPtr> works;
  for (size_t r = 1; r < ranks; ++r) {
    works.push_back(transport.recv(static_cast<int>(r), kAgreementTag, &wires[r], sizeof(Wire)));
    if (shard_bytes > 0) {
      works.push_back(
          transport.recv(static_cast<int>(r), kAgreementTag, shard_wires[r].data(), shard_bytes));
    }
  }
  for (auto& w : works) w->wait();
  std::vector<RankPart> out;
  for (size_t r = 0; r < ranks; ++r) {
    const Wire& w = wires[r];
    RankPart part;
    part.digest = from_wire(w.file);
    part.run_id = std::string(w.run, strnlen(w.run, sizeof(w.run)));
    part.shards.resize(shard_wires[r].size());
    for (size_t d = 0; d < shard_wires[r].size(); ++d)
      part.shards[d] = from_wire(shard_wires[r][d]);
    out.push_back(std::move(part));
  }
  return out;
}

// Rank 0: the manifest, written last.
void write_manifest(const Pipeline& pipeline, const std::string& dir, const CheckpointRun& run,
                    const std::string& metadata, const std::vector<RankPart>& parts) {
  const std::string manifest = manifest_path(dir);
  for (size_t r = 1; r < parts.size(); ++r) {
    PIPEMAT_CHECK(parts[r].run_id == parts[0].run_id, PipelineError, "save_checkpoint: rank ", r,
                  " saved ", dir, " as run '", parts[r].run_id, "' but rank 0 as run '",
                  parts[0].run_id,
                  "'; every rank must pass the same CheckpointRun (make it once, e.g. on rank 0, "
                  "and share it); the checkpoint stays incomplete");
  }
  {
    std::ofstream out(manifest + ".tmp");
    nlohmann::json m = manifest_of(pipeline);
    m["metadata"] = metadata;
    m[detail::kRunKey] = {{"id", run.id}, {"config_digest", run.config_digest}};
    nlohmann::json files = nlohmann::json::object();
    const int replicas = parts.empty() ? 0 : static_cast<int>(parts[0].shards.size());
    for (size_t r = 0; r < parts.size(); ++r) {
      files[rank_file_name(static_cast<int>(r))] = {{"sha256", parts[r].digest.sha256},
                                                    {"bytes", parts[r].digest.bytes}};
      for (int d = 0; d < replicas; ++d) {
        const FileDigest& shard = parts[r].shards[static_cast<size_t>(d)];
        files[shard_file_name(static_cast<int>(r), d, replicas)] = {{"sha256", shard.sha256},
                                                                    {"bytes", shard.bytes}};
      }
    }
    m[kFilesKey] = files;
    if (replicas > 0) {  // Note [Sharded optimizer]: the optimizer state is in the shard files
      m["format"] = kShardedFormat;
      m["replicas"] = replicas;
    }
    out << m.dump(2) << "\n";
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

// Note [Sharded optimizer], replica 0 of this rank: writes its own optimizer shard, then gets
// every other replica's digest; PipelineError naming the first replica that could not write.
std::vector<FileDigest> collect_shards(const Pipeline& pipeline, comm::Transport& data,
                                       const std::string& dir, const CheckpointRun& run) {
  std::vector<DigestWire> wires(static_cast<size_t>(data.world_size()));
  std::vector<comm::WorkPtr> works;
  for (int d = 1; d < data.world_size(); ++d)
    works.push_back(
        data.recv(d, kAgreementTag, &wires[static_cast<size_t>(d)], sizeof(DigestWire)));
  std::exception_ptr own;
  try {
    const FileDigest written = write_shard_file(pipeline, dir, run);
    wires[0] = to_wire(written);
  } catch (const std::exception&) {
    own = std::current_exception();
  }
  for (auto& w : works) w->wait();
  if (own) std::rethrow_exception(own);
  std::vector<FileDigest> out;
  for (int d = 0; d < data.world_size(); ++d) {
    const DigestWire& w = wires[static_cast<size_t>(d)];
    PIPEMAT_CHECK(w.ok == 1, PipelineError, "save_checkpoint: replica ", d, " of pipeline rank ",
                  pipeline.rank(), " could not write its optimizer shard ",
                  (fs::path(dir) / shard_file_name(pipeline.rank(), d, data.world_size())).string(),
                  " (its error says why)");
    out.emplace_back();
    out.back() = from_wire(w);
  }
  return out;
}

// Note [Sharded optimizer], a replica other than 0: waits for replica 0 of its rank to prepare
// `dir`, writes its optimizer shard there, sends replica 0 the digest (or that it failed) and
// waits for how the save ended; the same outcome as replica 0's, or its own error.
std::string save_shard(const Pipeline& pipeline, comm::Transport& data, const std::string& dir,
                       const CheckpointRun& run) {
  const int rank = pipeline.rank();
  uint8_t go = 0;
  data.recv(0, kAgreementTag, &go, 1)->wait();
  PIPEMAT_CHECK(go == 1, PeerFailedError, "save_checkpoint: replica 0 of pipeline rank ", rank,
                " could not prepare ", dir, " (its error says why); nothing was written");
  DigestWire wire{};
  std::exception_ptr own;
  try {
    const FileDigest written = write_shard_file(pipeline, dir, run);
    wire = to_wire(written);
  } catch (const std::exception&) {
    own = std::current_exception();
  }
  data.send(0, kAgreementTag, &wire, sizeof(wire))->wait();
  uint8_t done = 0;
  data.recv(0, kAgreementTag, &done, 1)->wait();
  if (own) std::rethrow_exception(own);
  PIPEMAT_CHECK(done == 1, PeerFailedError, "save_checkpoint: replica 0 of pipeline rank ", rank,
                " could not complete ", dir, " (its error says why); the save was abandoned");
  return dir;
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
  const std::string dir = (fs::path(root) / step_dir_name(pipeline.step())).string();
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
      sends.push_back(data->send(d, kAgreementTag, &what, 1));
    for (auto& w : sends) w->wait();
  };
  bool created = false;
  try {
    agree_on(
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
    std::vector<RankPart> parts;
    try {
      FileDigest mine;
      std::vector<FileDigest> shards;
      agree_on(
          transport, "save_checkpoint",
          [&] {
            // The replicas' digests are received even when this rank's file failed.
            std::exception_ptr first;
            try {
              mine = write_rank_file(pipeline, data ? nullptr : &pipeline.optimizer(), dir, run);
            } catch (const std::exception&) {
              first = std::current_exception();
            }
            try {
              if (data != nullptr) shards = collect_shards(pipeline, *data, dir, run);
            } catch (const std::exception&) {
              if (!first) first = std::current_exception();
            }
            if (first) std::rethrow_exception(first);
          },
          [&](int r) {
            return "could not write its part of " + dir + " (" + rank_file(dir, r) +
                   (data ? " or a replica's optimizer shard" : "") +
                   "; its error says why); the save was abandoned";
          });
      parts = gather_parts(transport, mine, run, shards);
    } catch (...) {
      // Every rank is done writing: an incomplete directory this save made goes away.
      std::error_code ec;
      if (rank == 0 && created) fs::remove_all(dir, ec);
      throw;
    }
    maybe_crash("manifest", pipeline.step(), rank);
    agree_on(
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

namespace {

// Note [Sharded optimizer]: the optimizer state of this rank in a sharded checkpoint, every
// replica's shard file checked (digest, run, step) and the shards joined into one optimizer
// over the rank's parameters.
std::unique_ptr<torch::optim::Optimizer> read_shards(const Pipeline& pipeline,
                                                     const nlohmann::json& m, int format,
                                                     int replicas, const std::string& dir,
                                                     int64_t step, bool allow_non_finite) {
  const int rank = pipeline.rank();
  std::vector<torch::serialize::InputArchive> shards(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    const std::string name = shard_file_name(rank, d, replicas);
    const std::string file = (fs::path(dir) / name).string();
    const InputFile in = open_checkpoint_file(m, format, dir, name, rank);
    torch::serialize::InputArchive archive;
    load_archive(archive, in, allow_non_finite);
    check_rank_file_run(archive, m, format, file);
    at::Tensor at_step;
    PIPEMAT_CHECK(archive.try_read("step", at_step) && at_step.numel() == 1 &&
                      at_step.item<int64_t>() == step,
                  PipelineError, "load_checkpoint: ", file, " is not of step ", step);
    PIPEMAT_CHECK(archive.try_read("shard", shards[static_cast<size_t>(d)]), PipelineError,
                  "load_checkpoint: ", file, " holds no optimizer shard");
  }
  return pipeline.join_optimizer_shards(
      shards, "load_checkpoint: " + (fs::path(dir) / shard_file_name(rank, 0, replicas)).string() +
                  " and its " + std::to_string(replicas - 1) + " sibling(s)");
}

// Reads and checks this rank's part of the checkpoint in `dir` without changing the pipeline.
void check_checkpoint(const Pipeline& pipeline, const std::string& dir,
                      std::vector<std::pair<at::Tensor, at::Tensor>>& copies,
                      torch::serialize::InputArchive& optimizer,
                      std::unique_ptr<torch::optim::Optimizer>& joined, at::Tensor& rng,
                      bool& has_rng, at::Tensor& step, bool allow_non_finite) {
  const int rank = pipeline.rank();
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  nlohmann::json m;
  const CheckpointManifest manifest = detail::read_manifest(dir, m);
  const nlohmann::json want = manifest_of(pipeline);
  const int format = manifest.format;
  for (const char* field :
       {"world_size", "schedule_kind", "stages", "micro_batches", "stage_to_rank"}) {
    PIPEMAT_CHECK(m.contains(field) && m[field] == want[field], ConfigError,
                  "load_checkpoint: ", manifest_path, ": ", field, " is ",
                  m.contains(field) ? m[field].dump() : "missing", " in the checkpoint but ",
                  want[field].dump(),
                  " in this pipeline; resume with the options the checkpoint was written with "
                  "(re-partitioning a checkpoint onto another stage layout is not supported)");
  }
  const std::string file = rank_file(dir, rank);
  torch::serialize::InputArchive archive;
  load_archive(archive, open_checkpoint_file(m, format, dir, rank_file_name(rank), rank),
               allow_non_finite);
  check_rank_file_run(archive, m, format, file);
  at::Tensor stages;
  PIPEMAT_CHECK(
      archive.try_read("step", step) && archive.try_read("stages", stages) && step.numel() == 1,
      PipelineError, "load_checkpoint: ", file, " has no step / stages entries");
  const std::vector<int> mine = pipeline.stages();
  PIPEMAT_CHECK(std::vector<int64_t>(mine.begin(), mine.end()) ==
                    std::vector<int64_t>(stages.data_ptr<int64_t>(),
                                         stages.data_ptr<int64_t>() + stages.numel()),
                PipelineError, "load_checkpoint: ", file, " holds other stages than rank ", rank,
                " has");
  PIPEMAT_CHECK(step.item<int64_t>() == m["step"].get<int64_t>(), PipelineError,
                "load_checkpoint: ", file, " is of step ", step.item<int64_t>(),
                " but the manifest of step ", m["step"].dump());
  // The whole archive was checked for non-finite values as it was loaded.
  for (int s : mine) read_stage(archive, file, s, *pipeline.stage(s).module, copies, false);
  size_t stored = 0;
  for (const auto& key : archive.keys()) {
    if (key.rfind("params/", 0) == 0 || key.rfind("buffers/", 0) == 0) ++stored;
  }
  PIPEMAT_CHECK(stored == copies.size(), PipelineError, "load_checkpoint: ", file, " holds ",
                stored, " parameters and buffers for the stages of rank ", rank,
                " but this model has ", copies.size(), "; it was written by another model");
  if (format >= kShardedFormat) {
    joined = read_shards(pipeline, m, format, manifest.replicas, dir, step.item<int64_t>(),
                         allow_non_finite);
  } else {
    PIPEMAT_CHECK(archive.try_read("optimizer", optimizer), PipelineError,
                  "load_checkpoint: ", file, " has no optimizer state");
  }
  has_rng = archive.try_read("rng", rng);
  PIPEMAT_CHECK(has_rng == pipeline.generator().defined(), PipelineError, "load_checkpoint: ", file,
                has_rng ? " has a generator state but this pipeline has no seed"
                        : " has no generator state but this pipeline has a seed");
}

}  // namespace

void load_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& dir,
                     bool allow_non_finite) {
  // Check everything on every rank, then agree: nothing is changed anywhere unless every rank
  // can load its part (Note [Checkpoint agreement]).
  const int rank = pipeline.rank();
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // destination, value
  torch::serialize::InputArchive optimizer;
  std::unique_ptr<torch::optim::Optimizer> joined;  // Note [Sharded optimizer]: from the shards
  at::Tensor rng, step;
  bool has_rng = false;
  agree_on(
      transport, "load_checkpoint",
      [&] {
        check_checkpoint(pipeline, dir, copies, optimizer, joined, rng, has_rng, step,
                         allow_non_finite);
      },
      [&](int r) {
        return "could not load its part of " + dir + " (" + rank_file(dir, r) +
               "; its error says why); nothing was loaded on any rank";
      });
  {
    at::NoGradGuard no_grad;
    for (auto& [to, value] : copies) to.copy_(value);
  }
  try {
    // Note [Sharded optimizer]: a sharded pipeline keeps its pieces' part.
    if (joined != nullptr) {
      pipeline.load_optimizer_state(*joined);
    } else {
      pipeline.load_optimizer_state(optimizer);
    }
  } catch (const std::exception& e) {
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", rank_file(dir, rank),
                  ": the optimizer state does not fit this optimizer: ",
                  std::string(e.what()).substr(0, 200));
  }
  if (has_rng) pipeline.generator().set_state(rng);
  pipeline.set_step(step.item<int64_t>());
  transport.barrier();
}

CheckpointManifest read_checkpoint_manifest(const std::string& dir) {
  nlohmann::json json;
  return detail::read_manifest(dir, json);
}

void load_stage_weights(const std::string& dir, const std::vector<torch::nn::Module*>& stages,
                        bool allow_non_finite) {
  nlohmann::json m;  // read once: its digests are checked below
  const CheckpointManifest manifest = detail::read_manifest(dir, m);
  PIPEMAT_CHECK(stages.size() == static_cast<size_t>(manifest.stages), ConfigError,
                "load_stage_weights: ", dir, " holds ", manifest.stages, " stages but ",
                stages.size(), " modules were given");
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  std::map<int, std::vector<int>> by_rank;
  for (int s = 0; s < manifest.stages; ++s) by_rank[manifest.stage_to_rank[s]].push_back(s);
  for (const auto& [rank, owned] : by_rank) {
    const std::string file = rank_file(dir, rank);
    torch::serialize::InputArchive archive;
    // Only what is read is checked for non-finite values: the optimizer state is not loaded.
    load_archive(archive, open_checkpoint_file(m, manifest.format, dir, rank_file_name(rank), rank),
                 /*allow_non_finite=*/true);
    check_rank_file_run(archive, m, manifest.format, file);
    for (int s : owned) {
      read_stage(archive, file, s, *stages[static_cast<size_t>(s)], copies, !allow_non_finite);
    }
  }
  at::NoGradGuard no_grad;
  for (auto& [to, value] : copies) to.copy_(value);
}

}  // namespace pipemat::pp
