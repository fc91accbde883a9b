#include "pipemat/core/error.h"

#include <gtest/gtest.h>

namespace pipemat {
namespace {

TEST(ErrorTest, CheckThrowsTypedErrorWithStreamedMessage) {
  int rank = 3;
  try {
    PIPEMAT_CHECK(rank < 2, ConfigError, "rank ", rank, " is not below world size ", 2);
    FAIL() << "no throw";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "rank 3 is not below world size 2");
  }
}

TEST(ErrorTest, CheckDoesNotEvaluateMessageOnSuccess) {
  int evaluated = 0;
  auto part = [&] {
    ++evaluated;
    return "x";
  };
  PIPEMAT_CHECK(true, RematError, part());
  EXPECT_EQ(evaluated, 0);
}

TEST(ErrorTest, TimeoutIsACommError) {
  EXPECT_THROW(PIPEMAT_THROW(TimeoutError, "peer 1"), CommError);
}

TEST(ErrorTest, InternalAssertNamesLocationAndAsksForReport) {
  try {
    PIPEMAT_INTERNAL_ASSERT(1 == 2, "counter ", 7);
    FAIL() << "no throw";
  } catch (const InternalError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("1 == 2"), std::string::npos);
    EXPECT_NE(what.find("error_test.cpp"), std::string::npos);
    EXPECT_NE(what.find("counter 7"), std::string::npos);
    EXPECT_NE(what.find("report"), std::string::npos);
  }
}

}  // namespace
}  // namespace pipemat
