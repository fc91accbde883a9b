#pragma once
// Reading an input file a user names (a config key's data file, a schedule CSV) with bounds:
// only a regular file, only up to a size. A FIFO, a device (/dev/zero) or a directory would make
// a plain read block forever or read until memory runs out.

#include <cstdint>
#include <string>

namespace pipemat {

// The default cap of read_regular_file: 1 GiB, far above any text corpus or schedule this
// project reads whole, far below the memory of the machines it runs on.
inline constexpr int64_t kMaxInputFileBytes = int64_t{1} << 30;

// The whole content of the regular file `path`. Checked with stat before it is opened, so a FIFO
// never blocks. Throws ConfigError naming `key` (the config key or flag that gave the path) when
// the path does not exist, is not a regular file (directory, FIFO, device, socket), is larger
// than `max_bytes`, or cannot be read.
std::string read_regular_file(const std::string& path, const std::string& key,
                              int64_t max_bytes = kMaxInputFileBytes);

}  // namespace pipemat
