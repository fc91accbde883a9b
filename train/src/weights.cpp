// A model's weights as safetensors files: pipemat/train/weights.h.

#include "pipemat/train/weights.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "pipemat/core/error.h"
#include "pipemat/models/llama.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/pp/finite.h"
#include "pipemat/pp/tensor_dtype.h"
#include "pipemat/train/config.h"
#include "pipemat/weights/hf_config.h"
#include "pipemat/weights/safetensors.h"

#ifndef PIPEMAT_VERSION
#define PIPEMAT_VERSION "unknown"
#endif

namespace pipemat::train {
namespace {

using pp::scalar_type_of;

// The `model:` section of `config` as YAML.
std::string model_yaml(const TrainConfig& config) {
  const YAML::Node root = YAML::Load(config_to_yaml(config));
  YAML::Emitter out;
  out << YAML::BeginMap << YAML::Key << "model" << YAML::Value << root["model"] << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

// `text` as a YAML double-quoted scalar (JSON's string syntax is one).
std::string yaml_quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// At most `limit` of `items`, then how many more.
std::string listed(const std::vector<std::string>& items, size_t limit = 20) {
  std::string s;
  for (size_t i = 0; i < items.size() && i < limit; ++i) s += (i ? ", " : "") + items[i];
  if (items.size() > limit) s += ", and " + std::to_string(items.size() - limit) + " more";
  return s;
}

// A Hugging Face LlamaConfig of the llama of `config` (the config.json transformers loads the
// exported file with; weights/hf_config.h writes it).
std::string llama_config_json(const TrainConfig& config) {
  const models::LlamaShape shape = models::llama_shape(config.model);
  weights::LlamaConfig c;
  c.vocab_size = shape.vocab;
  c.hidden_size = shape.hidden;
  c.intermediate_size = shape.ffn;
  c.num_hidden_layers = shape.layers;
  c.num_attention_heads = shape.heads;
  c.num_key_value_heads = shape.kv_heads;
  c.max_position_embeddings = shape.seq_len;
  c.rms_norm_eps = shape.norm_eps;
  c.rope_theta = shape.rope_theta;
  c.tie_word_embeddings = shape.tie_embeddings;
  return weights::write_llama_config(c);
}

// `text` into the new file `path` (export's temporary: Note [Export never destroys]);
// WeightsError naming it, with the file removed, when it cannot be written.
void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  if (!out.good()) {
    out.close();
    std::error_code ignore;
    std::filesystem::remove(path, ignore);
    PIPEMAT_THROW(WeightsError, "export: cannot write ", path);
  }
}

// A tied llama has no lm_head.weight; a file that stores the head anyway (transformers may save
// both names of the one tensor) is read when the head holds the embedding's very bytes.
bool tied_copy(const weights::WeightSource& source, models::ModelKind kind, const std::string& name,
               const WeightShapes& model) {
  const std::string embedding = "model.embed_tokens.weight";
  if (kind != models::ModelKind::kLlama || name != "lm_head.weight" || model.count(embedding) == 0)
    return false;
  const weights::TensorInfo* head = source.find(name);
  const weights::TensorInfo* embed = source.find(embedding);
  if (head == nullptr || embed == nullptr || head->shape != embed->shape ||
      head->dtype != embed->dtype) {
    return false;
  }
  std::vector<char> a(static_cast<size_t>(head->bytes())), b(a.size());
  if (!a.empty()) source.read(name, a.data()), source.read(embedding, b.data());
  return a == b;
}

}  // namespace

WeightNameMap weight_name_map(models::ModelKind kind) {
  // A kind with names of its own returns its map here (Note [Weight names]).
  if (kind == models::ModelKind::kLlama) {
    // Hugging Face's LlamaForCausalLM names: "model.layers.<i>.self_attn.q_proj.weight", ...
    return [](const std::string& name) { return models::llama_hf_name(name); };
  }
  return [](const std::string& name) { return name; };
}

bool ignored_weight_name(models::ModelKind kind, const std::string& name) {
  // Older transformers saved the rotary embedding's inverse frequencies, a buffer computed from
  // rope_theta, as "model.rotary_emb.inv_freq" or "model.layers.<i>.self_attn.rotary_emb.inv_freq".
  if (kind != models::ModelKind::kLlama) return false;
  if (name == "model.rotary_emb.inv_freq") return true;
  const std::string prefix = "model.layers.", suffix = ".self_attn.rotary_emb.inv_freq";
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const std::string index = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  return std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::pair<std::string, at::Tensor>> named_model_weights(const ModelRun& run,
                                                                    models::ModelKind kind) {
  const WeightNameMap map = weight_name_map(kind);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int s = 0; s < run.stages; ++s) {
    for (const auto& item : run.stage(s).module->named_parameters()) {
      out.emplace_back(map(run.global_name(s, item.key())), item.value());
    }
  }
  return out;
}

WeightShapes model_weight_shapes(const ModelRun& run, models::ModelKind kind) {
  WeightShapes shapes;
  for (const auto& [name, tensor] : named_model_weights(run, kind)) {
    // A name twice is a tied weight's copies (Note [Tied weights]): one weight of one shape.
    const auto [it, fresh] = shapes.emplace(name, tensor.sizes().vec());
    PIPEMAT_INTERNAL_ASSERT(fresh || it->second == tensor.sizes().vec(),
                            "two parameters of the model are named '", name, "'");
  }
  return shapes;
}

// Note [Export never destroys]
// `pipemat export` writes beside files a user cares about, so before anything is read it
// refuses: an empty --out; a destination that is a symlink (it would replace the link, or write
// where the link points); one inside a checkpoint directory (its directory, or an ancestor of
// it, holds a manifest.json and a rank-0.safetensors, or before format 4 a rank-0.pt: `--out
// CK/rank-0.safetensors` or `--out CK/manifest.json` would destroy the checkpoint it reads); one
// that is not a regular file; an existing file unless
// `overwrite`. The same for config.json beside a llama's file. Then every file is written under a
// temporary name in its destination's directory, and only when all are complete are they renamed
// into place: a failure before leaves no file and no temporary behind; a rename that fails after an
// earlier one removes the file that earlier rename made.
namespace {

// A destination, checked (Note [Export never destroys]); its temporary name.
struct Destination {
  std::string path;
  std::string tmp;
};

Destination export_destination(const std::string& path, bool overwrite) {
  namespace fs = std::filesystem;
  PIPEMAT_CHECK(!path.empty(), ConfigError,
                "export: --out is empty; give the path of the .safetensors file to write");
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(path, ec);
  PIPEMAT_CHECK(!fs::is_symlink(link), ConfigError, "export: ", path,
                " is a symbolic link; export never writes through a link (give the path of the "
                "file itself)");
  // Every directory from the destination's up to the root: none may be a checkpoint.
  fs::path dir = fs::weakly_canonical(fs::absolute(fs::path(path), ec).parent_path(), ec);
  for (; !dir.empty(); dir = dir.parent_path()) {
    const bool checkpoint =
        fs::exists(dir / "manifest.json", ec) &&
        (fs::exists(dir / "rank-0.safetensors", ec) || fs::exists(dir / "rank-0.pt", ec));
    PIPEMAT_CHECK(!checkpoint, ConfigError, "export: ", path,
                  " is inside the checkpoint directory ", dir.string(),
                  "; export never writes into a checkpoint: give a path outside it");
    if (dir == dir.parent_path()) break;
  }
  if (fs::exists(link)) {
    PIPEMAT_CHECK(fs::is_regular_file(link), ConfigError, "export: ", path,
                  " exists and is not a regular file; give the path of a file to write");
    PIPEMAT_CHECK(overwrite, ConfigError, "export: ", path,
                  " exists; export never replaces a file unless told to (--overwrite)");
  }
  const fs::path p(path);
  return {path, (p.parent_path() / ("." + p.filename().string() + ".pipemat-export-" +
                                    std::to_string(::getpid()) + ".tmp"))
                    .string()};
}

// Renames every temporary into place, in order; when one fails, removes what the earlier ones
// made and every remaining temporary.
void publish_all(const std::vector<Destination>& files) {
  for (size_t i = 0; i < files.size(); ++i) {
    std::error_code ec;
    std::filesystem::rename(files[i].tmp, files[i].path, ec);
    if (!ec) continue;
    std::error_code ignore;
    for (size_t j = 0; j < i; ++j) std::filesystem::remove(files[j].path, ignore);
    for (size_t j = i; j < files.size(); ++j) std::filesystem::remove(files[j].tmp, ignore);
    PIPEMAT_THROW(WeightsError, "export: cannot rename ", files[i].tmp, " to ", files[i].path, ": ",
                  ec.message(), "; no file was exported");
  }
}

}  // namespace

ExportSummary export_weights(const std::string& dir, const std::string& out, bool overwrite) {
  std::vector<Destination> files = {export_destination(out, overwrite)};
  const pp::CheckpointManifest manifest = pp::read_checkpoint_manifest(dir);
  PIPEMAT_CHECK(!manifest.metadata.empty(), ConfigError, "export: ", dir,
                " holds no run config in its manifest; export a checkpoint that `pipemat train` "
                "wrote");
  const TrainConfig config = parse_config(manifest.metadata, dir + "/manifest.json (metadata)");
  const ModelRun run = make_model_weights(config, manifest.stages);
  std::vector<pp::PipelineStage> stages;
  for (int s = 0; s < manifest.stages; ++s) stages.push_back(run.stage(s));
  std::vector<const pp::PipelineStage*> named;
  for (const auto& stage : stages) named.push_back(&stage);
  pp::load_stage_weights(dir, named, config.training.allow_non_finite);

  const WeightNameMap map = weight_name_map(config.model.kind);
  std::vector<at::Tensor> keep;  // the float32 CPU copies the views below point into
  std::vector<weights::TensorBytes> tensors;
  ExportSummary summary;
  std::map<std::string, at::Tensor> written;  // name -> value, for the copies of a tied weight
  for (int s = 0; s < manifest.stages; ++s) {
    for (const auto& item : stages[static_cast<size_t>(s)].module->named_parameters()) {
      const std::string name = map(run.global_name(s, item.key()));
      if (const auto copy = written.find(name); copy != written.end()) {
        // Note [Tied weights]: one weight, written once; its copies must hold the same bits.
        PIPEMAT_CHECK(at::equal(copy->second, item.value().detach().to(at::kCPU)), WeightsError,
                      "export: ", dir, ": the copies of the tied weight '", name,
                      "' differ between the stages that hold it (stage ", s,
                      "); the checkpoint is damaged");
        continue;
      }
      written.emplace(name, item.value().detach().to(at::kCPU));
      keep.push_back(item.value().detach().to(at::kCPU, at::kFloat).contiguous());
      const at::Tensor& t = keep.back();
      tensors.push_back({name, weights::Dtype::kF32, t.sizes().vec(),
                         std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
      summary.elements += t.numel();
    }
  }
  summary.tensors = static_cast<int64_t>(tensors.size());
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {kKindKey, to_string(config.model.kind)},
                                                       {kModelKey, model_yaml(config)},
                                                       {kVersionKey, PIPEMAT_VERSION}};
  const std::filesystem::path parent = std::filesystem::path(out).parent_path();
  if (config.model.kind == models::ModelKind::kLlama) {
    // Hugging Face's LlamaConfig next to the file: the directory loads in transformers.
    summary.config_json =
        (parent.empty() ? std::filesystem::path("config.json") : parent / "config.json").string();
    files.push_back(export_destination(summary.config_json, overwrite));
  }
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    PIPEMAT_CHECK(!ec, WeightsError, "export: cannot create the directory ", parent.string(),
                  " of ", out, ": ", ec.message());
  }
  try {
    weights::write_safetensors_file(files[0].tmp, std::move(tensors), metadata);
    if (files.size() > 1) write_text_file(files[1].tmp, llama_config_json(config));
  } catch (...) {
    std::error_code ignore;
    for (const Destination& d : files) std::filesystem::remove(d.tmp, ignore);
    throw;
  }
  publish_all(files);
  struct stat st {};
  summary.bytes = ::stat(out.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
  summary.path = out;
  summary.kind = to_string(config.model.kind);
  summary.step = manifest.step;
  summary.stages = manifest.stages;
  summary.ranks = manifest.world_size;
  return summary;
}

LoadSummary load_weights(const std::string& path, const std::string& key, const WeightShapes& model,
                         const GlobalName& global_name, models::ModelKind kind,
                         const std::vector<std::pair<int, torch::nn::Module*>>& stages,
                         bool allow_non_finite) {
  // The file is the config's: every rank finds the same fault in it, a ConfigError (Note [One
  // error line per failure] in launch/src/main.cpp: reported once).
  const weights::WeightSource source = [&] {
    try {
      return weights::WeightSource(path);
    } catch (const WeightsError& e) {
      throw ConfigError(key + ": " + e.what());
    }
  }();
  std::vector<std::string> missing;
  std::vector<std::string> extra;
  std::vector<std::string> misshaped;
  for (const auto& [name, shape] : model) {
    const weights::TensorInfo* t = source.find(name);
    if (t == nullptr) {
      missing.push_back(name + " " + shape_text(shape));
    } else if (t->shape != shape) {
      misshaped.push_back(name + " (" + shape_text(t->shape) + " in the file, the model's " +
                          shape_text(shape) + ")");
    }
  }
  for (const std::string& name : source.names()) {
    if (model.count(name) == 0 && !ignored_weight_name(kind, name) &&
        !tied_copy(source, kind, name, model)) {
      extra.push_back(name);
    }
  }
  if (!missing.empty() || !extra.empty() || !misshaped.empty()) {
    std::string what;
    const auto part = [&](const std::vector<std::string>& items, const std::string& label) {
      if (items.empty()) return;
      what += "; " + std::to_string(items.size()) + " " + label + ": " + listed(items);
    };
    part(missing, "missing");
    part(extra, "not in the model");
    part(misshaped, "of another shape");
    PIPEMAT_THROW(ConfigError, key, ": ", path, " does not hold the parameters of this model (",
                  model.size(), " tensors)", what,
                  ". The file's names must be the model's (pipemat export writes them)");
  }
  const WeightNameMap map = weight_name_map(kind);
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  LoadSummary summary;
  for (const auto& [s, module] : stages) {
    for (const auto& item : module->named_parameters()) {
      const std::string name = map(global_name(s, item.key()));
      const weights::TensorInfo* t = source.find(name);
      PIPEMAT_CHECK(t != nullptr && t->shape == item.value().sizes().vec(), WeightsError, key, ": ",
                    path, ": stage ", s, "'s parameter '", item.key(), "' (", name,
                    ") is not in the model's list of weights; a stage of another config?");
      // BOOL is read as bytes: a byte other than 0 or 1 is true, never an invalid bool.
      const bool as_bytes = t->dtype == weights::Dtype::kBool;
      at::Tensor value = at::empty(
          t->shape, at::TensorOptions().dtype(as_bytes ? at::kByte : scalar_type_of(t->dtype)));
      if (t->bytes() > 0) source.read(name, value.data_ptr());
      if (as_bytes) value = value.ne(0);
      value = value.to(item.value().scalar_type());  // the model's dtype: what is checked
      if (!allow_non_finite) {
        const auto bad = pp::non_finite(value);
        PIPEMAT_CHECK(!bad, ConfigError, key, ": ", source.file_of(name).path(), ": tensor '", name,
                      "' ", *bad, "; ", pp::kNonFiniteAdvice);
      }
      summary.bytes += t->bytes();
      copies.emplace_back(item.value(), std::move(value));
    }
  }
  at::NoGradGuard no_grad;
  for (auto& [to, value] : copies) to.copy_(value);
  summary.tensors = static_cast<int64_t>(copies.size());
  return summary;
}

TrainConfig config_of_weights(const std::string& path) {
  const weights::WeightSource source(path);
  const auto model = source.metadata().find(kModelKey);
  // A Hugging Face directory (transformers' save_pretrained): its config.json, as model.from.
  std::error_code ec;
  if (model == source.metadata().end() && std::filesystem::is_directory(path, ec) &&
      std::filesystem::is_regular_file(path + "/config.json", ec)) {
    return parse_config("model:\n  kind: llama\n  from: " + yaml_quoted(path) + "\n",
                        path + "/config.json", {"data.path=" + yaml_quoted(path)});
  }
  PIPEMAT_CHECK(model != source.metadata().end(), ConfigError, path,
                " holds no model config (metadata '", kModelKey,
                "'); it was not written by pipemat export");
  // Only the model is built from it; a gpt's config needs a data.path, which is never read here.
  TrainConfig config = parse_config(model->second, path + " (metadata " + kModelKey + ")",
                                    {"data.path=" + yaml_quoted(path)});
  // The tokenizer beside the weights (a Hugging Face directory keeps it there), if any.
  const std::filesystem::path dir = std::filesystem::is_directory(path, ec)
                                        ? std::filesystem::path(path)
                                        : std::filesystem::path(path).parent_path();
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const std::filesystem::path file = (dir.empty() ? std::filesystem::path(".") : dir) / name;
    if (std::filesystem::is_regular_file(file, ec)) {
      config.data.tokenizer = file.string();
      break;
    }
  }
  return config;
}

}  // namespace pipemat::train
