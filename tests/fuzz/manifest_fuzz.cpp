// Fuzz target: a checkpoint's manifest.json (pp::detail::parse_manifest, pp/src/manifest.h; Note
// [Checkpoint layout] and Note [Fuzz targets] in tests/fuzz/CMakeLists.txt). The manifest module
// is torch-free: its source is compiled into the target.
//
// Bad input must end in a PipelineError. What the reader accepts must be a manifest the loader
// can use: a known format, a world size and stages within the limits, a stage map of one rank
// below the world size per stage, a replica count exactly from the sharded format on; from format
// 4, a tensor index the load planner can follow without another check: names in order (find()
// searches them), known dtypes, shapes within the limit, a stage of the checkpoint (or -1), and
// pieces with a key, a file and a SHA-256 that cover each tensor's elements once, in order; ties
// that name a tensor of the index.

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_expect.h"
#include "manifest.h"
#include "pipemat/core/error.h"
#include "pipemat/weights/safetensors.h"

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
  expect(m.format >= pp::detail::kOldestFormat && m.format <= pp::detail::kNewestFormat,
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
         "replicas exactly from the sharded format on");
  expect(m.format >= pp::detail::kShardedFormat || !m.sharded, "sharded only from format 3 on");
  if (m.format < pp::detail::kGlobalFormat) {
    expect(m.tensors.empty() && m.ties.empty() && m.optimizer.empty(),
           "a tensor index only in format 4");
    return 0;
  }
  const std::string* previous = nullptr;
  for (const pp::CheckpointTensor& t : m.tensors) {
    expect(!t.name.empty(), "a tensor has a name");
    expect(previous == nullptr || *previous < t.name, "tensors in name order, each once");
    previous = &t.name;
    expect(m.find(t.name) == &t, "find() finds every tensor");
    expect(pipemat::weights::dtype_from_string(t.dtype).has_value(), "a known dtype");
    expect(t.shape.size() <= 16, "at most 16 dimensions");
    int64_t numel = 1;
    for (const int64_t d : t.shape) {
      expect(d >= 0 && d <= pp::detail::kMaxManifestElements, "a size within the limit");
      expect(d == 0 || numel <= pp::detail::kMaxManifestElements / d, "a shape within the limit");
      numel *= d;
    }
    expect(t.numel() == numel, "numel() is the shape's product");
    expect(t.stage >= -1 && t.stage < m.stages, "a stage of the checkpoint, or -1");
    expect(!t.pieces.empty(), "a tensor has pieces");
    int64_t at = 0;
    for (const pp::CheckpointPiece& p : t.pieces) {
      expect(!p.file.empty() && !p.key.empty(), "a piece has a file and a key");
      expect(p.sha256.size() == 64, "a piece has a SHA-256");
      expect(p.begin == at && p.end >= p.begin && p.end <= numel,
             "the pieces follow each other within the tensor");
      at = p.end;
    }
    expect(at == numel, "the pieces cover the tensor");
  }
  for (const auto& tie : m.ties) {
    expect(m.find(tie.second) != nullptr, "a tie names a tensor of the index");
  }
  return 0;
}
