#include "pipemat/core/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "pipemat/core/error.h"

namespace pipemat {
namespace {

// The first line of the file open at `fd`, up to 200 bytes.
std::string first_line(int fd) {
  char text[201] = {};
  const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return "";
  std::string line(text, static_cast<size_t>(n));
  const auto end = line.find('\n');
  return end == std::string::npos ? line : line.substr(0, end);
}

}  // namespace

long flock_holder(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  std::ifstream locks("/proc/locks");
  std::string line;
  char inode[64];
  // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF": major and minor in hex, inode in decimal.
  std::snprintf(inode, sizeof(inode), "%02x:%02x:%llu", major(st.st_dev), minor(st.st_dev),
                static_cast<unsigned long long>(st.st_ino));
  while (std::getline(locks, line)) {
    std::istringstream fields(line);
    std::string index, kind, mode, access, pid, where;
    if (!(fields >> index >> kind)) continue;
    if (kind == "->") fields >> kind;  // a waiter's line: "1: -> FLOCK ..."
    if (!(fields >> mode >> access >> pid >> where) || kind != "FLOCK") continue;
    if (where == inode) return std::atol(pid.c_str());
  }
  return -1;
}

FileLock::FileLock(const std::string& path, const std::string& what, const std::string& note)
    : path_(path) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  PIPEMAT_CHECK(fd_ >= 0, ConfigError, what, ": cannot open ", path,
                " to lock it: ", std::strerror(errno));
  int rc = 0;
  do {
    rc = ::flock(fd_, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int error = errno;
    const std::string held_by = first_line(fd_);
    ::close(fd_);
    fd_ = -1;
    PIPEMAT_CHECK(error == EWOULDBLOCK, ConfigError, what, ": cannot lock ", path, ": ",
                  std::strerror(error));
    const long pid = flock_holder(path);
    PIPEMAT_THROW(ConfigError, what, " is in use by another job: ",
                  pid > 0 ? "process " + std::to_string(pid) : std::string("another process"),
                  held_by.empty() ? std::string() : " (" + held_by + ")", " holds the lock on ",
                  path,
                  ". Two jobs must not write the same files: wait for that job to end, or give "
                  "this one other paths");
  }
  if (!note.empty()) {
    const std::string line = note + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, line.data(), line.size(), 0) < 0) {
      // The note only helps a refused job say who holds the lock; the lock itself is held.
    }
  }
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the open file drops the lock
}

}  // namespace pipemat
