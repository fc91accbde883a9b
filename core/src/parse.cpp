#include "pipemat/core/parse.h"

#include <cerrno>
#include <cstdlib>

namespace pipemat {
namespace {

// True when text[from..] is one or more decimal digits.
bool all_digits(const std::string& text, size_t from) {
  if (text.size() == from) return false;
  for (size_t i = from; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return false;
  }
  return true;
}

}  // namespace

IntParse parse_int64(const std::string& text, int64_t* value) {
  const size_t digits = (!text.empty() && (text[0] == '-' || text[0] == '+')) ? 1 : 0;
  if (!all_digits(text, digits)) return IntParse::kNotANumber;
  errno = 0;
  const long long parsed = std::strtoll(text.c_str(), nullptr, 10);
  if (errno == ERANGE) return IntParse::kOverflow;
  *value = parsed;
  return IntParse::kOk;
}

IntParse parse_uint64(const std::string& text, uint64_t* value) {
  const size_t digits = (!text.empty() && text[0] == '+') ? 1 : 0;
  if (!all_digits(text, digits)) return IntParse::kNotANumber;
  errno = 0;
  const unsigned long long parsed = std::strtoull(text.c_str(), nullptr, 10);
  if (errno == ERANGE) return IntParse::kOverflow;
  *value = parsed;
  return IntParse::kOk;
}

std::optional<int64_t> parse_int_in(const std::string& text, int64_t min, int64_t max) {
  int64_t value = 0;
  if (parse_int64(text, &value) != IntParse::kOk || value < min || value > max) {
    return std::nullopt;
  }
  return value;
}

std::optional<HostPort> parse_host_port(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) return std::nullopt;
  const auto port = parse_int_in(text.substr(colon + 1), 1, 65535);
  if (!port) return std::nullopt;
  HostPort out;
  out.host = text.substr(0, colon);
  if (out.host.size() > 2 && out.host.front() == '[' && out.host.back() == ']') {
    out.host = out.host.substr(1, out.host.size() - 2);
  }
  out.port = static_cast<uint16_t>(*port);
  return out;
}

}  // namespace pipemat
