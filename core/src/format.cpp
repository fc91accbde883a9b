#include "pipemat/core/format.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>

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

std::string format_count(double count) {
  const char* units[] = {"", "k", "M", "G", "T"};
  int unit = 0;
  while (count >= 999.5 && unit < 4) {
    count /= 1000.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%.0f", count);
  } else {
    std::snprintf(buf, sizeof(buf),
                  count < 9.995   ? "%.2f%s"
                  : count < 99.95 ? "%.1f%s"
                                  : "%.0f%s",
                  count, units[unit]);
  }
  return buf;
}

std::string format_duration(double seconds) {
  const long long s = seconds < 0 ? 0 : static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%lld s", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", s / 3600, (s / 60) % 60);
  }
  return buf;
}

int64_t parse_bytes(const std::string& text, const std::string& what) {
  size_t pos = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  PIPEMAT_CHECK(pos > 0, ConfigError, what, ": expected a size like 4KiB, 1MiB or 4096, got '",
                text, "'");
  // Digits one by one, so that any length is an error naming the value, never std::stoll's.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t number = 0;
  for (size_t i = 0; i < pos; ++i) {
    const int digit = text[i] - '0';
    PIPEMAT_CHECK(number <= (kMax - digit) / 10, ConfigError, what, ": '", text,
                  "' is too large; expected a size up to 8 EiB");
    number = number * 10 + digit;
  }
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
  PIPEMAT_CHECK(number <= kMax / scale, ConfigError, what, ": '", text,
                "' is too large; expected a size up to 8 EiB");
  return number * scale;
}

std::string format_fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
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

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates,
                         size_t max_edits) {
  std::string best;
  size_t best_distance = max_edits;
  bool found = false;
  for (const std::string& candidate : candidates) {
    const size_t distance = edit_distance(name, candidate);
    if (distance <= best_distance && (!found || distance < best_distance)) {
      best = candidate;
      best_distance = distance;
      found = true;
    }
  }
  return best;
}

}  // namespace pipemat
