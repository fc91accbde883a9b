#pragma once
// Enums spelled as words (a YAML value, a CLI choice): one table per enum holds every value with
// its spelling, in the order messages and docs list them; these helpers read it both ways. The
// enum's own to_string / parse_* / *_values() are one-line calls of them.

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipemat {

template <typename Enum>
using Spelled = std::vector<std::pair<Enum, const char*>>;

// The spelling of `value`; "?" for a value not in the table (a cast of an arbitrary integer).
template <typename Enum>
const char* spelling_of(const Spelled<Enum>& table, Enum value) {
  for (const auto& [entry, name] : table) {
    if (entry == value) return name;
  }
  return "?";
}

// The value spelled `text`; nullopt for any other text (the caller names the key or flag).
template <typename Enum>
std::optional<Enum> value_of(const Spelled<Enum>& table, const std::string& text) {
  for (const auto& [entry, name] : table) {
    if (text == name) return entry;
  }
  return std::nullopt;
}

// Every value of the table, in order.
template <typename Enum>
std::vector<Enum> values_of(const Spelled<Enum>& table) {
  std::vector<Enum> values;
  values.reserve(table.size());
  for (const auto& entry : table) values.push_back(entry.first);
  return values;
}

// The spellings of `values` in order ("gpt", "mlp", ...), for messages and CLI11 choices. Works
// for every enum with a to_string (found by argument-dependent lookup).
template <typename Enum>
std::vector<std::string> spellings(const std::vector<Enum>& values) {
  std::vector<std::string> names;
  names.reserve(values.size());
  for (Enum value : values) names.emplace_back(to_string(value));
  return names;
}

}  // namespace pipemat
