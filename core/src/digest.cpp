#include "pipemat/core/digest.h"

#include <openssl/evp.h>

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

}  // namespace pipemat
