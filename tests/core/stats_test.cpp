// The one median of the tree: probe rounds, step times and ratios all go through it.

#include "pipemat/core/stats.h"

#include <gtest/gtest.h>

namespace pipemat {
namespace {

TEST(Stats, MedianOfOddEvenAndNoValues) {
  EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 2.5);  // the mean of the two middle values
  EXPECT_EQ(median({7.5}), 7.5);
  EXPECT_EQ(median({}), 0.0);
}

}  // namespace
}  // namespace pipemat
