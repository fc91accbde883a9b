#include "pipemat/core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

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

std::string cannot_open(const std::string& path, int error) {
  return "cannot open '" + path + "' (" + std::strerror(error) +
         "); expected a readable regular file";
}

std::string not_regular(const std::string& path, mode_t mode) {
  return "'" + path + "' is " + kind_of(mode) +
         "; expected a regular file (copy the data into a file and give its path)";
}

}  // namespace

InputFile InputFile::open(const std::string& path, int64_t max_bytes, std::string& problem) {
  problem.clear();
  InputFile file;
  struct stat st {};
  // stat follows a symlink: a link to a regular file is read, a link to a device is refused.
  if (::stat(path.c_str(), &st) != 0) {
    problem = cannot_open(path, errno);
    return file;
  }
  if (!S_ISREG(st.st_mode)) {
    problem = not_regular(path, st.st_mode);
    return file;
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    problem = cannot_open(path, errno);
    return file;
  }
  // The path may have been replaced between the stat and the open: the descriptor decides.
  if (::fstat(fd, &st) != 0) {
    problem = cannot_open(path, errno);
    ::close(fd);
    return file;
  }
  if (!S_ISREG(st.st_mode)) {
    problem = not_regular(path, st.st_mode);
    ::close(fd);
    return file;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    problem = cannot_open(path, errno);
    ::close(fd);
    return file;
  }
  const auto size = static_cast<int64_t>(st.st_size);
  if (max_bytes >= 0 && size > max_bytes) {
    problem = "'" + path + "' holds " + format_bytes(size) + ", more than the cap of " +
              format_bytes(max_bytes) +
              " for one input file; give a smaller file (or split it into a directory of files "
              "where the key takes one)";
    ::close(fd);
    return file;
  }
  file.fd_ = fd;
  file.size_ = size;
  file.path_ = path;
  return file;
}

InputFile::InputFile(InputFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), path_(std::move(other.path_)) {}

InputFile& InputFile::operator=(InputFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    path_ = std::move(other.path_);
  }
  return *this;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

int64_t InputFile::read_at(int64_t offset, void* out, int64_t bytes) const {
  auto* to = static_cast<char*>(out);
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, to + done, static_cast<size_t>(bytes - done),
                              static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    done += n;
  }
  return done;
}

int write_fully(int fd, const void* data, size_t bytes) {
  const auto* at = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, at, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    at += n;
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}

std::string read_whole(const InputFile& file, std::string& problem) {
  problem.clear();
  std::string text(static_cast<size_t>(file.size()), '\0');
  const int64_t n = file.read_at(0, text.data(), file.size());
  if (n < 0) {
    problem = "reading '" + file.path() + "' failed (" + std::strerror(errno) + ")";
    return {};
  }
  if (n < file.size()) {
    problem = "'" + file.path() + "' shrank from " + std::to_string(file.size()) + " to " +
              std::to_string(n) + " bytes while it was read";
    return {};
  }
  return text;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace pipemat
