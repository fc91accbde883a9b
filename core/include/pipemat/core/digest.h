#pragma once
// Message digests and MACs (OpenSSL's libcrypto, linked privately).

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace pipemat {

// The SHA-256 of `bytes` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);

using Digest = std::array<uint8_t, 32>;

// HMAC-SHA256 (RFC 2104) of a message given in pieces: HmacSha256 mac(key); mac.update(...);
// mac.finish(). An empty key is allowed. InternalError when OpenSSL fails (it does not for this
// algorithm unless out of memory).
class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t key_size);
  explicit HmacSha256(const std::string& key) : HmacSha256(key.data(), key.size()) {}
  ~HmacSha256();
  HmacSha256(const HmacSha256&) = delete;
  HmacSha256& operator=(const HmacSha256&) = delete;

  void update(const void* data, size_t size);
  // The MAC of everything updated; call once.
  Digest finish();

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

// Compares two digests in time independent of where they differ.
bool equal_digest(const uint8_t* a, const uint8_t* b, size_t size);

}  // namespace pipemat
