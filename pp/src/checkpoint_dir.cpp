// Checkpoint directories: the runs that wrote them (Note [Checkpoint runs]), listing, removal
// and the newest complete checkpoint; the file helpers of checkpoint_files.h.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_files.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/core/parse.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/weights/safetensors.h"

namespace pipemat::pp {
namespace detail {

namespace fs = std::filesystem;

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}

long long step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return -1;
  return parse_int_in(name.substr(5), 0, std::numeric_limits<int64_t>::max()).value_or(-1);
}

void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  PIPEMAT_CHECK(fd >= 0, PipelineError, "checkpoint: cannot open ", path,
                " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  PIPEMAT_CHECK(rc == 0, PipelineError, "checkpoint: fsync of ", path,
                " failed: ", std::strerror(error));
}

void publish(const std::string& tmp, const std::string& final_path) {
  sync_path(tmp);
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  PIPEMAT_CHECK(!ec, PipelineError, "checkpoint: cannot rename ", tmp, " to ", final_path, ": ",
                ec.message());
  sync_path(fs::path(final_path).parent_path().string());
}

}  // namespace detail

namespace fs = std::filesystem;

CheckpointRun new_checkpoint_run(const std::string& config_digest) {
  std::random_device device;
  std::string id;
  char hex[9];
  for (int i = 0; i < 4; ++i) {
    std::snprintf(hex, sizeof(hex), "%08x", static_cast<unsigned>(device()));
    id += hex;
  }
  return CheckpointRun{id, config_digest};
}

CheckpointRun resumed_run(const std::string& dir) {
  const CheckpointManifest manifest = read_checkpoint_manifest(dir);
  if (manifest.run_id.empty()) return new_checkpoint_run(manifest.config_digest);
  return CheckpointRun{manifest.run_id, manifest.config_digest};
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& root) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& item : fs::directory_iterator(root, ec)) {
    const long long step = detail::step_of(item.path().filename().string());
    if (step < 0 || !item.is_directory(ec)) continue;
    CheckpointEntry entry;
    entry.dir = item.path().string();
    entry.step = step;
    if (fs::exists(detail::manifest_path(entry.dir), ec)) {
      try {
        const CheckpointManifest m = read_checkpoint_manifest(entry.dir);
        entry.complete = true;
        entry.run_id = m.run_id;
        entry.config_digest = m.config_digest;
      } catch (const PipelineError& e) {
        entry.damaged = true;  // a manifest that is not one: cannot be loaded
        entry.problem = e.what();
      }
    }
    out.push_back(std::move(entry));
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return out;
}

void remove_checkpoint(const std::string& dir) {
  std::error_code ec;
  const std::string manifest = detail::manifest_path(dir);
  if (fs::exists(manifest, ec)) {
    fs::remove(manifest, ec);
    PIPEMAT_CHECK(!ec, PipelineError, "checkpoint: cannot remove ", manifest, ": ", ec.message());
    detail::sync_path(dir);
  }
  fs::remove_all(dir, ec);
  PIPEMAT_CHECK(!ec, PipelineError, "checkpoint: cannot remove ", dir, ": ", ec.message());
}

std::string latest_checkpoint(const std::string& root, const std::string& run_id) {
  std::string best;
  const std::vector<CheckpointEntry> entries = list_checkpoints(root);
  const CheckpointEntry* damaged = nullptr;
  for (const CheckpointEntry& e : entries) {  // in step order
    if (e.complete && (run_id.empty() || e.run_id == run_id)) {
      best = e.dir;
      damaged = nullptr;
    } else if (e.damaged) {
      damaged = &e;
    }
  }
  PIPEMAT_CHECK(damaged == nullptr, PipelineError,
                "latest_checkpoint: the newest checkpoint under ", root,
                " is damaged: ", damaged->problem,
                best.empty() ? std::string("; there is no older complete checkpoint")
                             : "; the newest complete one before it is " + best +
                                   ": load it explicitly if that is meant");
  return best;
}

std::vector<CheckpointFileCheck> verify_checkpoint(const std::string& dir) {
  const CheckpointManifest manifest = read_checkpoint_manifest(dir);
  PIPEMAT_CHECK(manifest.format >= 2, ConfigError, "verify_checkpoint: ", dir,
                " is of format 1, which records no digests of its files; nothing to verify "
                "against");
  std::vector<CheckpointFileCheck> out;
  for (const CheckpointFileRecord& record : manifest.files) {
    CheckpointFileCheck check;
    check.file = (fs::path(dir) / record.name).string();
    std::error_code ec;
    if (!fs::exists(check.file, ec)) {
      check.problem = "missing";
      out.push_back(std::move(check));
      continue;
    }
    try {
      const InputFile in = open_input_file<PipelineError>(check.file, "verify_checkpoint");
      const FileDigest got = sha256_file(in);
      check.bytes = got.bytes;
      if (got.bytes != record.bytes || got.sha256 != record.sha256) {
        check.problem = ::pipemat::detail::concat(
            "damaged or replaced: it holds ", got.bytes, " bytes with SHA-256 ",
            got.sha256.substr(0, 16), "... but the manifest recorded ", record.bytes,
            " bytes with ", record.sha256.substr(0, 16), "...");
      }
    } catch (const Error& e) {
      check.problem = e.what();
    }
    if (check.problem.empty() && manifest.format >= detail::kGlobalFormat) {
      // The index's pieces in this file: present, of their dtype and size.
      try {
        const weights::SafetensorsFile file(check.file);
        for (const CheckpointTensor& t : manifest.tensors) {
          for (const CheckpointPiece& piece : t.pieces) {
            if (piece.file != record.name) continue;
            const weights::TensorInfo* info = file.find(piece.key);
            if (info == nullptr || weights::to_string(info->dtype) != t.dtype ||
                info->numel() != piece.end - piece.begin) {
              check.problem =
                  "does not hold the tensor '" + piece.key + "' as the index records it";
              break;
            }
          }
          if (!check.problem.empty()) break;
        }
      } catch (const WeightsError& e) {
        check.problem = e.what();
      }
    }
    out.push_back(std::move(check));
  }
  return out;
}

}  // namespace pipemat::pp
