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
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/parse.h"

namespace pipemat::pp {
namespace {

namespace fs = std::filesystem;

// Note [Checkpoint layout]
// rank-<r>.pt is a torch archive with "step" (int64), "stages" (int64: this rank's stages),
// "params/<stage>/<name>" and "buffers/<stage>/<name>" (dots of module paths become '|'),
// "optimizer" (the optimizer's own archive) and "rng" (the generator state, with
// PipelineOptions::seed). manifest.json holds the format version, the step and what must match
// on resume: world size, schedule kind, stages, micro-batches and the stage map.
constexpr int kFormat = 1;

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%06lld", static_cast<long long>(step));
  return name;
}

// The step of a "step-NNNNNN" directory name, or -1. Checkpoints are ordered by it, not by
// name: step-1000000 sorts before step-999999 as text.
long long step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return -1;
  return parse_int_in(name.substr(5), 0, std::numeric_limits<int64_t>::max()).value_or(-1);
}

std::string rank_file(const std::string& dir, int rank) {
  return (fs::path(dir) / ("rank-" + std::to_string(rank) + ".pt")).string();
}

std::string key_of(const std::string& path) {
  std::string key = path;
  std::replace(key.begin(), key.end(), '.', '|');
  return key;
}

// fsync of a file or a directory; PipelineError naming it.
void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  PIPEMAT_CHECK(fd >= 0, PipelineError, "checkpoint: cannot open ", path, " to sync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  PIPEMAT_CHECK(rc == 0, PipelineError, "checkpoint: fsync of ", path, " failed");
}

// Makes `tmp` durable and renames it to `final`, then syncs the directory.
void publish(const std::string& tmp, const std::string& final_path) {
  sync_path(tmp);
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  PIPEMAT_CHECK(!ec, PipelineError, "checkpoint: cannot rename ", tmp, " to ", final_path, ": ",
                ec.message());
  sync_path(fs::path(final_path).parent_path().string());
}

// Reads the parameters and buffers of stage `s` of `module` from `archive` (the file `file`)
// into `copies` (destination, value), checking names, shapes and dtypes.
void read_stage(torch::serialize::InputArchive& archive, const std::string& file, int s,
                const torch::nn::Module& module,
                std::vector<std::pair<at::Tensor, at::Tensor>>& copies) {
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
    copies.emplace_back(t, value);
  };
  for (const auto& p : module.named_parameters()) read("params", p.key(), p.value());
  for (const auto& b : module.named_buffers()) read("buffers", b.key(), b.value());
}

// Opens a rank file; PipelineError naming it when it is missing or damaged.
void open_rank_file(torch::serialize::InputArchive& archive, const std::string& file, int rank) {
  PIPEMAT_CHECK(fs::exists(file), PipelineError, "load_checkpoint: ", file,
                " is missing: the checkpoint has no state for rank ", rank);
  try {
    archive.load_from(file);
  } catch (const std::exception& e) {
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", file,
                  " cannot be read (truncated or "
                  "damaged): ",
                  std::string(e.what()).substr(0, 200));
  }
}

// The manifest of `dir`; PipelineError when the checkpoint is incomplete or it is not JSON.
nlohmann::json read_manifest_json(const std::string& dir) {
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  std::ifstream in(manifest_path);
  PIPEMAT_CHECK(in.good(), PipelineError, "load_checkpoint: ", dir,
                " is not a complete checkpoint (no manifest.json; a save that was interrupted "
                "leaves none): give a step-NNNNNN directory that has one (--resume latest and "
                "pp::latest_checkpoint() pick the newest)");
  nlohmann::json m = nlohmann::json::parse(in, nullptr, false);
  PIPEMAT_CHECK(!m.is_discarded() && m.is_object(), PipelineError,
                "load_checkpoint: ", manifest_path, " is not valid JSON");
  return m;
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

std::string save_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& root,
                            int keep_last, const std::string& metadata) {
  PIPEMAT_CHECK(!root.empty(), ConfigError, "save_checkpoint: the checkpoint directory is empty");
  const std::string dir = (fs::path(root) / step_dir_name(pipeline.step())).string();
  std::error_code ec;
  fs::create_directories(dir, ec);
  PIPEMAT_CHECK(!ec, PipelineError, "save_checkpoint: cannot create ", dir, ": ", ec.message());
  const int rank = pipeline.rank();
  {
    torch::serialize::OutputArchive archive;
    archive.write("step", at::tensor({pipeline.step()}, at::kLong));
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
    torch::serialize::OutputArchive optimizer;
    pipeline.optimizer().save(optimizer);
    archive.write("optimizer", optimizer);
    if (pipeline.generator().defined()) {
      archive.write("rng", pipeline.generator().get_state());
    }
    const std::string final_path = rank_file(dir, rank);
    const std::string tmp = final_path + ".tmp";
    try {
      archive.save_to(tmp);
    } catch (const std::exception& e) {
      PIPEMAT_THROW(PipelineError, "save_checkpoint: rank ", rank, " cannot write ", tmp, ": ",
                    e.what());
    }
    maybe_crash("rank-file", pipeline.step(), rank, tmp);
    publish(tmp, final_path);
  }
  transport.barrier();  // every rank's file is durable
  maybe_crash("manifest", pipeline.step(), rank);
  if (rank == 0) {
    const std::string manifest = (fs::path(dir) / "manifest.json").string();
    {
      std::ofstream out(manifest + ".tmp");
      nlohmann::json m = manifest_of(pipeline);
      m["metadata"] = metadata;
      out << m.dump(2) << "\n";
      PIPEMAT_CHECK(out.good(), PipelineError, "save_checkpoint: cannot write ", manifest, ".tmp");
    }
    publish(manifest + ".tmp", manifest);
    if (keep_last > 0) {
      std::vector<std::pair<long long, std::string>> complete;
      for (const auto& entry : fs::directory_iterator(root)) {
        const long long step = step_of(entry.path().filename().string());
        if (step >= 0 && fs::exists(entry.path() / "manifest.json")) {
          complete.emplace_back(step, entry.path().string());
        }
      }
      std::sort(complete.begin(), complete.end());
      for (size_t i = 0; i + keep_last < complete.size(); ++i) {
        fs::remove_all(complete[i].second, ec);
      }
    }
  }
  transport.barrier();  // the manifest exists before any rank goes on
  return dir;
}

std::string latest_checkpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return "";
  std::string best;
  long long best_step = -1;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const long long step = step_of(entry.path().filename().string());
    if (step < 0 || !fs::exists(entry.path() / "manifest.json")) continue;
    if (step > best_step) {
      best_step = step;
      best = entry.path().string();
    }
  }
  return best;
}

namespace {

// Reads and checks this rank's part of the checkpoint in `dir` without changing the pipeline.
void check_checkpoint(const Pipeline& pipeline, const std::string& dir,
                      std::vector<std::pair<at::Tensor, at::Tensor>>& copies,
                      torch::serialize::InputArchive& optimizer, at::Tensor& rng, bool& has_rng,
                      at::Tensor& step) {
  const int rank = pipeline.rank();
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  const nlohmann::json m = read_manifest_json(dir);
  const nlohmann::json want = manifest_of(pipeline);
  for (const char* field :
       {"format", "world_size", "schedule_kind", "stages", "micro_batches", "stage_to_rank"}) {
    PIPEMAT_CHECK(m.contains(field) && m[field] == want[field], ConfigError,
                  "load_checkpoint: ", manifest_path, ": ", field, " is ",
                  m.contains(field) ? m[field].dump() : "missing", " in the checkpoint but ",
                  want[field].dump(),
                  " in this pipeline; resume with the options the checkpoint was written with "
                  "(re-partitioning a checkpoint onto another stage layout is not supported)");
  }
  const std::string file = rank_file(dir, rank);
  torch::serialize::InputArchive archive;
  open_rank_file(archive, file, rank);
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
  for (int s : mine) read_stage(archive, file, s, *pipeline.stage(s).module, copies);
  size_t stored = 0;
  for (const auto& key : archive.keys()) {
    if (key.rfind("params/", 0) == 0 || key.rfind("buffers/", 0) == 0) ++stored;
  }
  PIPEMAT_CHECK(stored == copies.size(), PipelineError, "load_checkpoint: ", file, " holds ",
                stored, " parameters and buffers for the stages of rank ", rank,
                " but this model has ", copies.size(), "; it was written by another model");
  PIPEMAT_CHECK(archive.try_read("optimizer", optimizer), PipelineError, "load_checkpoint: ", file,
                " has no optimizer state");
  has_rng = archive.try_read("rng", rng);
  PIPEMAT_CHECK(has_rng == pipeline.generator().defined(), PipelineError, "load_checkpoint: ", file,
                has_rng ? " has a generator state but this pipeline has no seed"
                        : " has no generator state but this pipeline has a seed");
}

// Note [Checkpoint agreement]
// Every rank tells every other whether its checks passed (one byte each, tag kAgreementTag,
// between steps when no pipeline message is in flight). A rank whose checks failed throws its
// own error; the others throw one naming it. So either every rank loads or none does.
constexpr int kAgreementTag = comm::kMaxUserTag;

void agree(comm::Transport& transport, const std::string& dir, const std::string& failure) {
  const uint8_t mine = failure.empty() ? 0 : 1;
  std::vector<uint8_t> theirs(static_cast<size_t>(transport.world_size()), 0);
  std::vector<comm::WorkPtr> works;
  for (int r = 0; r < transport.world_size(); ++r) {
    if (r == transport.rank()) continue;
    works.push_back(transport.send(r, kAgreementTag, &mine, 1));
    works.push_back(transport.recv(r, kAgreementTag, &theirs[static_cast<size_t>(r)], 1));
  }
  for (auto& w : works) w->wait();
  if (!failure.empty()) return;  // the caller rethrows this rank's error
  for (int r = 0; r < transport.world_size(); ++r) {
    PIPEMAT_CHECK(theirs[static_cast<size_t>(r)] == 0, PipelineError, "load_checkpoint: rank ", r,
                  " could not load its part of ", dir, " (", rank_file(dir, r),
                  "; its error says why); nothing was loaded on any rank");
  }
}

}  // namespace

void load_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& dir) {
  // Check everything on every rank, then agree: nothing is changed anywhere unless every rank
  // can load its part (Note [Checkpoint agreement]).
  const int rank = pipeline.rank();
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // destination, value
  torch::serialize::InputArchive optimizer;
  at::Tensor rng, step;
  bool has_rng = false;
  std::string failure;
  std::exception_ptr error;
  try {
    check_checkpoint(pipeline, dir, copies, optimizer, rng, has_rng, step);
  } catch (const std::exception& e) {
    failure = e.what();
    error = std::current_exception();
  }
  agree(transport, dir, failure);
  if (error) std::rethrow_exception(error);  // this rank's own error, with its type
  {
    at::NoGradGuard no_grad;
    for (auto& [to, value] : copies) to.copy_(value);
  }
  try {
    pipeline.optimizer().load(optimizer);
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
  const nlohmann::json m = read_manifest_json(dir);
  CheckpointManifest out;
  try {
    out.step = m.at("step").get<int64_t>();
    out.world_size = m.at("world_size").get<int>();
    out.schedule_kind = m.at("schedule_kind").get<std::string>();
    out.stages = m.at("stages").get<int>();
    out.micro_batches = m.at("micro_batches").get<int>();
    out.stage_to_rank = m.at("stage_to_rank").get<std::vector<int>>();
    if (m.contains("metadata")) out.metadata = m.at("metadata").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", (fs::path(dir) / "manifest.json").string(),
                  " is not a pipemat manifest: ", e.what());
  }
  PIPEMAT_CHECK(out.stages >= 1 && out.stage_to_rank.size() == static_cast<size_t>(out.stages),
                PipelineError, "load_checkpoint: ", (fs::path(dir) / "manifest.json").string(),
                " has ", out.stages, " stages but a stage map of ", out.stage_to_rank.size());
  return out;
}

void load_stage_weights(const std::string& dir, const std::vector<torch::nn::Module*>& stages) {
  const CheckpointManifest manifest = read_checkpoint_manifest(dir);
  PIPEMAT_CHECK(stages.size() == static_cast<size_t>(manifest.stages), ConfigError,
                "load_stage_weights: ", dir, " holds ", manifest.stages, " stages but ",
                stages.size(), " modules were given");
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  std::map<int, std::vector<int>> by_rank;
  for (int s = 0; s < manifest.stages; ++s) by_rank[manifest.stage_to_rank[s]].push_back(s);
  for (const auto& [rank, owned] : by_rank) {
    const std::string file = rank_file(dir, rank);
    torch::serialize::InputArchive archive;
    open_rank_file(archive, file, rank);
    for (int s : owned) read_stage(archive, file, s, *stages[static_cast<size_t>(s)], copies);
  }
  at::NoGradGuard no_grad;
  for (auto& [to, value] : copies) to.copy_(value);
}

}  // namespace pipemat::pp
