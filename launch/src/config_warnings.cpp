#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/comm/transport.h"

namespace pipemat::launch {

void print_config_warnings(const std::vector<std::string>& warnings) {
  // Every rank of a launched job reads the same config: rank 0 speaks for all, as for a shared
  // ConfigError (Note [One error line per failure] in main.cpp).
  if (comm::job_status().launcher_rank > 0) return;
  for (const std::string& warning : warnings) std::cerr << "pipemat: warning: " << warning << "\n";
  std::cerr << std::flush;
}

}  // namespace pipemat::launch
