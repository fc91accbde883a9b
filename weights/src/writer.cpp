// Writing a safetensors file in the reference implementation's layout (safetensors.h).

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "pipemat/weights/safetensors.h"

namespace pipemat::weights {
namespace {

// The reference orders the data by its dtype enum, the last first: I64, F64, F32, I32, BF16,
// F16, I16, I8, U8, BOOL; within a dtype by name.
int data_rank(Dtype dtype) {
  switch (dtype) {
    case Dtype::kI64:
      return 0;
    case Dtype::kF64:
      return 1;
    case Dtype::kF32:
      return 2;
    case Dtype::kI32:
      return 3;
    case Dtype::kBF16:
      return 4;
    case Dtype::kF16:
      return 5;
    case Dtype::kI16:
      return 6;
    case Dtype::kI8:
      return 7;
    case Dtype::kU8:
      return 8;
    case Dtype::kBool:
      return 9;
  }
  return 10;
}

std::string quoted(const std::string& s) { return nlohmann::json(s).dump(); }

void sort_and_check(std::vector<TensorBytes>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorBytes& a, const TensorBytes& b) {
    const int ra = data_rank(a.dtype);
    const int rb = data_rank(b.dtype);
    return ra != rb ? ra < rb : a.name < b.name;
  });
  std::set<std::string> names;
  for (const TensorBytes& t : tensors) {
    PIPEMAT_CHECK(!t.name.empty() && t.name != kMetadataKey, WeightsError,
                  "weights: cannot write a tensor named '", t.name, "'");
    PIPEMAT_CHECK(names.insert(t.name).second, WeightsError, "weights: tensor '", t.name,
                  "' is given twice");
    int64_t bytes = element_size(t.dtype);
    for (int64_t d : t.shape) {
      PIPEMAT_CHECK(d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes), WeightsError,
                    "weights: tensor '", t.name, "' has a bad dimension ", d);
    }
    PIPEMAT_CHECK(static_cast<int64_t>(t.data.size()) == bytes, WeightsError, "weights: tensor '",
                  t.name, "' has ", t.data.size(), " bytes of data but its shape needs ", bytes);
  }
}

std::string header_of_sorted(const std::vector<TensorBytes>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  bool first = true;
  if (!metadata.empty()) {
    json += quoted(kMetadataKey) + ":{";
    for (const auto& [key, value] : metadata) {
      if (!first) json += ",";
      first = false;
      json += quoted(key) + ":" + quoted(value);
    }
    json += "}";
  }
  first = metadata.empty();
  int64_t offset = 0;
  for (const TensorBytes& t : tensors) {
    if (!first) json += ",";
    first = false;
    json += quoted(t.name) + ":{\"dtype\":\"" + to_string(t.dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      json += (i ? "," : "") + std::to_string(t.shape[i]);
    }
    const auto end = offset + static_cast<int64_t>(t.data.size());
    json += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  json += "}";
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string header(8, '\0');
  auto n = static_cast<uint64_t>(json.size());
  for (int i = 0; i < 8; ++i)
    header[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return header + json;
}

}  // namespace

std::string safetensors_header(const std::vector<TensorBytes>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  std::vector<TensorBytes> sorted = tensors;
  sort_and_check(sorted);
  return header_of_sorted(sorted, metadata);
}

void write_safetensors(std::ostream& out, std::vector<TensorBytes> tensors,
                       const std::map<std::string, std::string>& metadata) {
  sort_and_check(tensors);
  const std::string header = header_of_sorted(tensors, metadata);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const TensorBytes& t : tensors) {
    out.write(t.data.data(), static_cast<std::streamsize>(t.data.size()));
  }
}

void write_safetensors_file(const std::string& path, std::vector<TensorBytes> tensors,
                            const std::map<std::string, std::string>& metadata) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    PIPEMAT_CHECK(out.is_open(), WeightsError, "weights: cannot write '", tmp, "' (",
                  std::strerror(errno), ")");
    try {
      write_safetensors(out, std::move(tensors), metadata);
    } catch (...) {
      out.close();
      std::remove(tmp.c_str());
      throw;
    }
    out.flush();
    if (!out) {
      const std::string reason = std::strerror(errno);
      out.close();
      std::remove(tmp.c_str());
      PIPEMAT_THROW(WeightsError, "weights: writing '", tmp, "' failed (", reason, ")");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(tmp.c_str());
    PIPEMAT_THROW(WeightsError, "weights: cannot rename '", tmp, "' to '", path, "' (", reason,
                  ")");
  }
}

}  // namespace pipemat::weights
