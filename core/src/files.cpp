#include "pipemat/core/files.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat {
namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

std::string read_regular_file(const std::string& path, const std::string& key, int64_t max_bytes) {
  struct stat st {};
  PIPEMAT_CHECK(::stat(path.c_str(), &st) == 0, ConfigError, key, ": cannot open '", path, "' (",
                std::strerror(errno), "); expected a readable regular file");
  PIPEMAT_CHECK(S_ISREG(st.st_mode), ConfigError, key, ": '", path, "' is ", kind_of(st.st_mode),
                "; expected a regular file (copy the data into a file and give its path)");
  const auto size = static_cast<int64_t>(st.st_size);
  PIPEMAT_CHECK(size <= max_bytes, ConfigError, key, ": '", path, "' holds ", format_bytes(size),
                ", more than the cap of ", format_bytes(max_bytes),
                " for one input file; give a smaller file (or split it into a directory of "
                "files where the key takes one)");
  std::ifstream in(path, std::ios::binary);
  PIPEMAT_CHECK(in.is_open(), ConfigError, key, ": cannot open '", path, "' (",
                std::strerror(errno), "); expected a readable regular file");
  // The size stat gave, no more: a file that grows meanwhile is read up to it.
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  text.resize(static_cast<size_t>(in.gcount()));
  PIPEMAT_CHECK(!in.bad(), ConfigError, key, ": reading '", path, "' failed (",
                std::strerror(errno), ")");
  return text;
}

}  // namespace pipemat
