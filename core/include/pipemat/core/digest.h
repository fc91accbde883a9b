#pragma once
// Message digests and MACs (OpenSSL's libcrypto, linked privately).

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "pipemat/core/files.h"

namespace pipemat {

// The SHA-256 of `bytes` as 64 lowercase hex digits.
std::string sha256_hex(std::string_view bytes);

using Digest = std::array<uint8_t, 32>;

// "3f2a..." : `digest` as 64 lowercase hex digits.
std::string to_hex(const Digest& digest);

// SHA-256 of a message given in pieces: Sha256 sha; sha.update(...); sha.finish_hex(). For a
// file that is being written, or one too large to hold in memory. InternalError when OpenSSL
// fails (it does not for this algorithm unless out of memory).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(const void* data, size_t size);
  // The digest of everything updated; call one of the two, once.
  Digest finish();
  std::string finish_hex() { return to_hex(finish()); }  // 64 lowercase hex digits

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

// The SHA-256 of the file at `path` and its size in bytes, read in blocks. PipelineError naming
// the file and the OS's reason when it cannot be opened (Note [Opening an input file] in
// pipemat/core/files.h: a FIFO or a device is refused, never read) or read.
struct FileDigest {
  std::string sha256;  // 64 lowercase hex digits
  uint64_t bytes = 0;
};
FileDigest sha256_file(const std::string& path);
// The same of a file already open, read from its start to its end.
FileDigest sha256_file(const InputFile& file);

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
