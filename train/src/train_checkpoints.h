#pragma once
// The checkpoints of a `pipemat train` run (private to train): which run a start continues or
// begins, and what it does with a checkpoint.dir that holds checkpoints already.
//
// Note [Checkpoint directories]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint.dir holds the checkpoints of one run (Note [Checkpoint runs] in pp/checkpoint.h).
//  * A run that resumes (checkpoint.resume: a step directory, or `latest`) continues the run of
//    that checkpoint: its saves name the same run and its keep_last prunes only that run's
//    checkpoints. `latest` is refused when the directory holds complete checkpoints of more
//    than one run (which one is meant?), and a resume is refused when a complete checkpoint of
//    another run sits at a step this run would write (it would have to overwrite it).
//  * `latest` passes over newer step directories without a manifest (an interrupted save) and
//    says so; a newer one whose manifest is damaged stops the resume with an error that names
//    it (never a silent fallback to an older step that would then be overwritten).
//  * One job per directory: job rank 0 locks checkpoint.dir (its file .pipemat-lock) and
//    output.metrics for the run's life before anything is changed, and makes the run id that
//    every rank then uses, so the id printed is the manifests' id.
//  * A run that starts at step 0 into a directory that holds step-NNNNNN directories (complete
//    or not) is refused before anything is built, with what is there and the three ways on:
//    resume it, choose another directory, or checkpoint.overwrite=true, which removes those
//    step directories (rank 0, after every rank looked) and starts a new run there.
// Files and directories that are not step-NNNNNN are never touched. Every rank reads the
// directory itself before any rank changes it, so a refusal is every rank's (a ConfigError that
// rank 0 reports).

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/core/file_lock.h"
#include "pipemat/pp/checkpoint.h"
#include "pipemat/train/options.h"

namespace pipemat::train {

struct RunCheckpoints {
  pp::CheckpointRun run;   // the run this process saves as: the same on every rank (rank 0's)
  std::string resume_dir;  // the checkpoint to load; "" for a run that starts at step 0
  bool continued = false;  // `run` is the resumed checkpoint's run
  std::vector<std::string> overwritten;  // step directories removed by checkpoint.overwrite
  // `latest`: the step directories newer than resume_dir it passed over, each with why.
  std::vector<std::string> skipped;
  // The newest complete checkpoint of the run before resume_dir, or "" (what to name when
  // resume_dir is damaged).
  std::string older;
  // The config resume_dir's run was started with (its manifest's metadata), when it holds one
  // this pipemat reads: what a resume keeps is checked against it, and the resume line and its
  // errors name its layers and model keys.
  std::optional<TrainConfig> resumed_config;
  // Job rank 0: the locks of checkpoint.dir and output.metrics, held for the run (Note [One job
  // per file] in pipemat/core/file_lock.h).
  std::vector<std::shared_ptr<FileLock>> locks;
};

// The config's digest as runs record it: the SHA-256 of the effective config, without the keys
// that only say how this process starts or stops (checkpoint.resume, checkpoint.overwrite,
// training.stop_after).
std::string config_digest(const TrainConfig& config);

// What job rank 0 decides before the pipeline exists, for every rank (nothing else travels on
// the job's transport then): rank 0 calls `decide` and sends its text, or its error, to the
// others under `tag`; every rank returns the text, or throws the error as a ConfigError (that
// rank 0 reports, Note [One error line per failure]). `what` names the text in the error of a
// rank that got none.
std::string decide_on_rank_zero(comm::Transport& transport, int tag, const char* what,
                                const std::function<std::string()>& decide);
// The tags of decide_on_rank_zero's messages: those of the pipeline's checkpoint agreements and
// the one below, free before the pipeline exists.
constexpr int kRunTag = comm::kMaxUserTag;
constexpr int kSplitTag = comm::kMaxUserTag - 1;

// Collective over the job's ranks (rank 0 takes the locks and sends the run to the others).
// `config.checkpoint.dir` empty: no checkpoints (a fresh run id all the same). ConfigError as
// Note [Checkpoint directories] says.
RunCheckpoints start_checkpoints(const TrainConfig& config, comm::Transport& transport);

}  // namespace pipemat::train
