#include "pipemat/core/digest.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat {

std::string to_hex(const Digest& digest) {
  std::string hex;
  hex.reserve(2 * digest.size());
  char pair[3];
  for (const uint8_t byte : digest) {
    std::snprintf(pair, sizeof(pair), "%02x", byte);
    hex += pair;
  }
  return hex;
}

std::string sha256_hex(std::string_view bytes) {
  Sha256 sha;
  sha.update(bytes.data(), bytes.size());
  return sha.finish_hex();
}

struct Sha256::Context {
  EVP_MD_CTX* ctx = nullptr;
  ~Context() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : context_(std::make_unique<Context>()) {
  context_->ctx = EVP_MD_CTX_new();
  PIPEMAT_CHECK(
      context_->ctx != nullptr && EVP_DigestInit_ex(context_->ctx, EVP_sha256(), nullptr) == 1,
      InternalError, "Sha256: OpenSSL could not set up SHA-256");
}

Sha256::~Sha256() = default;

void Sha256::update(const void* data, size_t size) {
  PIPEMAT_CHECK(EVP_DigestUpdate(context_->ctx, data, size) == 1, InternalError,
                "Sha256: OpenSSL's update failed");
}

Digest Sha256::finish() {
  Digest out{};
  unsigned int size = 0;
  PIPEMAT_CHECK(EVP_DigestFinal_ex(context_->ctx, out.data(), &size) == 1 && size == out.size(),
                InternalError, "Sha256: OpenSSL's final step failed");
  return out;
}

FileDigest sha256_file(const InputFile& file) {
  Sha256 sha;
  FileDigest out;
  std::vector<char> block(size_t{1} << 20);
  for (;;) {
    const int64_t n = file.read_at(static_cast<int64_t>(out.bytes), block.data(),
                                   static_cast<int64_t>(block.size()));
    PIPEMAT_CHECK(n >= 0, PipelineError, "cannot read ", file.path(),
                  " to check its digest: ", std::strerror(errno));
    if (n == 0) break;
    sha.update(block.data(), static_cast<size_t>(n));
    out.bytes += static_cast<uint64_t>(n);
  }
  out.sha256 = sha.finish_hex();
  return out;
}

FileDigest sha256_file(const std::string& path) {
  std::string problem;
  const InputFile file = InputFile::open(path, kNoSizeCap, problem);
  PIPEMAT_CHECK(file.is_open(), PipelineError, "cannot check the digest: ", problem);
  return sha256_file(file);
}

struct HmacSha256::Context {
  EVP_MAC* mac = nullptr;
  EVP_MAC_CTX* ctx = nullptr;
  ~Context() {
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(mac);
  }
};

HmacSha256::HmacSha256(const void* key, size_t key_size) : context_(std::make_unique<Context>()) {
  context_->mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (context_->mac != nullptr) context_->ctx = EVP_MAC_CTX_new(context_->mac);
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  // OpenSSL wants a non-null pointer for a zero-length key.
  static const unsigned char kNoKey = 0;
  const auto* bytes = key_size > 0 ? static_cast<const unsigned char*>(key) : &kNoKey;
  PIPEMAT_CHECK(
      context_->ctx != nullptr && EVP_MAC_init(context_->ctx, bytes, key_size, params) == 1,
      InternalError, "HmacSha256: OpenSSL could not set up HMAC-SHA256");
}

HmacSha256::~HmacSha256() = default;

void HmacSha256::update(const void* data, size_t size) {
  PIPEMAT_CHECK(EVP_MAC_update(context_->ctx, static_cast<const unsigned char*>(data), size) == 1,
                InternalError, "HmacSha256: OpenSSL's update failed");
}

Digest HmacSha256::finish() {
  Digest out{};
  size_t size = 0;
  PIPEMAT_CHECK(
      EVP_MAC_final(context_->ctx, out.data(), &size, out.size()) == 1 && size == out.size(),
      InternalError, "HmacSha256: OpenSSL's final step failed");
  return out;
}

bool equal_digest(const uint8_t* a, const uint8_t* b, size_t size) {
  return CRYPTO_memcmp(a, b, size) == 0;
}

}  // namespace pipemat
