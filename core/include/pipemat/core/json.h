#pragma once
// Strict JSON: the one parser of the JSON files pipemat reads from outside (a safetensors
// header and index, a Hugging Face config.json, a checkpoint's manifest).
//
// Note [Strict JSON]
// A JSON file comes from anywhere, and a lenient parser resolves some of what it finds in
// silence: nlohmann::json::parse keeps the last of two equal keys of one object (so
// {"hidden_size": 64, "hidden_size": 128} reads as 128), and Python's json reads NaN, Infinity
// and 1e999 (as inf). parse_json reads RFC 8259 JSON and refuses, with a JsonError that says where
// and why:
//   - text that is not JSON: a syntax error, a NaN or Infinity literal, a number that overflows a
//     double (1e999), a string that is not UTF-8, anything after the value. The message names the
//     line and column (and nlohmann's reason: "parse error at line 1, column 27: syntax error
//     while parsing value - invalid literal; last read: '...'"); bytes outside ASCII are written
//     as \xNN, so the message is printable whatever the file held;
//   - a key twice in one object, at any depth, naming the key and the key path of its object
//     ("key 'dtype' appears twice in the object at 'weight'");
//   - nesting deeper than max_depth (128 by default: serde_json's limit, which the safetensors
//     reference implementation reads its header with); a deeper file is no config and no header,
//     and printing its values would recurse as deep.
// The caller turns a JsonError into its own error, adding the file: weights/ into a
// WeightsError, train/ into a ConfigError at the key that named the file.

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat {

// The nesting parse_json accepts by default: an object or array inside 127 others.
inline constexpr int kMaxJsonDepth = 128;

// A text that parse_json refuses. what() says why and where, without naming a file.
class JsonError : public Error {
 public:
  enum class Kind {
    kSyntax,        // not JSON (position and reason in what())
    kDuplicateKey,  // key() appears twice in the object at path()
    kTooDeep,       // nested deeper than the limit, at path()
  };
  JsonError(Kind kind, const std::string& what, std::string key = {},
            std::vector<std::string> path = {})
      : Error(what), kind_(kind), key_(std::move(key)), path_(std::move(path)) {}

  Kind kind() const { return kind_; }
  // kDuplicateKey: the key given twice.
  const std::string& key() const { return key_; }
  // kDuplicateKey, kTooDeep: the keys (and "[i]" array indices) leading from the top-level
  // value to the object holding the duplicate or to the value too deep; empty: the top level.
  const std::vector<std::string>& path() const { return path_; }

 private:
  Kind kind_;
  std::string key_;
  std::vector<std::string> path_;
};

// The JSON value of `text` (Note [Strict JSON]); JsonError when it is not strict JSON.
nlohmann::json parse_json(std::string_view text, int max_depth = kMaxJsonDepth);

// A key path of JsonError::path() as messages write it: "" for the top level, else the keys
// joined by '.', array indices as "[i]" ("rope_parameters", "a.b[2].c").
std::string json_path_text(const std::vector<std::string>& path);

}  // namespace pipemat
