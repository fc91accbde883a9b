#include "pipemat/train/text_data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <set>
#include <system_error>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

// Only regular files, each and all together at most kMaxInputFileBytes (core/files.h): a FIFO
// or a device would block or read until memory runs out.
std::string read_file(const fs::path& path, size_t read_before) {
  std::string text = read_regular_file(path.string(), "data.path");
  PIPEMAT_CHECK(read_before + text.size() <= static_cast<size_t>(kMaxInputFileBytes), ConfigError,
                "data.path: the text files read hold more than the cap of ",
                format_bytes(kMaxInputFileBytes), " in all (at '", path.string(),
                "'); give a smaller directory");
  return text;
}

}  // namespace

TextCorpus load_text(const std::string& path, double validation_fraction, int64_t min_bytes) {
  PIPEMAT_CHECK(validation_fraction > 0 && validation_fraction < 1, ConfigError,
                "data.validation: ", validation_fraction,
                " is not a fraction; expected a value in (0, 1), e.g. 0.05");
  PIPEMAT_CHECK(!path.empty(), ConfigError,
                "data.path is empty; give a text file or a directory of text files, e.g. "
                "/usr/share/games/fortunes (Debian's fortunes package)");
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  PIPEMAT_CHECK(fs::exists(status), ConfigError, "data.path: '", path,
                "' does not exist; give a text file or a directory of text files");
  TextCorpus corpus;
  std::string all;
  if (fs::is_directory(status)) {
    std::vector<fs::path> files;
    for (auto it = fs::recursive_directory_iterator(path, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (it->is_regular_file(ec)) files.push_back(it->path());
    }
    PIPEMAT_CHECK(!ec, ConfigError, "data.path: cannot list '", path, "': ", ec.message());
    std::sort(files.begin(), files.end());
    std::set<fs::path> seen;  // canonical paths: a symlink to a file read before is skipped
    for (const fs::path& file : files) {
      const fs::path real = fs::canonical(file, ec);
      if (!seen.insert(ec ? file : real).second) continue;
      std::string text = read_file(file, all.size());
      if (text.empty()) continue;
      if (text.find('\0') != std::string::npos) {
        ++corpus.skipped_binary;
        continue;
      }
      corpus.files.push_back(file.string());
      all += text;
    }
    PIPEMAT_CHECK(!all.empty(), ConfigError, "data.path: '", path, "' holds no text files (",
                  corpus.skipped_binary, " binary files skipped)");
  } else {
    all = read_file(path, 0);
    PIPEMAT_CHECK(!all.empty(), ConfigError, "data.path: '", path, "' is empty");
    const auto nul = all.find('\0');
    PIPEMAT_CHECK(nul == std::string::npos, ConfigError, "data.path: '", path,
                  "' is binary (a NUL byte at offset ", nul,
                  "); give a text file or a directory of text files");
    corpus.files.push_back(path);
  }
  const int64_t blocks = (static_cast<int64_t>(all.size()) + kSplitBlock - 1) / kSplitBlock;
  for (int64_t i = 0; i < blocks; ++i) {
    const bool validation = std::floor(static_cast<double>(i + 1) * validation_fraction) >
                            std::floor(static_cast<double>(i) * validation_fraction);
    (validation ? corpus.validation : corpus.train) += all.substr(i * kSplitBlock, kSplitBlock);
  }
  const auto too_small = [&](const std::string& part) {
    return static_cast<int64_t>(part.size()) < min_bytes;
  };
  PIPEMAT_CHECK(!too_small(corpus.train) && !too_small(corpus.validation), ConfigError,
                "data.path: '", path, "' has ", all.size(), " bytes: ", corpus.train.size(),
                " for training and ", corpus.validation.size(), " for validation (", kSplitBlock,
                "-byte blocks, data.validation ", validation_fraction, "), but a window needs ",
                min_bytes, " (model.seq_len + 1); give more text or a shorter model.seq_len");
  return corpus;
}

std::pair<at::Tensor, at::Tensor> text_windows(const std::string& text, int64_t batch,
                                               int64_t seq_len, uint64_t seed, int64_t step,
                                               int64_t micro_batch) {
  const int64_t span = seq_len + 1;
  PIPEMAT_CHECK(static_cast<int64_t>(text.size()) >= span, ConfigError,
                "text_windows: ", text.size(), " bytes of text are fewer than a window of ", span);
  std::seed_seq key{static_cast<uint32_t>(seed),        static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(step),        static_cast<uint32_t>(step >> 32),
                    static_cast<uint32_t>(micro_batch), static_cast<uint32_t>(micro_batch >> 32)};
  std::mt19937_64 gen(key);
  std::uniform_int_distribution<int64_t> offset(0, static_cast<int64_t>(text.size()) - span);
  at::Tensor windows = at::empty({batch, span}, at::kLong);
  int64_t* out = windows.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t at = offset(gen);
    for (int64_t j = 0; j < span; ++j) {
      out[b * span + j] = static_cast<unsigned char>(text[static_cast<size_t>(at + j)]);
    }
  }
  return {windows.narrow(1, 0, seq_len).contiguous(), windows.narrow(1, 1, seq_len).contiguous()};
}

}  // namespace pipemat::train
