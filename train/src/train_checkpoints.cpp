// Which run a `pipemat train` start continues or begins (Note [Checkpoint directories]).

#include "train_checkpoints.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <vector>

#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/train/config.h"

namespace pipemat::train {
namespace {

std::string short_id(const std::string& run_id) {
  return run_id.empty() ? "(no run id: written before checkpoints named their run)"
                        : run_id.substr(0, 12);
}

// "2 complete checkpoints of run 3f2a9c01d4e7 (steps 4 .. 6, newest ck/step-000006, written with
// this config), 1 incomplete (ck/step-000008)".
std::string describe(const std::vector<pp::CheckpointEntry>& entries, const std::string& digest) {
  std::map<std::string, std::vector<const pp::CheckpointEntry*>> runs;
  std::vector<std::string> incomplete, damaged;
  for (const auto& e : entries) {
    if (e.complete) {
      runs[e.run_id].push_back(&e);
    } else if (e.damaged) {
      damaged.push_back(e.dir);
    } else {
      incomplete.push_back(e.dir);
    }
  }
  std::ostringstream out;
  const char* separator = "";
  for (const auto& [id, list] : runs) {
    out << separator << list.size() << " complete checkpoint" << (list.size() == 1 ? "" : "s")
        << " of run " << short_id(id) << " (step";
    if (list.size() == 1) {
      out << " " << list.front()->step;
    } else {
      out << "s " << list.front()->step << " .. " << list.back()->step;
    }
    out << ", newest " << list.back()->dir << ", written with "
        << (list.back()->config_digest == digest ? "this config" : "another config") << ")";
    separator = ", ";
  }
  if (!incomplete.empty()) {
    out << separator << incomplete.size() << " incomplete (no manifest: ";
    for (size_t i = 0; i < incomplete.size() && i < 3; ++i) out << (i ? ", " : "") << incomplete[i];
    if (incomplete.size() > 3) out << ", ...";
    out << ")";
    separator = ", ";
  }
  if (!damaged.empty()) {
    out << separator << damaged.size() << " with a damaged manifest (";
    for (size_t i = 0; i < damaged.size() && i < 3; ++i) out << (i ? ", " : "") << damaged[i];
    if (damaged.size() > 3) out << ", ...";
    out << ")";
  }
  return out.str();
}

// checkpoint.resume `latest`: the newest complete checkpoint of the one run under `dir`; the
// newer incomplete directories it passes over go to `skipped`. A newer damaged one is an error.
std::string latest_of_one_run(const std::string& dir,
                              const std::vector<pp::CheckpointEntry>& entries,
                              const std::string& digest, std::vector<std::string>& skipped) {
  std::map<std::string, int> runs;
  std::string latest;
  int64_t latest_step = -1;
  const pp::CheckpointEntry* damaged = nullptr;
  for (const auto& e : entries) {
    if (e.damaged) {
      damaged = &e;
      continue;
    }
    if (!e.complete) continue;
    ++runs[e.run_id];
    latest = e.dir;
    latest_step = e.step;
    damaged = nullptr;
  }
  if (damaged != nullptr) {
    PIPEMAT_THROW(ConfigError, "checkpoint.resume: latest: the newest checkpoint ", damaged->dir,
                  " is damaged: ", damaged->problem, ". It is not skipped in silence: ",
                  latest.empty() ? std::string("there is no older complete checkpoint to resume")
                                 : "to resume the newest complete one before it, name it: "
                                   "--resume " +
                                       latest,
                  " (or repair or remove ", damaged->dir, ")");
  }
  PIPEMAT_CHECK(!latest.empty(), ConfigError,
                "checkpoint.resume: latest: there is no complete checkpoint under '", dir,
                "' (checkpoint.dir)", entries.empty() ? "" : ": ", describe(entries, digest));
  for (const auto& e : entries) {
    if (!e.complete && !e.damaged && e.step > latest_step) {
      skipped.push_back(e.dir + " (incomplete: no manifest, a save that was interrupted)");
    }
  }
  PIPEMAT_CHECK(runs.size() == 1, ConfigError, "checkpoint.resume: latest: checkpoint.dir '", dir,
                "' holds the checkpoints of ", runs.size(), " runs: ", describe(entries, digest),
                "; name the step directory to resume (--resume DIR/step-NNNNNN)");
  return latest;
}

// Every rank writes its file into checkpoint.dir: find out now, not after training, that it
// cannot (a read-only file system, a missing permission, a full disk).
void check_writable(const std::string& dir, int rank) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  PIPEMAT_CHECK(!ec, ConfigError, "checkpoint.dir '", dir, "' cannot be created (rank ", rank,
                "): ", ec.message());
  const std::string probe = (fs::path(dir) / (".pipemat-write-test-" + std::to_string(rank) + "-" +
                                              std::to_string(::getpid())))
                                .string();
  errno = 0;
  std::FILE* file = std::fopen(probe.c_str(), "wb");
  const bool written = file != nullptr && std::fputs("pipemat", file) >= 0;
  const int error = errno;
  const bool closed = file != nullptr && std::fclose(file) == 0;
  fs::remove(probe, ec);
  PIPEMAT_CHECK(written && closed, ConfigError, "checkpoint.dir '", dir, "' is not writable (rank ",
                rank, "): ", std::strerror(error != 0 ? error : EIO),
                "; choose a directory every rank can write to");
}

}  // namespace

std::string config_digest(const TrainConfig& config) {
  TrainConfig identity = config;
  identity.checkpoint.resume.clear();
  identity.checkpoint.overwrite = false;
  identity.training.stop_after = 0;
  // A run may resume with another number of replicas or other buckets: they change how the
  // gradients travel, not what they are.
  identity.parallel = ParallelOptions{};
  identity.warnings.clear();
  return sha256_hex(config_to_yaml(identity));
}

namespace {

// Job rank 0 locks checkpoint.dir and output.metrics (Note [One job per file]) and sends every
// rank its run id, or the refusal.
void share_run(RunCheckpoints& out, const TrainConfig& config, comm::Transport& transport) {
  out.run.id = decide_on_rank_zero(transport, kRunTag, "run", [&] {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    const std::string note = ::pipemat::detail::concat("pid ", ::getpid(), " on ", host, ", run ",
                                                       out.run.id.substr(0, 12));
    if (!config.checkpoint.dir.empty()) {
      out.locks.push_back(std::make_shared<FileLock>(
          (std::filesystem::path(config.checkpoint.dir) / ".pipemat-lock").string(),
          "checkpoint.dir '" + config.checkpoint.dir + "'", note));
    }
    if (!config.output.metrics.empty()) {
      std::filesystem::path parent = std::filesystem::path(config.output.metrics).parent_path();
      std::error_code ec;
      if (!parent.empty()) std::filesystem::create_directories(parent, ec);
      out.locks.push_back(std::make_shared<FileLock>(
          config.output.metrics, "output.metrics '" + config.output.metrics + "'"));
    }
    return out.run.id;
  });
}

// What a resume keeps whatever the layout (Note [Checkpoint layout] in pipemat/pp/checkpoint.h),
// against the config the checkpoint's run was started with (its manifest's metadata): the data
// each step reads (training.seed, model.batch, model.seq_len). The model itself, the
// micro-batches per step and the optimizer are checked by the load, naming the tensor.
// The config of `from`'s run, or nothing: a checkpoint not written by pipemat train, or by
// another version whose config this one does not read (the load then checks what it can).
std::optional<TrainConfig> config_of(const pp::CheckpointManifest& from, const std::string& dir) {
  if (from.metadata.empty()) return std::nullopt;
  try {
    return parse_config(from.metadata, dir + "/manifest.json (metadata)");
  } catch (const ConfigError&) {
    return std::nullopt;
  }
}

void check_resume_keeps(const TrainConfig& then, const std::string& dir,
                        const TrainConfig& config) {
  const auto keep = [&](const char* key, int64_t was, int64_t is) {
    PIPEMAT_CHECK(was == is, ConfigError, "checkpoint.resume: ", dir, " was written by a run with ",
                  key, " ", was, " but this run has ", is, "; a resume keeps ", key,
                  " (the seed and the batch: what each step trains on), whatever the layout");
  };
  keep("training.seed", static_cast<int64_t>(then.training.seed),
       static_cast<int64_t>(config.training.seed));
  keep("model.batch", then.model.batch, config.model.batch);
  keep("model.seq_len", then.model.seq_len, config.model.seq_len);
}

}  // namespace

std::string decide_on_rank_zero(comm::Transport& transport, int tag, const char* what,
                                const std::function<std::string()>& decide) {
  std::string message;
  if (transport.rank() == 0) {
    try {
      message = "+" + decide();
    } catch (const std::exception& e) {
      message = std::string("-") + e.what();
    }
    std::vector<comm::WorkPtr> sends;
    for (int r = 1; r < transport.world_size(); ++r) {
      sends.push_back(transport.send(r, tag, message.data(), message.size()));
    }
    for (auto& w : sends) w->wait();
  } else {
    comm::WorkPtr work = transport.recv_any(0, tag);
    work->wait();
    const auto& bytes = work->buffer();
    message.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  PIPEMAT_CHECK(!message.empty() && message[0] == '+', ConfigError,
                message.empty() ? std::string("rank 0 sent no ") + what : message.substr(1));
  return message.substr(1);
}

RunCheckpoints start_checkpoints(const TrainConfig& config, comm::Transport& transport) {
  const CheckpointOptions& ck = config.checkpoint;
  const std::string digest = config_digest(config);
  RunCheckpoints out;
  PIPEMAT_CHECK(!(ck.overwrite && !ck.resume.empty()), ConfigError,
                "checkpoint.overwrite: a run that resumes (checkpoint.resume '", ck.resume,
                "') continues its checkpoints and removes none; overwrite is for a run that "
                "starts at step 0");
  const std::vector<pp::CheckpointEntry> entries = pp::list_checkpoints(ck.dir);
  if (!ck.resume.empty()) {
    out.resume_dir =
        ck.resume == "latest" ? latest_of_one_run(ck.dir, entries, digest, out.skipped) : ck.resume;
    const pp::CheckpointManifest from = pp::read_checkpoint_manifest(out.resume_dir);
    out.resumed_config = config_of(from, out.resume_dir);
    if (out.resumed_config) check_resume_keeps(*out.resumed_config, out.resume_dir, config);
    out.continued = !from.run_id.empty();
    out.run = out.continued ? pp::CheckpointRun{from.run_id, from.config_digest}
                            : pp::new_checkpoint_run(from.config_digest);
    for (const auto& e : entries) {  // in step order: the last one found is the newest
      if (e.complete && e.step < from.step && e.run_id == from.run_id) out.older = e.dir;
    }
    for (const auto& e : entries) {
      PIPEMAT_CHECK(!e.complete || e.run_id == out.run.id || e.step <= from.step ||
                        e.step > config.training.steps,
                    ConfigError, "checkpoint.dir '", ck.dir,
                    "' holds a complete checkpoint of another run at step ", e.step, " (", e.dir,
                    ", run ", short_id(e.run_id), "), which this run (resuming after step ",
                    from.step, ", to step ", config.training.steps,
                    ") would have to overwrite; it never does: resume into another "
                    "checkpoint.dir");
    }
    if (!ck.dir.empty()) check_writable(ck.dir, transport.rank());
    share_run(out, config, transport);
    return out;
  }
  out.run = pp::new_checkpoint_run(digest);
  if (ck.dir.empty() || entries.empty()) {
    if (!ck.dir.empty()) check_writable(ck.dir, transport.rank());
    share_run(out, config, transport);
    return out;
  }
  PIPEMAT_CHECK(ck.overwrite, ConfigError, "checkpoint.dir '", ck.dir,
                "' already holds checkpoints: ", describe(entries, digest),
                ". This run starts at step 0 and leaves them alone. To continue that run: "
                "--resume latest (checkpoint.resume=latest); to start a new run and keep them: "
                "another checkpoint.dir; to remove them and start here: --set "
                "checkpoint.overwrite=true");
  share_run(out, config, transport);  // rank 0 holds the directory's lock from here on
  transport.barrier();                // every rank has looked before rank 0 removes anything
  for (const auto& e : entries) out.overwritten.push_back(e.dir);
  if (transport.rank() == 0) {
    for (const auto& e : entries) pp::remove_checkpoint(e.dir);
  }
  transport.barrier();
  check_writable(ck.dir, transport.rank());
  return out;
}

}  // namespace pipemat::train
