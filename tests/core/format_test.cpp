#include "pipemat/core/format.h"

#include <gtest/gtest.h>

#include "pipemat/core/error.h"

namespace pipemat {
namespace {

TEST(FormatTest, Bytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(16 << 20), "16.00 MiB");
}

TEST(FormatTest, ParseBytes) {
  EXPECT_EQ(parse_bytes("4KiB", "--sizes"), 4096);
  EXPECT_EQ(parse_bytes("1MiB", "--sizes"), 1 << 20);
  EXPECT_EQ(parse_bytes("16m", "--sizes"), 16 << 20);
  EXPECT_EQ(parse_bytes("123", "--sizes"), 123);
  try {
    parse_bytes("4XB", "--sizes");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--sizes: unknown size unit 'XB'"), std::string::npos);
  }
  EXPECT_THROW(parse_bytes("KiB", "--sizes"), ConfigError);
  EXPECT_EQ(parse_bytes("9223372036854775807", "--sizes"), INT64_MAX);
  for (const char* big : {"99999999999999999999999", "9223372036854775808", "8589934592GiB"}) {
    try {
      parse_bytes(big, "--sizes");
      ADD_FAILURE() << big;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string("--sizes: '") + big + "' is too large; expected a size up to 8 EiB");
    }
  }
}

TEST(FormatTest, JoinSplit) {
  EXPECT_EQ(join({"a", "b", "c"}, ","), "a,b,c");
  EXPECT_EQ(split("a,,b", ','), (std::vector<std::string>{"a", "", "b"}));
}

TEST(FormatTest, NearestName) {
  EXPECT_EQ(edit_distance("modle", "model"), 1u);  // a swap of neighbours is one edit
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  const std::vector<std::string> paths{"blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.0"};
  EXPECT_EQ(nearest_name("block.0.attn.qkv", paths), "blocks.0.attn.qkv");
  EXPECT_EQ(nearest_name("blocks.0.mlp.upp", paths), "blocks.0.mlp.up");
  EXPECT_EQ(nearest_name("zzz", paths, 2), "");  // nothing within two edits
  EXPECT_EQ(nearest_name("zzz", {}), "");
  EXPECT_EQ(nearest_name("ab", {"ax", "ay"}), "ax");  // the first of equals
}

}  // namespace
}  // namespace pipemat
