#pragma once
// Facts about this process that benchmarks report.

#include <cstdint>

namespace pipemat {

// Resident set size of this process in bytes (/proc/self/statm); -1 where it cannot be read.
int64_t resident_set_bytes();

}  // namespace pipemat
