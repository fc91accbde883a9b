// Loading a tokenizer, UTF-8 and the stream decoder: Note [Text to tokens] in
// pipemat/data/tokenizer.h.

#include "pipemat/data/tokenizer.h"

#include <sys/stat.h>

#include "pipemat/core/files.h"
#include "tokenizers.h"
#include "utf8.h"

namespace pipemat::data {

std::string with_commas(int64_t n) {
  const std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out = n < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() + 8);
  utf8::append_valid(bytes, out);
  return out;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  std::string file = path;
  if (is_directory(path)) {
    const std::string dir = path.empty() || path.back() == '/' ? path : path + "/";
    if (path_exists(dir + "tokenizer.json")) {
      file = dir + "tokenizer.json";
    } else if (path_exists(dir + "tokenizer.model")) {
      file = dir + "tokenizer.model";
    } else {
      PIPEMAT_THROW(DataError, "tokenizer: the directory '", path,
                    "' holds neither tokenizer.json (Hugging Face) nor tokenizer.model "
                    "(SentencePiece)");
    }
  }
  std::string bytes = read_whole_file<DataError>(file, "tokenizer", kMaxInputFileBytes);
  const size_t first = bytes.find_first_not_of(" \t\r\n");
  PIPEMAT_CHECK(first != std::string::npos, DataError, file,
                ": the file is empty; expected a tokenizer.json or a SentencePiece model");
  if (bytes[first] == '{' || bytes[first] == '[') return parse_tokenizer_json(bytes, file);
  try {
    return make_sentencepiece(std::move(bytes), file);
  } catch (const DataError& e) {
    PIPEMAT_THROW(DataError, e.what(),
                  "; a tokenizer.json would begin with '{' (expected a Hugging Face "
                  "tokenizer.json or a SentencePiece .model)");
  }
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}

std::string StreamDecoder::push(int32_t id) {
  const std::string bytes = tokenizer_->token_bytes(id, at_start_);
  if (bytes.empty()) return {};
  at_start_ = false;
  pending_ += bytes;
  std::string out;
  const size_t tail = utf8::append_valid(pending_, out, /*keep_truncated_tail=*/true);
  pending_.erase(0, pending_.size() - tail);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = valid_utf8(pending_);
  pending_.clear();
  at_start_ = true;
  return out;
}

}  // namespace pipemat::data
