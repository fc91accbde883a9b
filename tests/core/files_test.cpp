#include "pipemat/core/files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "pipemat/core/error.h"

namespace pipemat {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the temp dir, removed at the end of the test.
class FilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pipemat_files_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path.string();
  }

  // The ConfigError text of reading `path` as `key`.
  static std::string error_of(const std::string& path, const std::string& key,
                              int64_t max_bytes = kMaxInputFileBytes) {
    try {
      read_regular_file(path, key, max_bytes);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  }

  fs::path dir_;
};

TEST_F(FilesTest, ReadsARegularFileWhole) {
  EXPECT_EQ(read_regular_file(write("a.txt", "hello\nworld"), "data.path"), "hello\nworld");
  EXPECT_EQ(read_regular_file(write("empty.txt", ""), "data.path"), "");
}

TEST_F(FilesTest, RefusesADeviceBeforeReadingIt) {
  // /dev/zero never ends: a plain read grows until memory runs out.
  EXPECT_EQ(error_of("/dev/zero", "schedule.csv"),
            "schedule.csv: '/dev/zero' is a character device; expected a regular file (copy the "
            "data into a file and give its path)");
}

TEST_F(FilesTest, RefusesAFifoWithoutOpeningIt) {
  // Opening a FIFO with no writer blocks forever; the check is a stat before the open.
  const std::string fifo = (dir_ / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of(fifo, "data.path"),
            "data.path: '" + fifo +
                "' is a FIFO (named pipe); expected a regular file (copy the data into a file and "
                "give its path)");
}

TEST_F(FilesTest, RefusesADirectoryAndAMissingPath) {
  EXPECT_EQ(error_of(dir_.string(), "schedule.csv"),
            "schedule.csv: '" + dir_.string() +
                "' is a directory; expected a regular file (copy the data into a file and give "
                "its path)");
  const std::string missing = (dir_ / "missing.csv").string();
  EXPECT_EQ(error_of(missing, "schedule.csv"),
            "schedule.csv: cannot open '" + missing +
                "' (No such file or directory); expected a readable regular file");
}

TEST_F(FilesTest, RefusesAFileAboveTheCapNamingSizeAndCap) {
  const std::string path = write("big.txt", std::string(2048, 'x'));
  EXPECT_EQ(read_regular_file(path, "data.path", 2048).size(), 2048u);
  EXPECT_EQ(error_of(path, "data.path", 1024),
            "data.path: '" + path +
                "' holds 2.00 KiB, more than the cap of 1.00 KiB for one input file; give a "
                "smaller file (or split it into a directory of files where the key takes one)");
}

// Note [Opening an input file]: a symlink to a regular file is read; one to a device or a FIFO
// is refused like the device or the FIFO itself, naming the link's path; read_at reads at any
// offset and stops at the end of the file.
TEST_F(FilesTest, InputFileFollowsLinksToFilesAndRefusesLinksToDevicesAndFifos) {
  const std::string target = write("target.bin", "0123456789");
  const std::string link = (dir_ / "link.bin").string();
  fs::create_symlink(target, link);
  std::string problem;
  const InputFile file = InputFile::open(link, kNoSizeCap, problem);
  ASSERT_TRUE(file.is_open()) << problem;
  EXPECT_EQ(file.size(), 10);
  char buffer[8] = {};
  EXPECT_EQ(file.read_at(6, buffer, 8), 4);
  EXPECT_EQ(std::string(buffer, 4), "6789");
  EXPECT_EQ(read_whole(file, problem), "0123456789");
  EXPECT_EQ(problem, "");

  const std::string zero = (dir_ / "zero.bin").string();
  fs::create_symlink("/dev/zero", zero);
  EXPECT_FALSE(InputFile::open(zero, kNoSizeCap, problem).is_open());
  EXPECT_EQ(problem, "'" + zero +
                         "' is a character device; expected a regular file (copy the data into a "
                         "file and give its path)");
  const std::string fifo = (dir_ / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string fifo_link = (dir_ / "pipe-link").string();
  fs::create_symlink(fifo, fifo_link);
  EXPECT_FALSE(InputFile::open(fifo_link, kNoSizeCap, problem).is_open());
  EXPECT_EQ(problem, "'" + fifo_link +
                         "' is a FIFO (named pipe); expected a regular file (copy the data into a "
                         "file and give its path)");
  try {
    read_whole_file<PipelineError>(fifo, "load_checkpoint");
    ADD_FAILURE() << "read a FIFO";
  } catch (const PipelineError& e) {
    EXPECT_EQ(std::string(e.what()),
              "load_checkpoint: '" + fifo +
                  "' is a FIFO (named pipe); expected a regular file (copy the data into a file "
                  "and give its path)");
  }
}

}  // namespace
}  // namespace pipemat
