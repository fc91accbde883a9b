// Loading a checkpoint: format 4 by global name on any layout (the load planner), formats 1 to 3
// on the layout that wrote them (checkpoint.cpp).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/serialize/input-archive.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_common.h"
#include "checkpoint_files.h"
#include "checkpoint_state.h"
#include "optimizer_state.h"
#include "pipeline_impl.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/pp/finite.h"
#include "pipemat/remat/memory.h"

namespace pipemat::pp {
namespace {

namespace fs = std::filesystem;
using detail::kGlobalFormat;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::vector<std::string> dims;
  for (int64_t d : shape) dims.push_back(std::to_string(d));
  return "[" + join(dims, ", ") + "]";
}

// Note [Checkpoint load planner]
// A load of format 4 reads, on each rank, exactly the tensors its stages hold, by name, from
// whichever files the manifest's index puts them in: each file opened once (its header read and
// checked, its size against the manifest's record, its run and step against the manifest's),
// then each piece of each tensor read by offset and its SHA-256 checked against the index. No
// other byte of the checkpoint is read, so a rank of a new layout reads its new stages' share,
// and a damaged byte anywhere in what it reads is found before anything is changed. Whole-file
// digests (the manifest's "files") are for verify_checkpoint, which reads everything.
class Reader {
 public:
  Reader(std::string dir, const CheckpointManifest& manifest, bool allow_non_finite)
      : dir_(std::move(dir)), manifest_(manifest), finite_(!allow_non_finite) {}

  int64_t bytes_read() const { return bytes_; }

  // The tensor `t`, from its pieces, each checked: all of them, or with `ranges` only the pieces
  // that hold an element of one of those element ranges (the rest zeros).
  at::Tensor read(const CheckpointTensor& t,
                  const std::vector<std::pair<int64_t, int64_t>>* ranges = nullptr) {
    const at::ScalarType type = scalar_type_of(*weights::dtype_from_string(t.dtype));
    at::Tensor out = ranges == nullptr ? at::empty(t.shape, at::TensorOptions().dtype(type))
                                       : at::zeros(t.shape, at::TensorOptions().dtype(type));
    at::Tensor flat = out.view({-1});
    for (const CheckpointPiece& piece : t.pieces) {
      if (ranges != nullptr &&
          std::none_of(ranges->begin(), ranges->end(), [&](const std::pair<int64_t, int64_t>& r) {
            return r.first < piece.end && piece.begin < r.second;
          })) {
        continue;
      }
      const weights::SafetensorsFile& f = file(piece.file);
      const std::string where = f.path() + ": tensor '" + piece.key + "'";
      const weights::TensorInfo* info = f.find(piece.key);
      PIPEMAT_CHECK(info != nullptr, PipelineError, "load_checkpoint: ", f.path(),
                    " holds no tensor '", piece.key,
                    "', which the manifest puts there; the "
                    "file is damaged or was replaced");
      const bool whole = piece.begin == 0 && piece.end == t.numel();
      PIPEMAT_CHECK(
          weights::to_string(info->dtype) == t.dtype && info->numel() == piece.end - piece.begin &&
              (!whole || info->shape == t.shape || t.numel() == 0),
          PipelineError, "load_checkpoint: ", where, " is ", weights::to_string(info->dtype), " ",
          shape_text(info->shape), " but the manifest records ", t.dtype, " with ",
          piece.end - piece.begin, " elements; the file is damaged or was replaced");
      at::Tensor part = flat.slice(0, piece.begin, piece.end);
      f.read(piece.key, part.data_ptr());
      bytes_ += info->bytes();
      const std::string got = sha256_hex(std::string_view(static_cast<const char*>(part.data_ptr()),
                                                          static_cast<size_t>(info->bytes())));
      PIPEMAT_CHECK(got == piece.sha256, PipelineError, "load_checkpoint: ", where,
                    " is damaged or was replaced: its SHA-256 is ", got.substr(0, 16),
                    "... but the manifest recorded ", piece.sha256.substr(0, 16),
                    "... when it was written; nothing was loaded. Load an older checkpoint");
    }
    if (const auto bad = finite_ ? non_finite(out) : std::nullopt; bad) {
      std::vector<std::string> files;  // the files of its pieces, each once
      for (const CheckpointPiece& piece : t.pieces) {
        const std::string f = (fs::path(dir_) / piece.file).string();
        if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
      }
      PIPEMAT_THROW(PipelineError, "load_checkpoint: ", join(files, ", "), ": tensor '", t.name,
                    "' ", *bad, "; ", kNonFiniteAdvice);
    }
    return out;
  }

 private:
  const weights::SafetensorsFile& file(const std::string& name) {
    const auto it = open_.find(name);
    if (it != open_.end()) return it->second;
    const std::string path = (fs::path(dir_) / name).string();
    std::error_code ec;
    PIPEMAT_CHECK(fs::exists(path, ec), PipelineError, "load_checkpoint: ", path,
                  " is missing; the manifest puts tensors there");
    // The manifest records every file a piece names (manifest_from_json checks it).
    const auto record = std::find_if(manifest_.files.begin(), manifest_.files.end(),
                                     [&](const CheckpointFileRecord& r) { return r.name == name; });
    PIPEMAT_INTERNAL_ASSERT(record != manifest_.files.end(), "a piece in an unrecorded file");
    const uint64_t want = record->bytes;
    // Note [Opening an input file] (pipemat/core/files.h): a FIFO or a device is refused here,
    // unread; a file of another size than the manifest's record is not parsed.
    const int64_t size = open_input_file<PipelineError>(path, "load_checkpoint").size();
    PIPEMAT_CHECK(static_cast<uint64_t>(size) == want, PipelineError, "load_checkpoint: ", path,
                  " is damaged or was replaced: it holds ", size, " bytes but ",
                  detail::manifest_path(dir_), " recorded ", want,
                  " when it was written; nothing was loaded. Load an older checkpoint");
    std::unique_ptr<weights::SafetensorsFile> f;
    try {
      f = std::make_unique<weights::SafetensorsFile>(path);
    } catch (const WeightsError& e) {
      PIPEMAT_THROW(PipelineError, "load_checkpoint: ", path,
                    " is damaged (not the file pipemat wrote): ", e.what());
    }
    PIPEMAT_CHECK(static_cast<uint64_t>(f->size()) == want, PipelineError,
                  "load_checkpoint: ", path, " changed while it was read (", f->size(),
                  " bytes, then ", size, ")");
    const auto& meta = f->metadata();
    const auto run = meta.find("pipemat.run");
    const auto step = meta.find("pipemat.step");
    PIPEMAT_CHECK(run != meta.end() && run->second == manifest_.run_id && step != meta.end() &&
                      step->second == std::to_string(manifest_.step),
                  PipelineError, "load_checkpoint: ", path, " is a file of run ",
                  run == meta.end() ? std::string("(none)") : run->second, " step ",
                  step == meta.end() ? std::string("(none)") : step->second,
                  ", but the manifest beside it is of run ", manifest_.run_id, " step ",
                  manifest_.step, "; a file of another run or step is never loaded");
    bytes_ += f->data_start();
    return open_.emplace(name, std::move(*f)).first->second;
  }

  std::string dir_;
  const CheckpointManifest& manifest_;
  bool finite_ = true;
  std::map<std::string, weights::SafetensorsFile> open_;
  int64_t bytes_ = 0;
};

// The tensor `name` of the manifest for `what`, of `like`'s shape and dtype; PipelineError naming
// both otherwise.
const CheckpointTensor& find_tensor(const CheckpointManifest& manifest, const std::string& dir,
                                    const std::string& name, const std::string& what,
                                    const at::Tensor& like) {
  const CheckpointTensor* t = manifest.find(name);
  PIPEMAT_CHECK(t != nullptr, PipelineError, "load_checkpoint: ", dir, " holds no tensor '", name,
                "' (", what,
                "); it was written by another model (a layer fewer, or other names: "
                "Note [Global names])");
  const std::string dtype =
      weights::to_string(safetensors_dtype(like.scalar_type(), "load_checkpoint: " + what));
  PIPEMAT_CHECK(t->shape == like.sizes().vec() && t->dtype == dtype, PipelineError,
                "load_checkpoint: ", dir, ": tensor '", name, "' is ", t->dtype, " ",
                shape_text(t->shape), " in the checkpoint but ", dtype, " ",
                shape_text(like.sizes().vec()), " in this model (", what,
                "); it was written by another model");
  return *t;
}

// What must not change across a resume, checked against the pipeline: the micro-batches of a
// step (micro-batches x data replicas), the seed and the optimizer's kind.
void check_unchanged(const Pipeline& pipeline, const CheckpointManifest& m,
                     const std::string& dir) {
  const int64_t had = int64_t{m.micro_batches} * m.replicas;
  const int replicas = detail::PipelineAccess::replicas(pipeline);
  const int64_t has = int64_t{pipeline.schedule().micro_batches} * replicas;
  PIPEMAT_CHECK(had == has, ConfigError, "load_checkpoint: ", dir, " was written with ",
                m.micro_batches, " micro-batches x ", m.replicas, " data replicas = ", had,
                " micro-batches per step, this pipeline has ", pipeline.schedule().micro_batches,
                " x ", replicas, " = ", has,
                "; a resume keeps the global batch (the micro-batch count times the data degree)");
  const std::string seed = detail::PipelineAccess::seed(pipeline);
  PIPEMAT_CHECK(m.seed == seed, ConfigError, "load_checkpoint: ", dir, " was written with ",
                m.seed.empty() ? std::string("no seed") : "seed " + m.seed,
                " but this pipeline has ", seed.empty() ? std::string("none") : "seed " + seed,
                "; a resume keeps the seed (PipelineOptions::seed)");
  const std::string kind = detail::PipelineAccess::optimizer_kind(pipeline);
  const auto named = [](const std::string& k) { return k.empty() ? std::string("another") : k; };
  PIPEMAT_CHECK(m.optimizer == kind, ConfigError, "load_checkpoint: ", dir, " holds the state of ",
                m.optimizer.empty() ? "an optimizer other than the five" : m.optimizer,
                " but this pipeline's optimizer is ", named(kind));
}

// What one rank read of a checkpoint of format 4, checked, to apply once every rank has.
struct Loaded {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // destination, value
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  // Another optimizer than the five: its own archive of this rank (then `optimizer` is unused).
  std::unique_ptr<torch::serialize::InputArchive> archive;
  at::Tensor rng;
  std::vector<std::string> names;  // every tensor read
  int64_t bytes_read = 0;
  int64_t tensor_bytes = 0;  // of the tensors read
};

Loaded read_global(const Pipeline& pipeline, const std::string& dir,
                   const CheckpointManifest& manifest, bool allow_non_finite) {
  check_unchanged(pipeline, manifest, dir);
  Reader reader(dir, manifest, allow_non_finite);
  Loaded out;
  // `t` read whole, or (Note [Sharded optimizer]) only where `ranges` says this replica keeps it.
  const auto take = [&](const CheckpointTensor& t,
                        const std::vector<std::pair<int64_t, int64_t>>* ranges = nullptr) {
    at::Tensor value = reader.read(t, ranges);
    out.names.push_back(t.name);
    if (ranges == nullptr) {
      out.tensor_bytes += static_cast<int64_t>(value.nbytes());
    } else {
      for (const auto& [begin, end] : *ranges)
        out.tensor_bytes += (end - begin) * value.element_size();
    }
    return value;
  };
  const auto kept = detail::PipelineAccess::kept_ranges(pipeline);
  for (const detail::Wanted& w : detail::PipelineAccess::wanted(pipeline, manifest.ties)) {
    const CheckpointTensor& t = find_tensor(manifest, dir, w.name, w.what, w.into);
    out.copies.emplace_back(w.into, take(t));
  }
  // The optimizer's state, by its parameters' names; a parameter never stepped has none.
  const std::string kind = manifest.optimizer;
  if (kind.empty()) {
    // Another optimizer: its own archive of this rank, on the layout that wrote it only.
    const schedule::Schedule& plan = pipeline.schedule();
    PIPEMAT_CHECK(manifest.world_size == plan.ranks_count && manifest.stages == plan.stages_count &&
                      manifest.stage_to_rank == plan.stage_to_rank &&
                      manifest.replicas == detail::PipelineAccess::replicas(pipeline),
                  ConfigError, "load_checkpoint: ", dir,
                  " holds the state of an optimizer other than torch's SGD, Adam, AdamW, RMSprop "
                  "or Adagrad, stored per rank: it resumes on the layout that wrote it (",
                  describe_layout(manifest), "), not on ", describe_layout(pipeline));
    const std::string name = detail::optimizer_blob_name(pipeline.rank());
    const CheckpointTensor* blob = manifest.find(name);
    PIPEMAT_CHECK(blob != nullptr && blob->dtype == "U8" && blob->shape.size() == 1, PipelineError,
                  "load_checkpoint: ", dir, " holds no optimizer state of rank ", pipeline.rank(),
                  " ('", name, "'); the checkpoint is damaged");
    const at::Tensor bytes = take(*blob);
    torch::serialize::InputArchive archive;
    try {
      archive.load_from(static_cast<const char*>(bytes.data_ptr()),
                        static_cast<size_t>(bytes.numel()));
      out.archive = std::make_unique<torch::serialize::InputArchive>(std::move(archive));
    } catch (const c10::Error& e) {
      PIPEMAT_THROW(PipelineError, "load_checkpoint: ", dir, ": the optimizer state of rank ",
                    pipeline.rank(), " cannot be read: ", std::string(e.what()).substr(0, 200));
    }
  }
  std::map<size_t, std::unique_ptr<torch::optim::OptimizerParamState>> states;
  const auto params = detail::PipelineAccess::named_parameters(pipeline, manifest.ties);
  for (size_t i = 0; i < params.size() && !kind.empty(); ++i) {
    const auto& [name, param] = params[i];
    const std::vector<std::string>& fields = detail::state_fields(kind);
    std::vector<at::Tensor> values(fields.size());
    bool any = false;
    for (size_t f = 0; f < fields.size(); ++f) {
      if (manifest.find(name + ":" + fields[f]) == nullptr) continue;
      values[f] = take(find_tensor(manifest, dir, name + ":" + fields[f],
                                   "the optimizer state of '" + name + "'", param),
                       kept.empty() ? nullptr : &kept.at(i))
                      .to(param.device());
      any = true;
    }
    const CheckpointTensor* step = manifest.find(name + ":step");
    if (!any && step == nullptr) continue;
    int64_t count = 0;
    if (step != nullptr) {
      PIPEMAT_CHECK(step->dtype == "I64" && step->shape.empty(), PipelineError,
                    "load_checkpoint: ", dir, ": tensor '", step->name, "' is ", step->dtype, " ",
                    shape_text(step->shape), ", not one int64; the checkpoint is damaged");
      count = take(*step).item<int64_t>();
    }
    states[i] = detail::make_state(kind, count, values);
  }
  out.optimizer = detail::PipelineAccess::optimizer_with(pipeline, std::move(states));
  if (const CheckpointTensor* rng = manifest.find(detail::kGeneratorTensor);
      rng != nullptr && pipeline.generator().defined()) {
    out.rng = take(find_tensor(manifest, dir, rng->name, "the generator state",
                               pipeline.generator().get_state()));
  }
  out.bytes_read = reader.bytes_read();
  return out;
}

// Every tensor of the checkpoint is read by some rank (`names` from every rank): one that no
// stage holds is a model that changed (a layer removed, a name changed).
void check_covered(const CheckpointManifest& manifest, const std::string& dir,
                   const std::vector<std::string>& names) {
  const std::set<std::string> read(names.begin(), names.end());
  for (const CheckpointTensor& t : manifest.tensors) {
    if (read.count(t.name) > 0 || t.name == detail::kGeneratorTensor) continue;
    PIPEMAT_THROW(PipelineError, "load_checkpoint: ", dir, " holds tensor '", t.name, "' (",
                  t.dtype, " ", shape_text(t.shape),
                  "), which no stage of this pipeline holds; it was written by another model (a "
                  "layer more, or other names: Note [Global names])");
  }
}

CheckpointLoad load_global(Pipeline& pipeline, comm::Transport& transport, const std::string& dir,
                           const CheckpointManifest& manifest, bool allow_non_finite) {
  // What the load holds above what the process held before it (its peak: the tensors read, until
  // they are copied in).
  const int64_t before = remat::begin_peak_window();
  Loaded loaded;
  detail::agree_on(
      transport, "load_checkpoint",
      [&] { loaded = read_global(pipeline, dir, manifest, allow_non_finite); },
      [&](int r) {
        return "could not load its part of " + dir +
               " (its error says why); nothing was loaded "
               "on any rank";
      });
  // Every rank got here: the names each read, so that no tensor of the checkpoint goes unused.
  const std::vector<std::string> all =
      lines_of_all_ranks(transport, detail::kLoadNamesTag, loaded.names);
  check_covered(manifest, dir, all);
  {
    at::NoGradGuard no_grad;
    for (auto& [to, value] : loaded.copies) to.copy_(value);
  }
  if (loaded.archive != nullptr) {
    try {
      pipeline.load_optimizer_state(*loaded.archive);
    } catch (const c10::Error& e) {
      PIPEMAT_THROW(PipelineError, "load_checkpoint: ", dir, ": the optimizer state of rank ",
                    pipeline.rank(),
                    " does not fit this optimizer: ", std::string(e.what()).substr(0, 200));
    }
  } else {
    pipeline.load_optimizer_state(*loaded.optimizer);
  }
  if (loaded.rng.defined()) pipeline.generator().set_state(loaded.rng);
  pipeline.set_step(manifest.step);
  const int64_t peak = std::max<int64_t>(0, remat::window_peak_bytes() - before);
  // Every rank's bytes, for the report: "<read> <tensors> <peak>", one line per rank in rank
  // order.
  const std::vector<std::string> stats =
      lines_of_all_ranks(transport, detail::kLoadNamesTag,
                         {std::to_string(loaded.bytes_read) + " " +
                          std::to_string(loaded.tensor_bytes) + " " + std::to_string(peak)});
  transport.barrier();
  CheckpointLoad out;
  out.bytes_read = loaded.bytes_read;
  out.tensor_bytes = loaded.tensor_bytes;
  out.peak_bytes = peak;
  for (const std::string& line : stats) {
    long long read = 0, tensors = 0, held = 0;
    PIPEMAT_CHECK(std::sscanf(line.c_str(), "%lld %lld %lld", &read, &tensors, &held) == 3,
                  CommError, "load_checkpoint: a peer sent a malformed report of its load");
    out.rank_bytes_read.push_back(read);
    out.rank_tensor_bytes.push_back(tensors);
    out.rank_peak_bytes.push_back(held);
  }
  out.from = manifest;
  return out;
}

}  // namespace

std::string describe_layout(const CheckpointManifest& m,
                            const std::vector<int64_t>& layers_per_stage) {
  std::string layers;
  if (!layers_per_stage.empty()) {
    std::vector<std::string> items;
    for (int64_t n : layers_per_stage) items.push_back(std::to_string(n));
    layers = ", [" + join(items, ",") + "]";
  }
  const int per_rank = m.world_size > 0 ? m.stages / m.world_size : 0;
  return ::pipemat::detail::concat(
      m.world_size, m.world_size == 1 ? " rank (" : " ranks (", m.schedule_kind, layers,
      per_rank > 1 ? ::pipemat::detail::concat(", ", m.stages, " virtual stages") : std::string(),
      ", D=", std::max(m.replicas, 1), m.sharded ? " sharded" : "", ")");
}

std::string describe_layout(const Pipeline& pipeline,
                            const std::vector<int64_t>& layers_per_stage) {
  CheckpointManifest m;
  m.world_size = pipeline.schedule().ranks_count;
  m.stages = pipeline.schedule().stages_count;
  m.schedule_kind = schedule::to_string(pipeline.schedule().kind);
  m.replicas = detail::PipelineAccess::replicas(pipeline);
  m.sharded = pipeline.shards_optimizer();
  return describe_layout(m, layers_per_stage);
}

CheckpointLoad load_checkpoint(Pipeline& pipeline, comm::Transport& transport,
                               const std::string& dir, bool allow_non_finite) {
  CheckpointManifest manifest;
  detail::agree_on(
      transport, "load_checkpoint", [&] { manifest = read_checkpoint_manifest(dir); },
      [&](int) {
        return "could not read " + detail::manifest_path(dir) + " (its error says why)";
      });
  if (manifest.format < kGlobalFormat) {
    detail::load_legacy_checkpoint(pipeline, transport, dir, allow_non_finite);
    CheckpointLoad out;
    out.from = manifest;
    return out;
  }
  return load_global(pipeline, transport, dir, manifest, allow_non_finite);
}

CheckpointManifest read_checkpoint_manifest(const std::string& dir) {
  nlohmann::json json;
  return detail::read_manifest(dir, json);
}

void load_stage_weights(const std::string& dir, const std::vector<const PipelineStage*>& stages,
                        bool allow_non_finite) {
  const CheckpointManifest manifest = read_checkpoint_manifest(dir);
  if (manifest.format < kGlobalFormat) {
    std::vector<torch::nn::Module*> modules;
    for (const PipelineStage* s : stages) modules.push_back(s->module.get());
    detail::load_legacy_stage_weights(dir, modules, allow_non_finite);
    return;
  }
  Reader reader(dir, manifest, allow_non_finite);
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const PipelineStage* s : stages) {
    const auto name_of = [&](const std::string& local) {
      if (const auto tie = s->tied.find(local); tie != s->tied.end()) {
        if (const auto stored = manifest.ties.find(tie->second); stored != manifest.ties.end())
          return stored->second;
      }
      return detail::stage_global_name(*s, local);
    };
    for (const auto& item : s->module->named_parameters()) {
      const std::string what =
          "stage " + std::to_string(s->index) + "'s parameter '" + item.key() + "'";
      copies.emplace_back(item.value(), reader.read(find_tensor(manifest, dir, name_of(item.key()),
                                                                what, item.value())));
    }
    for (const auto& item : s->module->named_buffers()) {
      const std::string what =
          "stage " + std::to_string(s->index) + "'s buffer '" + item.key() + "'";
      copies.emplace_back(item.value(), reader.read(find_tensor(manifest, dir, name_of(item.key()),
                                                                what, item.value())));
    }
  }
  at::NoGradGuard no_grad;
  for (auto& [to, value] : copies) to.copy_(value);
}

}  // namespace pipemat::pp
