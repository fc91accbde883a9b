#pragma once
// A model's weights in and out of pipemat as safetensors files (pipemat/weights): `pipemat
// export` writes a checkpoint's parameters as one file under the names of the single-process
// model; training.init_from starts a run from such a file (or a directory of them); `pipemat
// generate` samples from one.

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/models/model.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/options.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace pipemat::train {

// Note [Weight names]
// A weight file names each parameter as the single-process model does: a stage's own name with
// its layer index made global (ModelRun::global_name: "blocks.<i>..." of gpt, "layers.<i>..." of
// the zoo and the llama), then passed through the model kind's name map, weight_name_map(kind).
// The map is the identity for every kind but those that give one: the llama's files follow
// Hugging Face's names (models::llama_hf_name), so a directory that transformers'
// save_pretrained wrote is read by init_from and one that export wrote is read by
// transformers. A kind whose files follow another convention adds its map to weight_name_map
// (train/src/weights.cpp); export and init_from then both use it, so a file written by export
// is read by init_from whatever the map. The map must be one-to-one.
// kLlama maps onto Hugging Face's names (models::llama_hf_name: "model.embed_tokens.weight",
// "model.layers.<i>.self_attn.q_proj.weight", ..., "model.norm.weight", "lm_head.weight"; a
// tied llama has no lm_head.weight, as Hugging Face's files of tied models have none).
using WeightNameMap = std::function<std::string(const std::string& global_name)>;
WeightNameMap weight_name_map(models::ModelKind kind);

// True for a tensor a file of model `kind` may hold that is no parameter and is ignored by
// load_weights: for kLlama, the rotary embedding's inv_freq buffer that older transformers
// versions saved ("model.rotary_emb.inv_freq", "model.layers.<i>.self_attn.rotary_emb.inv_freq";
// pipemat computes it from rope_theta). Only these known names: any other extra is an error.
bool ignored_weight_name(models::ModelKind kind, const std::string& name);

// The parameters of the whole model `run` (every stage s of run.stage), in stage order, by
// their file names (Note [Weight names]), as the stages hold them (not copied).
std::vector<std::pair<std::string, at::Tensor>> named_model_weights(const ModelRun& run,
                                                                    models::ModelKind kind);

// Metadata keys of an exported file (besides "format": "pt", which Hugging Face's loaders
// expect): the model kind, the `model:` section of the run's config as YAML (what generate
// needs to rebuild the model; not the data, the schedule or the step, so a run initialized from
// a file exports the same bytes again) and the pipemat version.
inline constexpr const char* kKindKey = "pipemat.kind";
inline constexpr const char* kModelKey = "pipemat.model";
inline constexpr const char* kVersionKey = "pipemat.version";

struct ExportSummary {
  std::string path;  // the written file
  std::string kind;  // model.kind
  int64_t step = 0;  // the checkpoint's
  int stages = 0;    // the checkpoint's stages, over `ranks` rank files
  int ranks = 0;
  int64_t tensors = 0;      // parameters written
  int64_t elements = 0;     // their numbers
  int64_t bytes = 0;        // the file's size
  std::string config_json;  // llama: the Hugging Face config.json written next to the file
};

// Not collective. Reads the run's config from the checkpoint `dir`'s manifest, builds its model
// (make_model_weights: the data need not exist), loads every rank file into it (checked as
// pp::load_stage_weights checks: digests, names, shapes, finite values unless the run's
// training.allow_non_finite) and writes every parameter as float32 to the safetensors file `out`
// (its directory created when missing) under its file name, with the metadata above. For a
// llama, also a Hugging Face LlamaConfig as config.json in the directory of `out`: name `out`
// <dir>/model.safetensors and transformers' LlamaForCausalLM.from_pretrained(<dir>) loads it.
// Every file or none (Note [Export never destroys] in src/weights.cpp): ConfigError, before
// anything is read, when `out` is empty, a symlink, inside a checkpoint directory, not a regular
// file, or exists and `overwrite` is false (the same for config.json). ConfigError when the
// manifest holds no config; PipelineError when the checkpoint is incomplete or damaged;
// WeightsError when a file cannot be written.
ExportSummary export_weights(const std::string& dir, const std::string& out,
                             bool overwrite = false);

// What load_weights read.
struct LoadSummary {
  int64_t tensors = 0;
  int64_t bytes = 0;  // read from the files
};

// The file name and shape of every parameter of the whole model `run` (every stage), to check
// a file against before run.release_unused drops the stages a rank does not hold.
using WeightShapes = std::map<std::string, std::vector<int64_t>>;
WeightShapes model_weight_shapes(const ModelRun& run, models::ModelKind kind);

// Loads the parameters of `stages` (stage index -> that stage's module, named as run.stage
// names them) from the safetensors file or directory `path` (weights::WeightSource). The file
// must hold exactly the whole model's parameters, `model` (model_weight_shapes), else one
// ConfigError, `key` first (e.g. "training.init_from"), names the file and lists every
// missing, extra and mis-shaped tensor (a file that is no valid safetensors file: a ConfigError
// with the reader's message after `key`); then only the tensors of `stages` are read, converted
// to each parameter's dtype and copied into it (on its device). Nothing is copied before every
// check passed. `global_name` is ModelRun::global_name (valid after release_unused).
// A NaN or an infinity in a tensor read (in the parameter's dtype) is a ConfigError naming the
// file, the tensor and the index, unless `allow_non_finite` (Note [Non-finite values at load] in
// pipemat/pp/finite.h).
using GlobalName = std::function<std::string(int stage, const std::string& name)>;
LoadSummary load_weights(const std::string& path, const std::string& key, const WeightShapes& model,
                         const GlobalName& global_name, models::ModelKind kind,
                         const std::vector<std::pair<int, torch::nn::Module*>>& stages,
                         bool allow_non_finite = false);

// The config of the model a weight file was exported with (its kModelKey metadata, parsed as a
// config holding only `model:`), or of a Hugging Face Llama directory without that metadata (its
// config.json read as model.from reads it); in both, a tokenizer.json or tokenizer.model beside
// the weights is data.tokenizer. ConfigError naming the file when it holds neither.
TrainConfig config_of_weights(const std::string& path);

}  // namespace pipemat::train
