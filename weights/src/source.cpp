// Weights from one safetensors file or a directory of them (safetensors.h).

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "pipemat/core/files.h"
#include "pipemat/core/json.h"
#include "pipemat/weights/safetensors.h"

namespace pipemat::weights {
namespace {

// {file: [names]} of the index `path`, every file a plain name in its directory.
std::map<std::string, std::vector<std::string>> read_index(const std::string& path) {
  const std::string text = read_whole_file<WeightsError>(path, "weights", kMaxHeaderBytes);
  nlohmann::json index;
  try {
    index = parse_json(text);  // Note [Strict JSON]: a tensor mapped twice is an error
  } catch (const JsonError& e) {
    if (e.kind() == JsonError::Kind::kSyntax) {
      PIPEMAT_THROW(WeightsError, "weights: ", path, ": not valid JSON (", e.what(), ")");
    }
    if (e.kind() == JsonError::Kind::kDuplicateKey &&
        e.path() == std::vector<std::string>{"weight_map"}) {
      PIPEMAT_THROW(WeightsError, "weights: ", path, ": tensor '", e.key(),
                    "' appears twice in weight_map");
    }
    PIPEMAT_THROW(WeightsError, "weights: ", path, ": ", e.what());
  }
  PIPEMAT_CHECK(
      index.is_object() && index.contains("weight_map") && index.at("weight_map").is_object(),
      WeightsError, "weights: ", path,
      ": expected an object with \"weight_map\": {tensor name: file name}");
  std::map<std::string, std::vector<std::string>> files;
  for (const auto& item : index.at("weight_map").items()) {
    PIPEMAT_CHECK(item.value().is_string(), WeightsError, "weights: ", path, ": tensor '",
                  item.key(), "' maps to ", item.value().dump(), ", expected a file name");
    const std::string file = item.value().get<std::string>();
    PIPEMAT_CHECK(
        !file.empty() && file.find('/') == std::string::npos && file != "." && file != "..",
        WeightsError, "weights: ", path, ": tensor '", item.key(), "' maps to '", file,
        "', expected the name of a file in the index's directory");
    files[file].push_back(item.key());
  }
  return files;
}

}  // namespace

WeightSource::WeightSource(const std::string& path) : path_(path) {
  if (!is_directory(path)) {
    files_.emplace_back(path);
    for (const TensorInfo& t : files_[0].tensors()) file_by_name_[t.name] = 0;
    metadata_ = files_[0].metadata();
    return;
  }
  const std::string index = path + "/" + kIndexFile;
  if (!path_exists(index)) {
    const std::string single = path + "/model.safetensors";
    PIPEMAT_CHECK(path_exists(single), WeightsError, "weights: the directory '", path,
                  "' holds neither ", kIndexFile, " nor model.safetensors");
    files_.emplace_back(single);
    for (const TensorInfo& t : files_[0].tensors()) file_by_name_[t.name] = 0;
    metadata_ = files_[0].metadata();
    return;
  }
  const auto files = read_index(index);
  std::map<std::string, std::string> owner;  // tensor -> file, as the index says
  for (const auto& [file, names] : files) {
    for (const std::string& name : names) owner[name] = file;
  }
  for (const auto& [file, names] : files) {
    files_.emplace_back(path + "/" + file);
    const SafetensorsFile& f = files_.back();
    const size_t i = files_.size() - 1;
    for (const std::string& name : names) {
      PIPEMAT_CHECK(f.find(name) != nullptr, WeightsError, "weights: ", index, " maps tensor '",
                    name, "' to ", file, ", which has no such tensor");
      file_by_name_[name] = i;
    }
    for (const TensorInfo& t : f.tensors()) {
      const auto at = owner.find(t.name);
      PIPEMAT_CHECK(at != owner.end() && at->second == file, WeightsError, "weights: ", f.path(),
                    " holds tensor '", t.name, "', which ", index,
                    at == owner.end() ? std::string(" does not name") : " maps to " + at->second);
    }
    for (const auto& [key, value] : f.metadata()) metadata_.emplace(key, value);
  }
}

std::vector<std::string> WeightSource::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : file_by_name_) out.push_back(name);
  return out;
}

const TensorInfo* WeightSource::find(const std::string& name) const {
  const auto it = file_by_name_.find(name);
  return it == file_by_name_.end() ? nullptr : files_[it->second].find(name);
}

const SafetensorsFile& WeightSource::file_of(const std::string& name) const {
  const auto it = file_by_name_.find(name);
  PIPEMAT_CHECK(it != file_by_name_.end(), WeightsError, "weights: ", path_, ": no tensor '", name,
                "'");
  return files_[it->second];
}

void WeightSource::read(const std::string& name, void* out) const { file_of(name).read(name, out); }

std::string WeightSource::read(const std::string& name) const { return file_of(name).read(name); }

}  // namespace pipemat::weights
