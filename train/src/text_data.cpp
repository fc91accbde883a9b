#include "pipemat/train/text_data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <random>
#include <set>
#include <system_error>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/core/format.h"
#include "pipemat/data/indexed_dataset.h"
#include "pipemat/data/tokenizer.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

// Only regular files, each and all together at most kMaxInputFileBytes (core/files.h): a FIFO
// or a device would block or read until memory runs out.
std::string read_file(const fs::path& path, size_t read_before, const std::string& key) {
  std::string text = read_regular_file(path.string(), key);
  PIPEMAT_CHECK(read_before + text.size() <= static_cast<size_t>(kMaxInputFileBytes), ConfigError,
                key, ": the text files read hold more than the cap of ",
                format_bytes(kMaxInputFileBytes), " in all (at '", path.string(),
                "'); give a smaller directory");
  return text;
}

// The split rule of text_data.h: block (or document) i is held out for validation.
bool held_out(int64_t i, double fraction) {
  return std::floor(static_cast<double>(i + 1) * fraction) >
         std::floor(static_cast<double>(i) * fraction);
}

}  // namespace

std::vector<TextFile> read_text_files(const std::string& path, const std::string& key,
                                      int64_t* skipped_binary) {
  PIPEMAT_CHECK(!path.empty(), ConfigError, key,
                " is empty; give a text file or a directory of text files, e.g. "
                "/usr/share/games/fortunes (Debian's fortunes package)");
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  PIPEMAT_CHECK(fs::exists(status), ConfigError, key, ": '", path,
                "' does not exist; give a text file or a directory of text files");
  std::vector<TextFile> out;
  size_t total = 0;
  int64_t skipped = 0;
  if (fs::is_directory(status)) {
    std::vector<fs::path> files;
    for (auto it = fs::recursive_directory_iterator(path, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (it->is_regular_file(ec)) files.push_back(it->path());
    }
    PIPEMAT_CHECK(!ec, ConfigError, key, ": cannot list '", path, "': ", ec.message());
    std::sort(files.begin(), files.end());
    std::set<fs::path> seen;  // canonical paths: a symlink to a file read before is skipped
    for (const fs::path& file : files) {
      const fs::path real = fs::canonical(file, ec);
      if (!seen.insert(ec ? file : real).second) continue;
      std::string text = read_file(file, total, key);
      if (text.empty()) continue;
      if (text.find('\0') != std::string::npos) {
        ++skipped;
        continue;
      }
      total += text.size();
      out.push_back({file.string(), std::move(text)});
    }
    PIPEMAT_CHECK(!out.empty(), ConfigError, key, ": '", path, "' holds no text files (", skipped,
                  " binary files skipped)");
  } else {
    std::string text = read_file(path, 0, key);
    PIPEMAT_CHECK(!text.empty(), ConfigError, key, ": '", path, "' is empty");
    const auto nul = text.find('\0');
    PIPEMAT_CHECK(nul == std::string::npos, ConfigError, key, ": '", path,
                  "' is binary (a NUL byte at offset ", nul,
                  "); give a text file or a directory of text files");
    out.push_back({path, std::move(text)});
  }
  if (skipped_binary != nullptr) *skipped_binary = skipped;
  return out;
}

TextCorpus load_text(const std::string& path, double validation_fraction, int64_t min_bytes) {
  PIPEMAT_CHECK(validation_fraction > 0 && validation_fraction < 1, ConfigError,
                "data.validation: ", validation_fraction,
                " is not a fraction; expected a value in (0, 1), e.g. 0.05");
  TextCorpus corpus;
  std::string all;
  for (TextFile& file : read_text_files(path, "data.path", &corpus.skipped_binary)) {
    corpus.files.push_back(file.path);
    all += file.text;
  }
  const int64_t blocks = (static_cast<int64_t>(all.size()) + kSplitBlock - 1) / kSplitBlock;
  for (int64_t i = 0; i < blocks; ++i) {
    (held_out(i, validation_fraction) ? corpus.validation : corpus.train) +=
        all.substr(i * kSplitBlock, kSplitBlock);
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

namespace {

// The bytes of a string, not copied: text_windows' view.
class ByteView final : public TokenSplit {
 public:
  explicit ByteView(const std::string& text) : text_(text) {}
  int64_t size() const override { return static_cast<int64_t>(text_.size()); }
  void read(int64_t begin, int64_t count, int64_t* out) const override {
    for (int64_t j = 0; j < count; ++j)
      out[j] = static_cast<unsigned char>(text_[static_cast<size_t>(begin + j)]);
  }

 private:
  const std::string& text_;
};

class Bytes final : public TokenSplit {
 public:
  explicit Bytes(std::string text) : text_(std::move(text)), view_(text_) {}
  int64_t size() const override { return view_.size(); }
  void read(int64_t begin, int64_t count, int64_t* out) const override {
    view_.read(begin, count, out);
  }

 private:
  std::string text_;
  ByteView view_;
};

class Ids final : public TokenSplit {
 public:
  explicit Ids(std::vector<int32_t> ids) : ids_(std::move(ids)) {}
  int64_t size() const override { return static_cast<int64_t>(ids_.size()); }
  void read(int64_t begin, int64_t count, int64_t* out) const override {
    for (int64_t j = 0; j < count; ++j) out[j] = ids_[static_cast<size_t>(begin + j)];
  }

 private:
  std::vector<int32_t> ids_;
};

// Documents of an indexed dataset, back to back: runs [begin, end) of its tokens, merged where
// adjacent, with their starts in the split.
class Documents final : public TokenSplit {
 public:
  Documents(std::shared_ptr<const data::IndexedDataset> dataset,
            std::vector<std::pair<int64_t, int64_t>> runs)
      : dataset_(std::move(dataset)), runs_(std::move(runs)) {
    for (const auto& [b, e] : runs_) {
      starts_.push_back(size_);
      size_ += e - b;
    }
  }
  int64_t size() const override { return size_; }
  void read(int64_t begin, int64_t count, int64_t* out) const override {
    auto k = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) -
                                 starts_.begin() - 1);
    while (count > 0) {
      const int64_t offset = begin - starts_[k];
      const int64_t take = std::min(count, runs_[k].second - runs_[k].first - offset);
      dataset_->read_tokens(runs_[k].first + offset, take, out);
      out += take;
      begin += take;
      count -= take;
      ++k;
    }
  }

 private:
  std::shared_ptr<const data::IndexedDataset> dataset_;
  std::vector<std::pair<int64_t, int64_t>> runs_;
  std::vector<int64_t> starts_;
  int64_t size_ = 0;
};

std::string count_text(int64_t tokens) { return format_count(tokens) + " tokens"; }

TokenData load_indexed(const DataOptions& options, int64_t vocab, int64_t min_tokens,
                       const data::Tokenizer* tokenizer) {
  std::shared_ptr<data::IndexedDataset> dataset;
  try {
    dataset = std::make_shared<data::IndexedDataset>(data::IndexedDataset::open(options.path));
    dataset->validate_vocab(vocab);
  } catch (const DataError& e) {
    PIPEMAT_THROW(ConfigError, "data.path (data.format indexed): ", e.what(), " (model.vocab is ",
                  vocab, ")");
  }
  std::vector<std::pair<int64_t, int64_t>> runs[2];  // train, validation
  const std::vector<int64_t>& docs = dataset->document_indices();
  const std::vector<int64_t>& offsets = dataset->sequence_offsets();
  int64_t validation_documents = 0;
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(docs.size()); ++i) {
    const int64_t b = offsets[static_cast<size_t>(docs[static_cast<size_t>(i)])];
    const int64_t e = offsets[static_cast<size_t>(docs[static_cast<size_t>(i + 1)])];
    const bool v = held_out(i, options.validation);
    validation_documents += v ? 1 : 0;
    auto& list = runs[v ? 1 : 0];
    if (e == b) continue;
    if (!list.empty() && list.back().second == b) {
      list.back().second = e;
    } else {
      list.emplace_back(b, e);
    }
  }
  TokenData out;
  out.train = std::make_shared<Documents>(dataset, runs[0]);
  out.validation = std::make_shared<Documents>(dataset, runs[1]);
  PIPEMAT_CHECK(out.train->size() >= min_tokens && out.validation->size() >= min_tokens,
                ConfigError, "data.path: the indexed dataset ", options.path, " has ",
                dataset->documents(), " documents: ", out.train->size(),
                " tokens for training and ", out.validation->size(), " for validation (",
                validation_documents, " documents, data.validation ", options.validation,
                "), but a window needs ", min_tokens,
                " (model.seq_len + 1); give more documents or a shorter model.seq_len");
  if (tokenizer != nullptr) {  // the bytes the validation tokens decode to
    int64_t bytes = 0;
    std::vector<int64_t> ids(static_cast<size_t>(out.validation->size()));
    out.validation->read(0, out.validation->size(), ids.data());
    try {
      // The end-of-text ids a prepared dataset appends stand for no text.
      const std::optional<int32_t> eos = tokenizer->eos_id();
      for (int64_t id : ids) {
        if (eos && id == *eos) continue;
        bytes +=
            static_cast<int64_t>(tokenizer->token_bytes(static_cast<int32_t>(id), false).size());
      }
    } catch (const DataError& e) {
      PIPEMAT_THROW(ConfigError, "data.tokenizer: the indexed dataset ", options.path,
                    " holds an id the tokenizer does not have: ", e.what());
    }
    if (bytes > 0) out.validation_tokens_per_byte = static_cast<double>(ids.size()) / bytes;
  }
  out.summary = "indexed: " + count_text(out.train->size()) + " train / " +
                count_text(out.validation->size()) + " validation in " +
                std::to_string(dataset->documents()) + " documents of " + options.path + " (" +
                data::to_string(dataset->dtype()) + ")";
  return out;
}

}  // namespace

TokenData load_token_data(const DataOptions& options, int64_t vocab, int64_t min_tokens) {
  std::unique_ptr<data::Tokenizer> tokenizer;
  if (!options.tokenizer.empty()) {
    try {
      tokenizer = data::load_tokenizer(options.tokenizer);
    } catch (const DataError& e) {
      PIPEMAT_THROW(ConfigError, "data.tokenizer: ", e.what());
    }
    PIPEMAT_CHECK(tokenizer->vocab_size() <= vocab, ConfigError,
                  "data.tokenizer: ", tokenizer->describe(), " has ", tokenizer->vocab_size(),
                  " ids but model.vocab is ", vocab, "; set model.vocab: ", tokenizer->vocab_size(),
                  " (or more)");
  }
  TokenData out;
  if (options.format == DataFormat::kIndexed) {
    out = load_indexed(options, vocab, min_tokens, tokenizer.get());
  } else if (tokenizer == nullptr) {
    TextCorpus corpus = load_text(options.path, options.validation, min_tokens);
    out.summary = "text: " + format_bytes(static_cast<int64_t>(corpus.train.size())) + " train / " +
                  format_bytes(static_cast<int64_t>(corpus.validation.size())) +
                  " validation from " + std::to_string(corpus.files.size()) + " files of " +
                  options.path;
    if (corpus.skipped_binary > 0)
      out.summary += " (" + std::to_string(corpus.skipped_binary) + " binary files skipped)";
    out.train = std::make_shared<Bytes>(std::move(corpus.train));
    out.validation = std::make_shared<Bytes>(std::move(corpus.validation));
    out.validation_tokens_per_byte = 1;
  } else {
    TextCorpus corpus = load_text(options.path, options.validation, 1);
    const auto bytes = static_cast<int64_t>(corpus.validation.size());
    std::vector<int32_t> train = tokenizer->encode(corpus.train);
    std::vector<int32_t> validation = tokenizer->encode(corpus.validation);
    PIPEMAT_CHECK(static_cast<int64_t>(train.size()) >= min_tokens &&
                      static_cast<int64_t>(validation.size()) >= min_tokens,
                  ConfigError, "data.path: '", options.path, "' encodes to ", train.size(),
                  " tokens for training and ", validation.size(),
                  " for validation, but a window needs ", min_tokens,
                  " (model.seq_len + 1); give more text or a shorter model.seq_len");
    out.summary = "text: " + count_text(static_cast<int64_t>(train.size())) + " train / " +
                  count_text(static_cast<int64_t>(validation.size())) + " validation from " +
                  std::to_string(corpus.files.size()) + " files of " + options.path;
    out.validation_tokens_per_byte = static_cast<double>(validation.size()) / bytes;
    out.train = std::make_shared<Ids>(std::move(train));
    out.validation = std::make_shared<Ids>(std::move(validation));
  }
  if (tokenizer != nullptr) out.summary += ", tokenizer " + tokenizer->describe();
  return out;
}

std::pair<at::Tensor, at::Tensor> token_windows(const TokenSplit& split, int64_t batch,
                                                int64_t seq_len, uint64_t seed, int64_t step,
                                                int64_t micro_batch) {
  const int64_t span = seq_len + 1;
  PIPEMAT_CHECK(split.size() >= span, ConfigError, "token_windows: ", split.size(),
                " tokens are fewer than a window of ", span);
  std::seed_seq key{static_cast<uint32_t>(seed),        static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(step),        static_cast<uint32_t>(step >> 32),
                    static_cast<uint32_t>(micro_batch), static_cast<uint32_t>(micro_batch >> 32)};
  std::mt19937_64 gen(key);
  std::uniform_int_distribution<int64_t> offset(0, split.size() - span);
  at::Tensor windows = at::empty({batch, span}, at::kLong);
  int64_t* out = windows.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) split.read(offset(gen), span, out + b * span);
  return {windows.narrow(1, 0, seq_len).contiguous(), windows.narrow(1, 1, seq_len).contiguous()};
}

std::pair<at::Tensor, at::Tensor> text_windows(const std::string& text, int64_t batch,
                                               int64_t seq_len, uint64_t seed, int64_t step,
                                               int64_t micro_batch) {
  const int64_t span = seq_len + 1;
  PIPEMAT_CHECK(static_cast<int64_t>(text.size()) >= span, ConfigError,
                "text_windows: ", text.size(), " bytes of text are fewer than a window of ", span);
  return token_windows(ByteView(text), batch, seq_len, seed, step, micro_batch);
}

}  // namespace pipemat::train
