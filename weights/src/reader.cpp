// Reading a safetensors file: Note [Safetensors checks] in pipemat/weights/safetensors.h.

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/core/json.h"
#include "pipemat/weights/safetensors.h"

namespace pipemat::weights {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; pipemat reads it on little-endian hosts only");

using Json = nlohmann::json;

// The header's JSON (Note [Strict JSON] in pipemat/core/json.h): a duplicate name or field
// would otherwise be resolved in silence, keeping the last.
Json parse_header(std::string_view text, const std::string& path) {
  try {
    return parse_json(text);
  } catch (const JsonError& e) {
    if (e.kind() == JsonError::Kind::kSyntax) {
      PIPEMAT_THROW(WeightsError, "weights: ", path, ": the header is not valid JSON (", e.what(),
                    ")");
    }
    if (e.kind() == JsonError::Kind::kDuplicateKey && e.path().empty()) {
      PIPEMAT_THROW(WeightsError, "weights: ", path, ": tensor '", e.key(),
                    "' appears twice in the header");
    }
    if (e.kind() == JsonError::Kind::kDuplicateKey && e.path().size() == 1) {
      if (e.path()[0] == kMetadataKey) {
        PIPEMAT_THROW(WeightsError, "weights: ", path, ": ", kMetadataKey, " key '", e.key(),
                      "' appears twice");
      }
      PIPEMAT_THROW(WeightsError, "weights: ", path, ": tensor '", e.path()[0], "': field '",
                    e.key(), "' appears twice");
    }
    PIPEMAT_THROW(WeightsError, "weights: ", path, ": in the header, ", e.what());
  }
}

// A non-negative integer of the header that fits int64, else a WeightsError saying `what`.
int64_t header_int(const Json& v, const std::string& where, const char* what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    PIPEMAT_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), WeightsError,
                  where, ": ", what, " ", u, " is too large");
    return static_cast<int64_t>(u);
  }
  PIPEMAT_CHECK(v.is_number_integer(), WeightsError, where, ": ", what, " ", v.dump(),
                " is not an integer");
  const auto i = v.get<int64_t>();
  PIPEMAT_CHECK(i >= 0, WeightsError, where, ": ", what, " ", i, " is negative");
  return i;
}

TensorInfo tensor_entry(const std::string& name, const Json& entry, const std::string& path) {
  const std::string where = "weights: " + path + ": tensor '" + name + "'";
  PIPEMAT_CHECK(entry.is_object(), WeightsError, where, ": expected an object with dtype, shape ",
                "and data_offsets, found ", entry.type_name());
  for (const auto& item : entry.items()) {
    PIPEMAT_CHECK(item.key() == "dtype" || item.key() == "shape" || item.key() == "data_offsets",
                  WeightsError, where, ": unknown field '", item.key(),
                  "'; a tensor has dtype, shape and data_offsets");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    PIPEMAT_CHECK(entry.contains(field), WeightsError, where, ": no '", field, "'");
  }
  TensorInfo t;
  t.name = name;
  const Json& dtype = entry.at("dtype");
  PIPEMAT_CHECK(dtype.is_string(), WeightsError, where, ": dtype ", dtype.dump(),
                " is not a string");
  const auto known = dtype_from_string(dtype.get<std::string>());
  PIPEMAT_CHECK(known.has_value(), WeightsError, where, ": unknown dtype '",
                dtype.get<std::string>(),
                "'; pipemat reads F64, F32, F16, BF16, I64, I32, I16, I8, U8 and BOOL");
  t.dtype = *known;
  const Json& shape = entry.at("shape");
  PIPEMAT_CHECK(shape.is_array(), WeightsError, where, ": shape ", shape.dump(),
                " is not an array");
  int64_t bytes = element_size(t.dtype);
  for (const Json& d : shape) {
    const int64_t dim = header_int(d, where, "shape dimension");
    t.shape.push_back(dim);
    PIPEMAT_CHECK(!__builtin_mul_overflow(bytes, dim, &bytes), WeightsError, where, ": shape ",
                  shape.dump(), " of ", to_string(t.dtype), " holds more bytes than fit 64 bits");
  }
  const Json& offsets = entry.at("data_offsets");
  PIPEMAT_CHECK(offsets.is_array() && offsets.size() == 2, WeightsError, where, ": data_offsets ",
                offsets.dump(), " is not [begin, end]");
  t.begin = header_int(offsets[0], where, "data_offsets begin");
  t.end = header_int(offsets[1], where, "data_offsets end");
  PIPEMAT_CHECK(t.begin <= t.end, WeightsError, where, ": data_offsets [", t.begin, ", ", t.end,
                "] end before they begin");
  PIPEMAT_CHECK(t.end - t.begin == bytes, WeightsError, where, ": data_offsets [", t.begin, ", ",
                t.end, "] span ", t.end - t.begin, " bytes but shape ", shape.dump(), " of ",
                to_string(t.dtype), " needs ", bytes);
  return t;
}

// The header length N that the first 8 bytes of a safetensors file of `file_bytes` bytes give,
// checked against the cap (before anything is allocated) and against the file's size.
int64_t header_length(const unsigned char* length_bytes, int64_t file_bytes,
                      const std::string& path) {
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | length_bytes[i];
  PIPEMAT_CHECK(length <= static_cast<uint64_t>(kMaxHeaderBytes), WeightsError, "weights: ", path,
                ": the header length is ", length, " bytes, above the cap of ",
                format_bytes(kMaxHeaderBytes),
                "; this is not a safetensors file (or a damaged one)");
  const auto n = static_cast<int64_t>(length);
  PIPEMAT_CHECK(8 + n <= file_bytes, WeightsError, "weights: ", path, ": the header length is ", n,
                " bytes but the file holds only ", file_bytes - 8,
                " after it; the file is truncated or not a safetensors file");
  return n;
}

void check_file_length(int64_t file_bytes, const std::string& path) {
  PIPEMAT_CHECK(file_bytes >= 8, WeightsError, "weights: ", path, ": ", file_bytes,
                " bytes, too short for the 8-byte header length of a safetensors file");
}

// The tensors and metadata of the header `text`, which a data buffer of `buffer` bytes follows.
SafetensorsHeader check_header(std::string_view text, int64_t buffer, const std::string& path) {
  SafetensorsHeader out;
  out.data_start = 8 + static_cast<int64_t>(text.size());
  const Json header = parse_header(text, path);
  PIPEMAT_CHECK(header.is_object(), WeightsError, "weights: ", path, ": the header is a JSON ",
                header.type_name(), ", expected an object of tensors");
  for (const auto& item : header.items()) {
    if (item.key() == kMetadataKey) {
      PIPEMAT_CHECK(item.value().is_object(), WeightsError, "weights: ", path, ": ", kMetadataKey,
                    " is a ", item.value().type_name(), ", expected an object of strings");
      for (const auto& m : item.value().items()) {
        PIPEMAT_CHECK(m.value().is_string(), WeightsError, "weights: ", path, ": ", kMetadataKey,
                      " '", m.key(), "' is ", m.value().dump(), ", expected a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    out.tensors.push_back(tensor_entry(item.key(), item.value(), path));
  }
  // The tensors tile the buffer: in offset order each begins where the one before ended.
  std::vector<const TensorInfo*> order;
  for (const TensorInfo& t : out.tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t at = 0;
  const TensorInfo* before = nullptr;
  for (const TensorInfo* t : order) {
    PIPEMAT_CHECK(t->end <= buffer, WeightsError, "weights: ", path, ": tensor '", t->name,
                  "': data_offsets [", t->begin, ", ", t->end, "] reach past the data buffer of ",
                  buffer, " bytes; the file is truncated or its header is wrong");
    PIPEMAT_CHECK(t->begin >= at, WeightsError, "weights: ", path, ": tensor '", t->name,
                  "': data_offsets [", t->begin, ", ", t->end, "] overlap tensor '",
                  before ? before->name : "", "' [", before ? before->begin : 0, ", ", at, "]");
    PIPEMAT_CHECK(t->begin == at, WeightsError, "weights: ", path, ": tensor '", t->name,
                  "': data_offsets [", t->begin, ", ", t->end, "] leave a hole of bytes [", at,
                  ", ", t->begin, ") of the data buffer that no tensor covers");
    at = t->end;
    before = t;
  }
  PIPEMAT_CHECK(at == buffer, WeightsError, "weights: ", path, ": the data buffer holds ", buffer,
                " bytes but the tensors cover ", at,
                before ? " (the last is '" + before->name + "')" : std::string(),
                "; bytes after them are not part of any tensor");
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return out;
}

}  // namespace

SafetensorsHeader parse_safetensors(std::string_view bytes, const std::string& name) {
  const auto size = static_cast<int64_t>(bytes.size());
  check_file_length(size, name);
  const int64_t n = header_length(reinterpret_cast<const unsigned char*>(bytes.data()), size, name);
  return check_header(bytes.substr(8, static_cast<size_t>(n)), size - 8 - n, name);
}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : path_(path),
      file_(std::make_shared<InputFile>(open_input_file<WeightsError>(path, "weights"))) {
  const int64_t file_bytes = file_->size();
  check_file_length(file_bytes, path);
  unsigned char length_bytes[8] = {};
  PIPEMAT_CHECK(file_->read_at(0, length_bytes, 8) == 8, WeightsError, "weights: ", path,
                ": cannot read the header length");
  const int64_t n = header_length(length_bytes, file_bytes, path);
  std::string text(static_cast<size_t>(n), '\0');
  PIPEMAT_CHECK(file_->read_at(8, text.data(), n) == n, WeightsError, "weights: ", path,
                ": cannot read the ", n, "-byte header (", std::strerror(errno), ")");
  header_ = check_header(text, file_bytes - 8 - n, path);
  for (size_t i = 0; i < header_.tensors.size(); ++i) by_name_[header_.tensors[i].name] = i;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

void SafetensorsFile::read(const std::string& name, void* out) const {
  const TensorInfo* t = find(name);
  PIPEMAT_CHECK(t != nullptr, WeightsError, "weights: ", path_, ": no tensor '", name, "'");
  // The descriptor the header was read from (Note [Opening an input file]): never the path again.
  const int64_t n = file_->read_at(header_.data_start + t->begin, out, t->bytes());
  PIPEMAT_CHECK(n == t->bytes(), WeightsError, "weights: ", path_, ": tensor '", name, "': read ",
                n, " of its ", t->bytes(), " bytes; the file changed since its header was read",
                n < 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string());
}

std::string SafetensorsFile::read(const std::string& name) const {
  const TensorInfo* t = find(name);
  PIPEMAT_CHECK(t != nullptr, WeightsError, "weights: ", path_, ": no tensor '", name, "'");
  std::string bytes(static_cast<size_t>(t->bytes()), '\0');
  read(name, bytes.data());
  return bytes;
}

}  // namespace pipemat::weights
