#pragma once
// Summary statistics of measurements (step times, probe rounds, ratios).

#include <vector>

namespace pipemat {

// The median: the middle value, or the mean of the two middle values of an even count; 0 for
// none.
double median(std::vector<double> values);

}  // namespace pipemat
