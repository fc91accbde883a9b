#pragma once
// What the checkpoint writer (checkpoint_write.cpp) and the loaders (checkpoint_load.cpp for
// format 4, checkpoint.cpp for formats 1 to 3) share: the ranks' agreement, crash injection for
// the tests, text messages between ranks, the layout a manifest records. Defined in
// checkpoint.cpp.

#include <cstdint>
#include <exception>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "pipemat/pp/pipeline.h"

namespace pipemat::pp::detail {

// Note [Checkpoint agreement] (checkpoint.cpp): the tag of every checkpoint message.
inline constexpr int kAgreementTag = comm::kMaxUserTag;
// The names a load reads, exchanged by the ranks (checkpoint_load.cpp).
inline constexpr int kLoadNamesTag = comm::kMaxUserTag - 4;

// The lowest rank whose part failed (this one when `failed`), or -1 when every part succeeded.
int first_failed_rank(comm::Transport& transport, bool failed);

// Runs `part` on this rank, then agrees (Note [Checkpoint agreement]): rethrows this rank's own
// error, or throws PeerFailedError "<what>: rank R <failed_part(R)>" when another rank's part
// failed.
template <typename Part>
void agree_on(comm::Transport& transport, const char* what, Part&& part,
              const std::function<std::string(int)>& failed_part) {
  std::exception_ptr error;
  try {
    part();
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  const int failed = first_failed_rank(transport, error != nullptr);
  if (error) std::rethrow_exception(error);
  PIPEMAT_CHECK(failed < 0, PeerFailedError, what, ": rank ", failed, " ", failed_part(failed));
}

// Note [Checkpoint crash injection] (checkpoint.cpp).
void maybe_crash(const char* point, int64_t step, int rank, const std::string& tmp = "");

// A text message to `peer` on kAgreementTag, and one from it (any length; waits).
void send_text(comm::Transport& transport, int peer, const std::string& text);
std::string recv_text(comm::Transport& transport, int peer);

// What a manifest records of the pipeline that wrote it: the format, the step and the layout
// (world_size, schedule_kind, stages, micro_batches, stage_to_rank).
nlohmann::json layout_of(const Pipeline& pipeline, int format);

// Formats 1 to 3 (checkpoint.cpp): load_checkpoint and load_stage_weights of a checkpoint that
// names its tensors by rank and stage, on the layout that wrote it.
void load_legacy_checkpoint(Pipeline& pipeline, comm::Transport& transport, const std::string& dir,
                            bool allow_non_finite);
void load_legacy_stage_weights(const std::string& dir,
                               const std::vector<torch::nn::Module*>& stages,
                               bool allow_non_finite);

}  // namespace pipemat::pp::detail
