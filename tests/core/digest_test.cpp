#include "pipemat/core/digest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat {
namespace {

// FIPS 180-2's test vectors.
TEST(Digest, Sha256OfTheStandardVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Pieces of any size give the digest of the whole; a file's digest is its bytes' digest.
TEST(Digest, Sha256InPiecesAndOfAFile) {
  const std::string text(1000000, 'a');
  Sha256 sha;
  for (size_t at = 0; at < text.size(); at += 777) {
    sha.update(text.data() + at, std::min<size_t>(777, text.size() - at));
  }
  EXPECT_EQ(sha.finish_hex(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  const std::string path = ::testing::TempDir() + "/pipemat-digest-test.bin";
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(text.data(), 1, text.size(), f), text.size());
    std::fclose(f);
  }
  const FileDigest d = sha256_file(path);
  EXPECT_EQ(d.sha256, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(d.bytes, 1000000u);
  std::remove(path.c_str());
  try {
    sha256_file(path);
    FAIL() << "a missing file has no digest";
  } catch (const PipelineError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open '" + path + "'"), std::string::npos)
        << e.what();
  }
}

// HMAC-SHA256: RFC 4231 section 4, and the empty key (the tcp rendezvous of a job without a
// secret).
std::string hex(const Digest& digest, size_t bytes = 32) {
  std::string out;
  char two[3];
  for (size_t i = 0; i < bytes; ++i) {
    std::snprintf(two, sizeof(two), "%02x", digest[i]);
    out += two;
  }
  return out;
}

std::vector<uint8_t> bytes(size_t n, uint8_t value) { return std::vector<uint8_t>(n, value); }

std::string hmac(const std::vector<uint8_t>& key, const std::string& data) {
  HmacSha256 mac(key.data(), key.size());
  mac.update(data.data(), data.size());
  return hex(mac.finish());
}

TEST(HmacSha256, Rfc4231Vectors) {
  EXPECT_EQ(hmac(bytes(20, 0x0b), "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hmac({'J', 'e', 'f', 'e'}, "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hmac(bytes(20, 0xaa), std::string(50, '\xdd')),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  std::vector<uint8_t> key4;
  for (uint8_t b = 1; b <= 25; ++b) key4.push_back(b);
  EXPECT_EQ(hmac(key4, std::string(50, '\xcd')),
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  // Test case 5: truncated to 128 bits.
  HmacSha256 mac5(bytes(20, 0x0c).data(), 20);
  mac5.update("Test With Truncation", 20);
  EXPECT_EQ(hex(mac5.finish(), 16), "a3b6167473100ee06e0c796c2955552b");
  // Test cases 6 and 7: keys longer than the block size are hashed first.
  EXPECT_EQ(hmac(bytes(131, 0xaa), "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(hmac(bytes(131, 0xaa),
                 "This is a test using a larger than block-size key and a larger than block-size "
                 "data. The key needs to be hashed before being used by the HMAC algorithm."),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST(HmacSha256, EmptyKeyIsTheJobWithoutASecret) {
  EXPECT_EQ(hmac({}, ""), "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
  HmacSha256 pieces(std::string{});
  pieces.update("pipemat ", 8);
  pieces.update("hello", 5);
  EXPECT_EQ(hex(pieces.finish()), hmac({}, "pipemat hello"));
}

TEST(HmacSha256, EqualDigestComparesEveryByte) {
  HmacSha256 mac("key");
  mac.update("x", 1);
  Digest a = mac.finish();
  Digest b = a;
  EXPECT_TRUE(equal_digest(a.data(), b.data(), a.size()));
  b[31] ^= 1;
  EXPECT_FALSE(equal_digest(a.data(), b.data(), a.size()));
  b = a;
  b[0] ^= 0x80;
  EXPECT_FALSE(equal_digest(a.data(), b.data(), a.size()));
}

}  // namespace
}  // namespace pipemat
