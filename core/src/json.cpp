// Strict JSON (Note [Strict JSON] in pipemat/core/json.h): nlohmann's SAX parser driving a
// builder of the value that refuses a key its object already holds and nesting past the limit,
// and that turns nlohmann's parse errors into JsonErrors with a line and a column.

#include "pipemat/core/json.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

namespace pipemat {
namespace {

using Json = nlohmann::json;

// `text` with every byte below 0x20, 0x7f and (with `ascii`) every byte from 0x80 on as \xNN.
std::string printable(std::string_view text, bool ascii) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f || (ascii && byte >= 0x80)) {
      char hex[5];
      std::snprintf(hex, sizeof(hex), "\\x%02x", byte);
      out += hex;
    } else {
      out += c;
    }
  }
  return out;
}

// "the top-level object" / "the object at 'a.b'".
std::string object_at(const std::vector<std::string>& path) {
  if (path.empty()) return "the top-level object";
  return "the object at '" + printable(json_path_text(path), false) + "'";
}

// The SAX handler of nlohmann::json::sax_parse: builds the value as nlohmann's own DOM parser
// does (a stack of the open containers, the slot of an object's current key) and throws a
// JsonError where strict JSON differs from it.
class StrictBuilder {
 public:
  StrictBuilder(std::string_view text, int max_depth) : text_(text), max_depth_(max_depth) {}

  Json take() { return std::move(root_); }

  bool null() { return put(Json(nullptr)); }
  bool boolean(bool value) { return put(Json(value)); }
  bool number_integer(Json::number_integer_t value) { return put(Json(value)); }
  bool number_unsigned(Json::number_unsigned_t value) { return put(Json(value)); }
  bool number_float(Json::number_float_t value, const Json::string_t&) { return put(Json(value)); }
  bool string(Json::string_t& value) { return put(Json(std::move(value))); }
  bool binary(Json::binary_t& value) { return put(Json::binary(std::move(value))); }
  bool start_object(std::size_t) { return open(Json::object()); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(Json::string_t& key) {
    Json& object = *open_.back();
    if (object.contains(key)) {
      throw JsonError(JsonError::Kind::kDuplicateKey,
                      "key '" + printable(key, false) + "' appears twice in " + object_at(path_),
                      key, path_);
    }
    slot_ = &object[key];
    key_ = std::move(key);
    return true;
  }

  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const Json::exception& e) {
    // nlohmann's text: "[json.exception.parse_error.101] parse error at line 1, column 27: ...";
    // its out_of_range errors (a number that overflows) name no position, so one is added.
    std::string reason = e.what();
    if (const auto bracket = reason.find("] ");
        reason.rfind("[json.exception.", 0) == 0 && bracket != std::string::npos) {
      reason.erase(0, bracket + 2);
    }
    if (reason.rfind("parse error", 0) != 0) {
      const std::string_view before = text_.substr(0, std::min(position, text_.size()));
      const size_t line = 1 + static_cast<size_t>(std::count(before.begin(), before.end(), '\n'));
      const size_t newline = before.rfind('\n');
      const size_t column =
          newline == std::string_view::npos ? before.size() : before.size() - newline - 1;
      reason = "parse error at line " + std::to_string(line) + ", column " +
               std::to_string(column) + ": " + reason;
    }
    throw JsonError(JsonError::Kind::kSyntax, printable(reason, true));
  }

 private:
  // Places `value` where the parser is: the top level, the end of the open array, or the slot
  // of the open object's current key. Returns the value's place.
  Json* place(Json&& value) {
    if (open_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json& top = *open_.back();
    if (top.is_array()) {
      top.push_back(std::move(value));
      return &top.back();
    }
    *slot_ = std::move(value);
    return slot_;
  }

  bool put(Json&& value) {
    place(std::move(value));
    return true;
  }

  bool open(Json&& container) {
    std::string name;
    if (!open_.empty()) {
      const Json& top = *open_.back();
      name = top.is_array() ? "[" + std::to_string(top.size()) + "]" : key_;
    }
    if (static_cast<int>(open_.size()) >= max_depth_) {
      std::vector<std::string> path = path_;
      if (!open_.empty()) path.push_back(name);
      throw JsonError(JsonError::Kind::kTooDeep,
                      "the value at '" + printable(json_path_text(path), false) +
                          "' is nested deeper than " + std::to_string(max_depth_) +
                          " levels of objects and arrays",
                      {}, path);
    }
    Json* placed = place(std::move(container));
    if (!open_.empty()) path_.push_back(std::move(name));
    open_.push_back(placed);
    return true;
  }

  bool close() {
    open_.pop_back();
    if (!path_.empty()) path_.pop_back();
    return true;
  }

  std::string_view text_;
  int max_depth_;
  Json root_;
  std::vector<Json*> open_;        // the open objects and arrays, outermost first
  std::vector<std::string> path_;  // the names of open_[1..] in their parents
  Json* slot_ = nullptr;           // the value of the open object's current key
  std::string key_;                // that key
};

}  // namespace

Json parse_json(std::string_view text, int max_depth) {
  StrictBuilder builder(text, max_depth);
  // strict: nothing but whitespace may follow the value; no comments.
  const bool ok = Json::sax_parse(text, &builder, Json::input_format_t::json, /*strict=*/true,
                                  /*ignore_comments=*/false);
  PIPEMAT_INTERNAL_ASSERT(ok, "nlohmann::json::sax_parse stopped without an error");
  return builder.take();
}

std::string json_path_text(const std::vector<std::string>& path) {
  std::string out;
  for (const std::string& part : path) {
    if (!out.empty() && part.rfind('[', 0) != 0) out += '.';
    out += part;
  }
  return out;
}

}  // namespace pipemat
