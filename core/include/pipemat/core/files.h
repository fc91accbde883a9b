#pragma once
// Note [Opening an input file]
// Every file pipemat reads is opened here: a config, a text corpus, a CSV schedule, a checkpoint's
// manifest, rank and shard files, safetensors weights and their index, a Hugging Face
// config.json. A path is opened only when it is a regular file or a symlink to one. A FIFO
// blocks an open until a writer comes and a read until it writes; a device such as /dev/zero
// never ends; a directory reads as an error late. The path is checked with stat before the
// open, and opened with O_NONBLOCK (which returns at once even for a FIFO with no writer) and
// checked again with fstat on the descriptor itself, so a file swapped between the two checks
// is refused too; the descriptor is then made blocking for plain reads. Where the format gives
// an upper bound (a config, a JSON index, the size a manifest recorded), the size is checked
// against it before anything is read.

#include <cstdint>
#include <string>

#include "pipemat/core/error.h"

namespace pipemat {

// The default cap of read_regular_file: 1 GiB, far above any text corpus or schedule this
// project reads whole, far below the memory of the machines it runs on.
inline constexpr int64_t kMaxInputFileBytes = int64_t{1} << 30;

// No cap on the size: for files whose size the format does not bound (checkpoints, weights).
inline constexpr int64_t kNoSizeCap = -1;

// A regular file open for reading (Note [Opening an input file]). Move-only; closes on
// destruction.
class InputFile {
 public:
  // Opens `path`. On failure returns a closed file and sets `problem` to why, naming the path:
  // "cannot open 'x' (No such file or directory); expected a readable regular file", "'x' is a
  // FIFO (named pipe); expected a regular file ...", "'x' holds 2.00 GiB, more than the cap of
  // ...". `max_bytes` < 0: no cap.
  static InputFile open(const std::string& path, int64_t max_bytes, std::string& problem);

  InputFile() = default;
  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&& other) noexcept;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile();

  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }  // the size fstat gave at the open

  // Reads up to `bytes` bytes at `offset` into `out`; returns how many were read (fewer only at
  // the end of the file), or -1 with errno set when the read failed.
  int64_t read_at(int64_t offset, void* out, int64_t bytes) const;

 private:
  int fd_ = -1;
  int64_t size_ = 0;
  std::string path_;
};

// Opens `path` with InputFile::open, throwing ErrorType "<who>: <problem>" when it cannot.
template <class ErrorType>
InputFile open_input_file(const std::string& path, const std::string& who,
                          int64_t max_bytes = kNoSizeCap) {
  std::string problem;
  InputFile file = InputFile::open(path, max_bytes, problem);
  if (!file.is_open()) throw ErrorType(who + ": " + problem);
  return file;
}

// The whole content of `file`: the size its open saw, no more (a file that grows meanwhile is
// read up to it). On failure returns "" and sets `problem`: "reading 'x' failed (reason)", or
// the file shrank since it was opened.
std::string read_whole(const InputFile& file, std::string& problem);

// The whole content of the regular file `path`; ErrorType "<who>: <problem>" when it cannot be
// opened (InputFile::open) or read (read_whole).
template <class ErrorType>
std::string read_whole_file(const std::string& path, const std::string& who,
                            int64_t max_bytes = kNoSizeCap) {
  const InputFile file = open_input_file<ErrorType>(path, who, max_bytes);
  std::string problem;
  std::string text = read_whole(file, problem);
  if (!problem.empty()) throw ErrorType(who + ": " + problem);
  return text;
}

// The whole content of the regular file `path` (Note [Opening an input file]). Throws
// ConfigError naming `key` (the config key or flag that gave the path) when the path does not
// exist, is not a regular file (directory, FIFO, device, socket), is larger than `max_bytes`,
// or cannot be read.
inline std::string read_regular_file(const std::string& path, const std::string& key,
                                     int64_t max_bytes = kMaxInputFileBytes) {
  return read_whole_file<ConfigError>(path, key, max_bytes);
}

// Whether `path` names anything (stat succeeds: a dangling symlink does not), and whether it is a
// directory (following symlinks). Neither opens it.
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);

// Writes all of [data, data + bytes) to the descriptor `fd`, again after EINTR and short writes;
// 0 when all of it was written, else the errno of the write that failed (EIO for one that wrote
// nothing).
int write_fully(int fd, const void* data, size_t bytes);

}  // namespace pipemat
