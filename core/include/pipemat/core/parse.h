#pragma once
// Whole-text integer parsing, the one parser behind config keys, environment variables, names
// of checkpoint directories and host:port addresses. Callers name the value in their errors.

#include <cstdint>
#include <optional>
#include <string>

namespace pipemat {

enum class IntParse { kOk, kNotANumber, kOverflow };

// All of `text` as a decimal integer with an optional sign ("42", "-7", "+3"): no spaces, no
// other characters. On kOk `*value` holds it; otherwise `*value` is left alone.
IntParse parse_int64(const std::string& text, int64_t* value);

// The same without a '-' sign, up to 2^64 - 1.
IntParse parse_uint64(const std::string& text, uint64_t* value);

// The value of `text` when parse_int64 takes it and it lies in [min, max]; std::nullopt else.
std::optional<int64_t> parse_int_in(const std::string& text, int64_t min, int64_t max);

// "host:port" or "[v6 literal]:port": a non-empty host (its brackets removed; not resolved) and
// a port 1..65535 after the last ':'. std::nullopt for anything else.
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
std::optional<HostPort> parse_host_port(const std::string& text);

}  // namespace pipemat
