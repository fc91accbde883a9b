#pragma once
// Small text helpers shared by every module: byte sizes, lists, joined strings.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pipemat {

// "1.50 MiB", "512 B": binary units, two decimals above 1 KiB.
std::string format_bytes(int64_t bytes);

// "812", "12.3k", "1.23M", "4.56G": decimal units, three significant digits above 1000.
std::string format_count(double count);

// "45 s", "3m07s", "1h02m": a duration for progress lines (ETA).
std::string format_duration(double seconds);

// Parses "4KiB", "64kib", "1MiB", "16M", "123" into bytes. Throws ConfigError naming `what`.
int64_t parse_bytes(const std::string& text, const std::string& what);

// "3.142" for (3.14159, 3): printf's %.*f.
std::string format_fixed(double value, int digits);

// Joins items with a separator.
std::string join(const std::vector<std::string>& items, const std::string& sep);

// Splits on a single character; keeps empty fields.
std::vector<std::string> split(const std::string& text, char sep);

// Edits (insert, delete, substitute, swap two neighbours) that turn `a` into `b`: the optimal
// string alignment distance, so the common typo "modle" is one edit from "model".
size_t edit_distance(const std::string& a, const std::string& b);

// The candidate with the fewest edits from `name` (the first of equals) when it is within
// `max_edits`, else "": for "did you mean" hints over keys, module paths, names.
std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates,
                         size_t max_edits = static_cast<size_t>(-1));

}  // namespace pipemat
