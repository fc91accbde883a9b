#include "pipemat/core/format.h"

#include <cctype>
#include <cstdio>

#include "pipemat/core/error.h"

namespace pipemat {

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while ((value >= 1024.0 || value <= -1024.0) && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buf[64];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", value, units[unit]);
  }
  return buf;
}

int64_t parse_bytes(const std::string& text, const std::string& what) {
  size_t pos = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  PIPEMAT_CHECK(pos > 0, ConfigError, what, ": expected a size like 4KiB, 1MiB or 4096, got '",
                text, "'");
  int64_t number = std::stoll(text.substr(0, pos));
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  int64_t scale = 1;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    scale = int64_t{1} << 10;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    scale = int64_t{1} << 20;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    scale = int64_t{1} << 30;
  } else {
    PIPEMAT_THROW(ConfigError, what, ": unknown size unit '", text.substr(pos), "' in '", text,
                  "'; use B, KiB, MiB or GiB");
  }
  return number * scale;
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : text) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace pipemat
