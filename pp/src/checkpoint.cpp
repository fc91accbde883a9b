// What the checkpoint files share (checkpoint_common.h: the ranks' agreement, crash injection,
// text messages, the layout a manifest records) and the loaders of formats 1 to 3 (rank-<r>.pt
// torch archives keyed by stage), which resume on the layout that wrote them.

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

#include "checkpoint_common.h"
#include "checkpoint_files.h"
#include "checkpoint_state.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/finite.h"

namespace pipemat::pp {

namespace detail {

namespace fs = std::filesystem;

// Note [Checkpoint agreement]
// At each point where ranks must act together (every rank can load its part; every rank wrote
// its file; rank 0 may write the manifest), every rank tells every other whether its part
// succeeded: one byte each, tag kAgreementTag, between steps when no pipeline message is in
// flight. This is also the barrier there. A rank whose part failed throws its own error, the
// others one naming it, so every rank ends a load or a save the same way and none waits for a
// peer that has given up.
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

// Note [Checkpoint crash injection]
// PIPEMAT_TEST_KILL_IN_CHECKPOINT=STEP:POINT[:RANK] makes the save of step STEP kill its own
// process with SIGKILL (no cleanup, no unwinding: what a power cut or the OOM killer does) at
// POINT: "rank-file" with half of the rank file written to its temporary name, "manifest"
// after every rank file is published and before the manifest. Only on rank RANK when given.
// The crash-safety test (tests/e2e/checkpoint_crash.sh) uses it; unset, nothing happens.
void maybe_crash(const char* point, int64_t step, int rank, const std::string& tmp) {
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

void send_text(comm::Transport& transport, int peer, const std::string& text) {
  transport.send(peer, kAgreementTag, text.data(), text.size())->wait();
}

std::string recv_text(comm::Transport& transport, int peer) {
  comm::WorkPtr work = transport.recv_any(peer, kAgreementTag);
  work->wait();
  const auto& bytes = work->buffer();
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

nlohmann::json layout_of(const Pipeline& pipeline, int format) {
  const schedule::Schedule& plan = pipeline.schedule();
  nlohmann::json j;
  j["format"] = format;
  j["pipemat"] = "0.1.0";
  j["step"] = pipeline.step();
  j["world_size"] = plan.ranks_count;
  j["schedule_kind"] = schedule::to_string(plan.kind);
  j["stages"] = plan.stages_count;
  j["micro_batches"] = plan.micro_batches;
  j["stage_to_rank"] = plan.stage_to_rank;
  return j;
}

}  // namespace detail

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
// Formats 2 and 3 (format 4 checks each tensor it reads instead: Note [Checkpoint load planner]
// in checkpoint_load.cpp). Nothing of a rank file is used unless it is, byte for byte, the file
// its rank wrote. The writer digested the bytes as they went to the file (SHA-256, the
// archive's own per-record CRCs are not checked by LibTorch's reader), the ranks sent their
// digests to rank 0, and the manifest records each rank file's digest and size: a flipped byte, a
// truncated or extended file, or a file copied in from another checkpoint fails the check on load,
// before the archive is opened, naming the file, both digests and both sizes. Each rank file also
// names its run and step, checked against the manifest, so a rank file of another run cannot be
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

}  // namespace

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
  return detail::PipelineAccess::join_optimizer_shards(
      pipeline, shards,
      "load_checkpoint: " + (fs::path(dir) / shard_file_name(rank, 0, replicas)).string() +
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
  const nlohmann::json want = detail::layout_of(pipeline, kFormat);
  const int format = manifest.format;
  for (const char* field :
       {"world_size", "schedule_kind", "stages", "micro_batches", "stage_to_rank"}) {
    PIPEMAT_CHECK(m.contains(field) && m[field] == want[field], ConfigError,
                  "load_checkpoint: ", manifest_path, ": ", field, " is ",
                  m.contains(field) ? m[field].dump() : "missing", " in the checkpoint but ",
                  want[field].dump(), " in this pipeline; a checkpoint of format ", format,
                  " (written before pipemat stored tensors by global name) resumes only with the "
                  "options it was written with; the checkpoints written now (format 4) resume on "
                  "any layout");
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

namespace detail {

void load_legacy_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& dir,
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

void load_legacy_stage_weights(const std::string& dir,
                               const std::vector<torch::nn::Module*>& stages,
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

}  // namespace detail
}  // namespace pipemat::pp
