#include "pipemat/core/process.h"

#include <unistd.h>

#include <fstream>

namespace pipemat {

int64_t resident_set_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(statm >> size_pages >> resident_pages)) return -1;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace pipemat
