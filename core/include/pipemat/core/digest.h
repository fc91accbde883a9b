#pragma once
// Message digests (OpenSSL's libcrypto).

#include <string>
#include <string_view>

namespace pipemat {

// The SHA-256 of `bytes` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);

}  // namespace pipemat
