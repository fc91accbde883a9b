#include "pipemat/core/file_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "pipemat/core/error.h"

namespace pipemat {
namespace {

namespace fs = std::filesystem;

std::string fresh_path(const char* name) {
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("pipemat-lock-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path path = dir / name;
  fs::remove(path);
  return path.string();
}

std::string refusal(const std::string& path, const std::string& what) {
  try {
    FileLock second(path, what);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(FileLock, ASecondHolderIsRefusedNamingTheHolderUntilTheFirstLetsGo) {
  const std::string path = fresh_path("ck.lock");
  {
    FileLock first(path, "checkpoint.dir 'ck'", "pid 42 run 0123abcd");
    const std::string text = refusal(path, "checkpoint.dir 'ck'");
    EXPECT_NE(
        text.find("checkpoint.dir 'ck' is in use by another job: process " +
                  std::to_string(::getpid()) + " (pid 42 run 0123abcd) holds the lock on " + path),
        std::string::npos)
        << text;
    EXPECT_EQ(flock_holder(path), ::getpid());
  }
  EXPECT_EQ(flock_holder(path), -1);
  FileLock again(path, "checkpoint.dir 'ck'");  // released with the first
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "pid 42 run 0123abcd") << "a lock without a note leaves the contents alone";
}

// A lock whose holder died (SIGKILL: no cleanup) is free: the kernel dropped it with the process.
TEST(FileLock, TheLockOfAKilledProcessIsTakenOver) {
  const std::string path = fresh_path("metrics.jsonl");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      FileLock held(path, "output.metrics");
      const char byte = 1;
      if (::write(ready[1], &byte, 1) != 1) ::_exit(2);
      ::pause();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1) << "the child took the lock";
  ::close(ready[0]);
  const std::string text = refusal(path, "output.metrics");
  EXPECT_NE(text.find("process " + std::to_string(child) + " holds the lock"), std::string::npos)
      << text;
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(refusal(path, "output.metrics"), "") << "the dead holder's lock is taken over";
}

TEST(FileLock, AFileThatCannotBeCreatedIsAConfigErrorNamingIt) {
  try {
    FileLock lock("/nonexistent-dir/x.lock", "output.metrics");
    FAIL() << "no such directory";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("output.metrics: cannot open /nonexistent-dir/x.lock to "
                                         "lock it: No such file or directory"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pipemat
