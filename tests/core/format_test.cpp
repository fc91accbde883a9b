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
}

TEST(FormatTest, JoinSplit) {
  EXPECT_EQ(join({"a", "b", "c"}, ","), "a,b,c");
  EXPECT_EQ(split("a,,b", ','), (std::vector<std::string>{"a", "", "b"}));
}

}  // namespace
}  // namespace pipemat
