#include "pipemat/core/digest.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cstdio>

#include "pipemat/core/error.h"

namespace pipemat {

std::string sha256_hex(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  PIPEMAT_CHECK(EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr) == 1,
                InternalError, "sha256_hex: OpenSSL's EVP_Digest failed");
  std::string hex;
  hex.reserve(2 * size);
  char pair[3];
  for (unsigned int i = 0; i < size; ++i) {
    std::snprintf(pair, sizeof(pair), "%02x", digest[i]);
    hex += pair;
  }
  return hex;
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
