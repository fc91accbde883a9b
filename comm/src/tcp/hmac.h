#pragma once
// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the tcp rendezvous handshake (private).
//
// pipemat links no crypto library (OpenSSL is not a dependency), and the handshake needs only a
// keyed MAC over a few dozen bytes, so a small portable implementation is enough. Header-only so
// that the comm tests can check it against the FIPS 180-2 and RFC 4231 vectors
// (tests/comm/hmac_test.cpp). Not constant-time in the key length; the key is a per-job secret
// of fixed size, and digests are compared with equal_digest (constant-time).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace pipemat::comm::detail {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256() { reset(); }

  void reset() {
    static constexpr uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::memcpy(state_, kInit, sizeof(state_));
    length_ = 0;
    used_ = 0;
  }

  void update(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    length_ += static_cast<uint64_t>(size);
    while (size > 0) {
      const size_t take = std::min(size, sizeof(block_) - used_);
      std::memcpy(block_ + used_, p, take);
      used_ += take;
      p += take;
      size -= take;
      if (used_ == sizeof(block_)) {
        compress(block_);
        used_ = 0;
      }
    }
  }

  Digest finish() {
    const uint64_t bits = length_ * 8;
    const uint8_t one = 0x80;
    update(&one, 1);
    const uint8_t zero = 0;
    while (used_ != 56) update(&zero, 1);
    uint8_t tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    update(tail, 8);
    Digest out;
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(state_[i] >> (24 - 8 * j));
    }
    reset();
    return out;
  }

  static Digest hash(const void* data, size_t size) {
    Sha256 sha;
    sha.update(data, size);
    return sha.finish();
  }

 private:
  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void compress(const uint8_t* block) {
    static constexpr uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (uint32_t{block[4 * i]} << 24) | (uint32_t{block[4 * i + 1]} << 16) |
             (uint32_t{block[4 * i + 2]} << 8) | uint32_t{block[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
      const uint32_t ch = (e & f) ^ (~e & g);
      const uint32_t t1 = h + s1 + ch + k[i] + w[i];
      const uint32_t s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
      const uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
      const uint32_t t2 = s0 + maj;
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  uint32_t state_[8];
  uint8_t block_[64];
  uint64_t length_;
  size_t used_;
};

// HMAC-SHA256 of a message given in pieces: HmacSha256 mac(key); mac.update(...); mac.finish().
class HmacSha256 {
 public:
  HmacSha256(const void* key, size_t key_size) {
    uint8_t block[64] = {};
    if (key_size > sizeof(block)) {
      const Digest hashed = Sha256::hash(key, key_size);
      std::memcpy(block, hashed.data(), hashed.size());
    } else if (key_size > 0) {
      std::memcpy(block, key, key_size);
    }
    for (size_t i = 0; i < sizeof(block); ++i) {
      inner_pad_[i] = block[i] ^ 0x36;
      outer_pad_[i] = block[i] ^ 0x5c;
    }
    inner_.update(inner_pad_, sizeof(inner_pad_));
  }
  explicit HmacSha256(const std::string& key) : HmacSha256(key.data(), key.size()) {}

  void update(const void* data, size_t size) { inner_.update(data, size); }

  Digest finish() {
    const Digest inner = inner_.finish();
    Sha256 outer;
    outer.update(outer_pad_, sizeof(outer_pad_));
    outer.update(inner.data(), inner.size());
    return outer.finish();
  }

 private:
  Sha256 inner_;
  uint8_t inner_pad_[64];
  uint8_t outer_pad_[64];
};

// Compares two digests in time independent of where they differ.
inline bool equal_digest(const uint8_t* a, const uint8_t* b, size_t size) {
  uint8_t diff = 0;
  for (size_t i = 0; i < size; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace pipemat::comm::detail
