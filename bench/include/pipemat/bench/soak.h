#pragma once
// `pipemat bench soak`: does memory stay flat over a long run? Two loops, each sampled every
// `every` steps after `warmup` steps: the zoo pipeline trained in this process (ranks as
// threads over the local transport, as the config describes), and a remat unit loop (the
// rmsnorm-gemm scenario of `bench remat`, rederive mode, with an SGD update). A sample holds
// the tracking allocator's live bytes (exact) and the process's resident set size.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pipemat/train/options.h"

namespace pipemat::bench {

// The pipeline loop's config when none is given: the built-in defaults on 2 ranks.
inline constexpr const char* kSoakPipeline =
    "schedule: {kind: 1f1b, ranks: 2, micro_batches: 4, recompute: pretrigger}\n";

struct BenchSoakOptions {
  std::string loops = "both";  // pipeline | remat | both
  int64_t steps = 2000;        // per loop
  int64_t every = 200;         // sample every this many steps after warm-up
  int64_t warmup = 20;         // steps before the first sample (optimizer state, caches)
  // The remat loop's model.
  int64_t layers = 4;
  int64_t tokens = 256;
  int64_t hidden = 128;
  uint64_t seed = 0;
};

struct SoakSample {
  std::string loop;   // "pipeline" | "remat"
  int64_t steps = 0;  // steps done when sampled
  int64_t allocator_bytes = 0;
  int64_t rss_bytes = 0;
};

// What a loop's samples say: allocator bytes after warm-up (first sample) against the largest
// difference from it, and the resident set's growth from the first sample to the last.
struct SoakSummary {
  std::string loop;
  int64_t samples = 0;
  int64_t allocator_bytes = 0;
  int64_t allocator_drift_bytes = 0;  // max |bytes - first|
  int64_t rss_first_bytes = 0, rss_last_bytes = 0, rss_max_bytes = 0;
};

// Runs the loops (pipeline first), calling on_sample as each sample is taken (from the thread
// of pipeline rank 0 in the pipeline loop). `pipeline` is the zoo config; its transport is
// forced to local and its output (progress, metrics, timeline) switched off. ConfigError for
// bad options.
std::vector<SoakSample> run_bench_soak(const train::TrainConfig& pipeline,
                                       const BenchSoakOptions& options,
                                       const std::function<void(const SoakSample&)>& on_sample);

// One summary per loop, in the order the loops ran.
std::vector<SoakSummary> summarize_soak(const std::vector<SoakSample>& samples);

}  // namespace pipemat::bench
