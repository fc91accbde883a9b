// The value readers of ConfigReader (config_reader.h): one YAML node each, checked for its type
// and range, failing with the exact messages docs/config.md lists.

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "config_reader.h"
#include "pipemat/core/format.h"
#include "pipemat/core/parse.h"

namespace pipemat::train::config_detail {
namespace {

// A quoted scalar ("8", '8') is a string in YAML even when it spells a number.
bool is_quoted(const YAML::Node& node) { return node.Tag() == "!"; }

bool parse_double(const std::string& text, double* value) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  const double parsed = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(parsed)) return false;
  *value = parsed;
  return true;
}

std::string int_range_text(int64_t min, int64_t max) {
  if (max == std::numeric_limits<int64_t>::max()) return "an integer >= " + std::to_string(min);
  return "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

}  // namespace

bool contains(const Names& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return "'" + node.Scalar() + "'";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

std::string format_number(double value) {
  char buffer[40];
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
    return buffer;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  return buffer;
}

int64_t ConfigReader::read_int(const YAML::Node& node, const std::string& key, int64_t min,
                               int64_t max) const {
  const std::string expected = int_range_text(min, max);
  if (!node.IsScalar())
    fail(key, node.Mark(), describe(node) + " is not an integer; expected " + expected);
  int64_t value = 0;
  const IntParse result = parse_int64(node.Scalar(), &value);
  if (result == IntParse::kNotANumber) {
    fail(key, node.Mark(), describe(node) + " is not an integer; expected " + expected);
  }
  if (is_quoted(node)) {
    fail(key, node.Mark(), describe(node) + " is a quoted string, not an integer; drop the quotes");
  }
  if (result == IntParse::kOverflow || value < min || value > max) {
    fail(key, node.Mark(), describe(node) + " is out of range; expected " + expected);
  }
  return value;
}

uint64_t ConfigReader::read_uint64(const YAML::Node& node, const std::string& key) const {
  const std::string expected = "an integer >= 0";
  if (!node.IsScalar())
    fail(key, node.Mark(), describe(node) + " is not an integer; expected " + expected);
  uint64_t value = 0;
  const IntParse result = parse_uint64(node.Scalar(), &value);
  if (result == IntParse::kNotANumber) {
    int64_t negative = 0;
    const bool is_negative = parse_int64(node.Scalar(), &negative) != IntParse::kNotANumber;
    fail(key, node.Mark(),
         describe(node) + (is_negative ? " is out of range" : " is not an integer") +
             "; expected " + expected);
  }
  if (result == IntParse::kOverflow) {
    fail(key, node.Mark(),
         describe(node) + " is out of range; expected an integer in [0, " +
             std::to_string(std::numeric_limits<uint64_t>::max()) + "]");
  }
  if (is_quoted(node)) {
    fail(key, node.Mark(), describe(node) + " is a quoted string, not an integer; drop the quotes");
  }
  return value;
}

double ConfigReader::read_number(const YAML::Node& node, const std::string& key, double min,
                                 bool exclusive, double max) const {
  std::string expected = std::string("a number ") + (exclusive ? "> " : ">= ") + format_number(min);
  if (std::isfinite(max)) {
    expected = std::string("a number in ") + (exclusive ? "(" : "[") + format_number(min) + ", " +
               format_number(max) + "]";
  }
  if (!node.IsScalar())
    fail(key, node.Mark(), describe(node) + " is not a number; expected " + expected);
  double value = 0;
  if (!parse_double(node.Scalar(), &value)) {
    fail(key, node.Mark(), describe(node) + " is not a number; expected " + expected);
  }
  if (is_quoted(node)) {
    fail(key, node.Mark(), describe(node) + " is a quoted string, not a number; drop the quotes");
  }
  if (value < min || (exclusive && value == min) || value > max) {
    fail(key, node.Mark(), describe(node) + " is out of range; expected " + expected);
  }
  return value;
}

bool ConfigReader::read_bool(const YAML::Node& node, const std::string& key) const {
  if (node.IsScalar() && !is_quoted(node)) {
    const std::string& text = node.Scalar();
    if (text == "true" || text == "True" || text == "TRUE") return true;
    if (text == "false" || text == "False" || text == "FALSE") return false;
  }
  fail(key, node.Mark(), describe(node) + " is not a boolean; expected true or false");
}

std::string ConfigReader::read_string(const YAML::Node& node, const std::string& key,
                                      const std::string& expected) const {
  if (!node.IsScalar())
    fail(key, node.Mark(), describe(node) + " is not a string; expected " + expected);
  return node.Scalar();
}

std::string ConfigReader::read_choice(const YAML::Node& node, const std::string& key,
                                      const Names& allowed) const {
  if (!node.IsScalar() || !contains(allowed, node.Scalar())) {
    fail(key, node.Mark(), describe(node) + " is not allowed; allowed: " + join(allowed, ", "));
  }
  return node.Scalar();
}

}  // namespace pipemat::train::config_detail
