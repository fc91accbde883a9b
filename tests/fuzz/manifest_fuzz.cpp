// Fuzz target: a checkpoint's manifest.json (pp::detail::parse_manifest, pp/src/manifest.h; Note
// [Checkpoint layout] and Note [Fuzz targets] in tests/fuzz/CMakeLists.txt). The manifest module
// is torch-free: its source is compiled into the target.
//
// Bad input must end in a PipelineError. What the reader accepts must be a manifest the loader
// can use: a known format, a world size and stages within the limits, a stage map of one rank
// below the world size per stage, a replica count exactly for the sharded format.

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_expect.h"
#include "manifest.h"
#include "pipemat/core/error.h"

namespace {

void expect(bool ok, const char* what) { pipemat::fuzz::expect(ok, "manifest", what); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace pp = pipemat::pp;
  const std::string text(reinterpret_cast<const char*>(data), size);
  pp::CheckpointManifest m;
  try {
    m = pp::detail::parse_manifest(text, "ck/manifest.json");
  } catch (const pipemat::PipelineError&) {
    return 0;  // bad input, refused as documented
  }
  expect(m.format >= pp::detail::kOldestFormat && m.format <= pp::detail::kShardedFormat,
         "a known format");
  expect(m.step >= 0, "a step >= 0");
  expect(m.world_size >= 1 && m.world_size <= pp::detail::kMaxManifestRanks, "a world size");
  expect(m.stages >= 1 && m.stages <= pp::detail::kMaxManifestRanks, "stages");
  expect(m.micro_batches >= 1, "micro-batches");
  expect(m.stage_to_rank.size() == static_cast<size_t>(m.stages), "one rank per stage");
  for (const int r : m.stage_to_rank) expect(r >= 0 && r < m.world_size, "a rank of the job");
  expect(m.format >= pp::detail::kShardedFormat
             ? m.replicas >= 1 && m.replicas <= pp::detail::kMaxManifestReplicas
             : m.replicas == 0,
         "replicas exactly in the sharded format");
  return 0;
}
