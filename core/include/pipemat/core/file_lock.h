#pragma once
// An exclusive advisory lock (flock) on a file, held for the life of the object: one job per
// checkpoint directory and per output file.

#include <string>

namespace pipemat {

// Note [One job per file]
// Two jobs writing one checkpoint directory or one output file corrupt each other silently: one
// renames the other's temporary file away, two metrics streams interleave. A job therefore holds
// an exclusive flock for its whole life on a lock file inside its checkpoint directory and on
// each output file it writes. flock locks belong to the open file, so the kernel drops them when
// the holding process ends in any way (SIGKILL, a crash, a power cut ends the host's locks too):
// a lock left behind by a dead job is simply taken by the next one, no stale-lock heuristics.
// The holder is found in /proc/locks (by the file's device and inode), and a lock file also
// holds a line the holder wrote (its pid and run), so a refusal names who holds it.
class FileLock {
 public:
  // Locks `path` (created empty when missing; its contents are left alone) for this object's
  // life, without waiting. `what` names the file in errors (e.g. "checkpoint.dir 'runs/ck'").
  // With `note` the file is a lock file of its own: its contents become `note` once it is held.
  // ConfigError when another open file holds the lock (in another process or in this one),
  // naming `what`, the holder's pid when the kernel tells it, and the lock file's note; also
  // when the file cannot be created or opened (naming the OS's reason).
  FileLock(const std::string& path, const std::string& what, const std::string& note = "");
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// The pid that holds a flock on the file at `path` according to /proc/locks, or -1 when none
// does or it cannot be told.
long flock_holder(const std::string& path);

}  // namespace pipemat
