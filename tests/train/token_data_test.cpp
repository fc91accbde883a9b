// The data of the gpt and the llama as token ids (pipemat/train/text_data.h): bytes without a
// tokenizer (the windows text_windows draws), a tokenizer's ids of each split, the documents of
// an indexed dataset split by the block rule; and a tied llama on such data equal to the single
// process bitwise.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/data/indexed_dataset.h"
#include "pipemat/data/tokenizer.h"
#include "pipemat/train/text_data.h"
#include "pipemat/train/train.h"
#include "text_config.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

const std::string kTokenizer =
    std::string(PIPEMAT_SOURCE_DIR) + "/configs/tokenizers/fortunes-bpe/tokenizer.json";

class TokenDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pipemat_token_data_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string text_file(size_t bytes) const {
    const char* words[] = {"The ", "cat ", "sat ", "on ", "a ", "mat. ", "Why? ", "\n"};
    std::string text;
    for (uint32_t x = 7; text.size() < bytes;) {
      x = x * 1664525u + 1013904223u;
      text += words[(x >> 16) % 8];
    }
    const fs::path path = dir_ / "text.txt";
    std::ofstream(path, std::ios::binary) << text;
    return path.string();
  }
  // `documents` documents; document d holds d % 7 + 3 tokens, each 100 * d + its index (so a
  // window's tokens name their documents).
  std::string indexed(int documents, data::TokenDtype dtype = data::TokenDtype::uint16) const {
    const std::string prefix = (dir_ / "set").string();
    data::IndexedDatasetWriter w(prefix, dtype, /*overwrite=*/true);
    for (int d = 0; d < documents; ++d) {
      std::vector<int32_t> ids;
      for (int j = 0; j < d % 7 + 3; ++j) ids.push_back(100 * d + j);
      w.add_sequence(ids);
      w.end_document();
    }
    w.finish();
    return prefix;
  }
  fs::path dir_;
};

std::vector<int64_t> all_of(const TokenSplit& split) {
  std::vector<int64_t> out(static_cast<size_t>(split.size()));
  split.read(0, split.size(), out.data());
  return out;
}

TEST_F(TokenDataTest, BytesWithoutATokenizerAreTheWindowsOfTheText) {
  DataOptions o;
  o.path = text_file(40000);
  o.validation = 0.25;
  const TokenData d = load_token_data(o, 256, 17);
  const TextCorpus corpus = load_text(o.path, 0.25, 17);
  EXPECT_EQ(d.validation_tokens_per_byte, 1.0);
  for (int64_t step : {0, 5}) {
    const auto [a, b] = token_windows(*d.train, 3, 16, 9, step, 2);
    const auto [c, e] = text_windows(corpus.train, 3, 16, 9, step, 2);
    EXPECT_TRUE(at::equal(a, c));
    EXPECT_TRUE(at::equal(b, e));
  }
  EXPECT_EQ(d.validation->size(), static_cast<int64_t>(corpus.validation.size()));
}

TEST_F(TokenDataTest, ATokenizerGivesEachSplitItsIds) {
  DataOptions o;
  o.path = text_file(40000);
  o.validation = 0.25;
  o.tokenizer = kTokenizer;
  const auto tokenizer = data::load_tokenizer(kTokenizer);
  const TokenData d = load_token_data(o, tokenizer->vocab_size(), 17);
  const TextCorpus corpus = load_text(o.path, 0.25, 17);
  std::vector<int64_t> want;
  for (int32_t id : tokenizer->encode(corpus.train)) want.push_back(id);
  EXPECT_EQ(all_of(*d.train), want);
  const auto validation = tokenizer->encode(corpus.validation);
  EXPECT_EQ(d.validation->size(), static_cast<int64_t>(validation.size()));
  EXPECT_DOUBLE_EQ(d.validation_tokens_per_byte,
                   static_cast<double>(validation.size()) / corpus.validation.size());
  EXPECT_LT(d.validation_tokens_per_byte, 0.5);  // a BPE of English: several bytes per token
  // A window is a slice of the ids.
  const auto [ids, next] = token_windows(*d.train, 2, 8, 3, 1, 0);
  EXPECT_TRUE(at::equal(ids.narrow(1, 1, 7), next.narrow(1, 0, 7)));
  // A model smaller than the tokenizer.
  try {
    load_token_data(o, 1000, 17);
    ADD_FAILURE() << "a tokenizer of more ids than model.vocab";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("ids but model.vocab is 1000; set model.vocab: " +
                                         std::to_string(tokenizer->vocab_size())),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TokenDataTest, AnIndexedDatasetSplitsByDocumentsAndReadsAcrossThem) {
  DataOptions o;
  o.path = indexed(20);
  o.format = DataFormat::kIndexed;
  o.validation = 0.25;  // documents 3, 7, 11, 15, 19
  const TokenData d = load_token_data(o, 2000, 5);
  std::vector<int64_t> train, validation;
  for (int doc = 0; doc < 20; ++doc) {
    auto& to = doc % 4 == 3 ? validation : train;
    for (int j = 0; j < doc % 7 + 3; ++j) to.push_back(100 * doc + j);
  }
  EXPECT_EQ(all_of(*d.train), train);
  EXPECT_EQ(all_of(*d.validation), validation);
  EXPECT_EQ(d.validation_tokens_per_byte, 0);  // no tokenizer: unknown
  // Windows cross document boundaries, as Megatron's samples do: every token is a train one.
  const std::set<int64_t> train_ids(train.begin(), train.end());
  for (int64_t mb = 0; mb < 8; ++mb) {
    const auto [ids, next] = token_windows(*d.train, 4, 12, 1, 0, mb);
    for (int64_t i = 0; i < ids.numel(); ++i)
      EXPECT_TRUE(train_ids.count(ids.view(-1)[i].item<int64_t>()));
  }
  // An id beyond the model's vocabulary names the file.
  try {
    load_token_data(o, 1000, 5);
    ADD_FAILURE() << "ids up to 1908 in a model of 1000";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("set.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(model.vocab is 1000)"), std::string::npos) << e.what();
  }
  // A window longer than a split.
  try {
    load_token_data(o, 2000, 40);
    ADD_FAILURE() << "a validation split of 36 tokens";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("a window needs 40"), std::string::npos) << e.what();
  }
}

// A tied llama of vocabulary 2048 on the repo's BPE tokenizer, from a prepared dataset and from
// text: the pipeline equals the single process bitwise.
TEST_F(TokenDataTest, ATiedLlamaOnTokensEqualsTheSingleProcessBitwise) {
  const std::string text = text_file(60000);
  for (const DataFormat format : {DataFormat::kText, DataFormat::kIndexed}) {
    SCOPED_TRACE(to_string(format));
    TrainConfig c = testing::llama_config(text, "zb-v", "selective");
    c.model.vocab = 2048;
    c.model.tie_embeddings = true;
    c.data.tokenizer = kTokenizer;
    if (format == DataFormat::kIndexed) {
      const auto tokenizer = data::load_tokenizer(kTokenizer);
      const std::string prefix = (dir_ / "prepared").string();
      data::IndexedDatasetWriter w(prefix, data::TokenDtype::uint16, true);
      std::ifstream in(text);
      const std::string all((std::istreambuf_iterator<char>(in)), {});
      for (size_t at = 0; at < all.size(); at += 997) {  // documents of 997 bytes
        w.add_sequence(tokenizer->encode(all.substr(at, 997)));
        w.end_document();
      }
      w.finish();
      c.data.format = DataFormat::kIndexed;
      c.data.path = prefix;
    }
    testing::expect_pipeline_equals_reference(c);
  }
}

}  // namespace
}  // namespace pipemat::train
