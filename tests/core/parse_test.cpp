#include "pipemat/core/parse.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

namespace pipemat {
namespace {

TEST(ParseInt, TakesWholeDecimalsWithASign) {
  int64_t value = 99;
  EXPECT_EQ(parse_int64("42", &value), IntParse::kOk);
  EXPECT_EQ(value, 42);
  EXPECT_EQ(parse_int64("-7", &value), IntParse::kOk);
  EXPECT_EQ(value, -7);
  EXPECT_EQ(parse_int64("+3", &value), IntParse::kOk);
  EXPECT_EQ(value, 3);
  EXPECT_EQ(parse_int64("-9223372036854775808", &value), IntParse::kOk);
  EXPECT_EQ(value, std::numeric_limits<int64_t>::min());
  EXPECT_EQ(parse_int64("9223372036854775807", &value), IntParse::kOk);
  EXPECT_EQ(value, std::numeric_limits<int64_t>::max());
}

TEST(ParseInt, RefusesAnythingElseAndLeavesTheValue) {
  for (const char* text : {"", "-", "+", " 1", "1 ", "1x", "0x10", "1e3", "1.0", "--1", "١"}) {
    int64_t value = 99;
    EXPECT_EQ(parse_int64(text, &value), IntParse::kNotANumber) << "'" << text << "'";
    EXPECT_EQ(value, 99) << "'" << text << "'";
  }
  int64_t value = 99;
  EXPECT_EQ(parse_int64("9223372036854775808", &value), IntParse::kOverflow);
  EXPECT_EQ(parse_int64("-9223372036854775809", &value), IntParse::kOverflow);
  EXPECT_EQ(value, 99);
}

TEST(ParseInt, UnsignedTakesTheWholeRangeAndNoMinus) {
  uint64_t value = 5;
  EXPECT_EQ(parse_uint64("18446744073709551615", &value), IntParse::kOk);
  EXPECT_EQ(value, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(parse_uint64("18446744073709551616", &value), IntParse::kOverflow);
  EXPECT_EQ(parse_uint64("-1", &value), IntParse::kNotANumber);
  EXPECT_EQ(parse_uint64("+0", &value), IntParse::kOk);
  EXPECT_EQ(value, 0u);
}

TEST(ParseInt, InRangeIsTheValueOrNothing) {
  EXPECT_EQ(parse_int_in("0", 0, 10), 0);
  EXPECT_EQ(parse_int_in("10", 0, 10), 10);
  EXPECT_EQ(parse_int_in("11", 0, 10), std::nullopt);
  EXPECT_EQ(parse_int_in("-1", 0, 10), std::nullopt);
  EXPECT_EQ(parse_int_in("7a", 0, 10), std::nullopt);
  EXPECT_EQ(parse_int_in("99999999999999999999", 0, 10), std::nullopt);
}

TEST(ParseHostPort, HostAndPortAfterTheLastColon) {
  auto a = parse_host_port("127.0.0.1:29500");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 29500);
  auto b = parse_host_port("[::1]:1");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->port, 1);
  auto c = parse_host_port("node-3:65535");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->host, "node-3");
  EXPECT_EQ(c->port, 65535);
  for (const char* text :
       {"", "localhost", ":80", "h:", "h:0", "h:65536", "h:8o", "h: 80", "h:-1"}) {
    EXPECT_EQ(parse_host_port(text), std::nullopt) << "'" << text << "'";
  }
}

}  // namespace
}  // namespace pipemat
