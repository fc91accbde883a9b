// A real multi-process check of pipeline training: run as `train_dist_check train --config FILE
// [--set k=v ...]` on every rank (under mpiexec, or via `pipemat-run --tcp` with
// PIPEMAT_BIN=train_dist_check). Each rank trains its stages on the configured transport, then runs
// the single-process reference itself and compares its own parameters bitwise; the last stage's
// rank also compares every step's loss and every validation loss. Prints "N passed, N failed" and
// exits non-zero on any mismatch or error, and when a rank compared nothing (0 passed).

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "pipemat/core/error.h"
#include "pipemat/train/config.h"
#include "pipemat/train/train.h"

int main(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) {
      config_path = argv[++i];
    } else if (a == "--set" && i + 1 < argc) {
      overrides.push_back(argv[++i]);
    }
  }
  int passed = 0, failed = 0;
  try {
    auto config = pipemat::train::load_config(config_path, overrides);
    config.output.progress = false;
    auto transport =
        pipemat::comm::make_transport(pipemat::comm::resolve_options(config.transport));
    const int rank = transport->rank();
    auto result = pipemat::train::train_on(config, *transport, nullptr);
    auto reference = pipemat::train::train_reference(config, nullptr);
    std::map<std::string, at::Tensor> want(reference.params.begin(), reference.params.end());
    for (const auto& [name, value] : result.params) {
      if (want.count(name) && at::equal(value, want[name])) {
        ++passed;
      } else {
        ++failed;
        std::fprintf(stderr, "rank %d: parameter %s differs from the reference\n", rank,
                     name.c_str());
      }
    }
    if (result.last_stage_rank) {
      if (result.validation == reference.validation) {
        ++passed;
      } else {
        ++failed;
        std::fprintf(stderr, "rank %d: the %zu validation losses differ from the reference's %zu\n",
                     rank, result.validation.size(), reference.validation.size());
      }
      for (size_t s = 0; s < reference.steps.size(); ++s) {
        if (result.steps.at(s).loss == reference.steps[s].loss) {
          ++passed;
        } else {
          ++failed;
          std::fprintf(stderr, "rank %d: loss of step %zu is %.9g, reference %.9g\n", rank, s,
                       result.steps[s].loss, reference.steps[s].loss);
        }
      }
    }
    transport->barrier(transport->timeout());
    std::printf("rank %d (%s): %d passed, %d failed\n", rank,
                pipemat::comm::to_string(config.transport.kind).c_str(), passed, failed);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_dist_check: error: %s\n", e.what());
    return 1;
  }
  if (passed == 0) {
    std::fprintf(stderr,
                 "train_dist_check: this rank compared nothing: a check that ran no case "
                 "checks nothing\n");
    return 1;
  }
  return failed == 0 ? 0 : 1;
}
