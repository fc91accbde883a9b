#pragma once
// File helpers shared by the checkpoint writer / loader (checkpoint.cpp) and the checkpoint
// directory functions (checkpoint_dir.cpp): names and durable writes; the manifest's in
// manifest.h.

#include <cstdint>
#include <string>

#include "manifest.h"

namespace pipemat::pp::detail {

// "step-000004" for step 4.
std::string step_dir_name(int64_t step);

// The step of a "step-NNNNNN" directory name, or -1. Checkpoints are ordered by it, not by
// name: step-1000000 sorts before step-999999 as text.
long long step_of(const std::string& name);

// fsync of a file or a directory; PipelineError naming it and the OS's reason.
void sync_path(const std::string& path);

// Makes `tmp` durable and renames it to `final_path`, then syncs the directory.
void publish(const std::string& tmp, const std::string& final_path);

}  // namespace pipemat::pp::detail
