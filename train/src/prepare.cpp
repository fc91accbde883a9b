// `pipemat prepare` (pipemat/train/prepare.h): text -> token ids -> a Megatron indexed dataset.

#include "pipemat/train/prepare.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/json.h"
#include "pipemat/data/indexed_dataset.h"
#include "pipemat/data/tokenizer.h"
#include "pipemat/train/text_data.h"

namespace pipemat::train {
namespace {

bool is_jsonl(const std::string& path) {
  return path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
}

// The documents of one file, as views into its text (jsonl: decoded strings kept in `owned`).
void split_documents(const TextFile& file, const PrepareOptions& o,
                     std::vector<std::string_view>& docs, std::vector<std::string>& owned) {
  const std::string_view text = file.text;
  if (is_jsonl(file.path)) {
    size_t line_no = 0;
    for (size_t at = 0; at < text.size();) {
      size_t end = text.find('\n', at);
      if (end == std::string_view::npos) end = text.size();
      ++line_no;
      const std::string_view line = text.substr(at, end - at);
      at = end + 1;
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
      nlohmann::json j;
      try {
        j = parse_json(line);
      } catch (const JsonError& e) {
        PIPEMAT_THROW(ConfigError, "--input: ", file.path, " line ", line_no, ": ", e.what());
      }
      PIPEMAT_CHECK(j.is_object() && j.contains(o.json_key) && j[o.json_key].is_string(),
                    ConfigError, "--input: ", file.path, " line ", line_no,
                    " is not a JSON object with the string field '", o.json_key, "' (--json-key)");
      owned.push_back(j[o.json_key].get<std::string>());
    }
    return;
  }
  if (o.separator.empty()) {
    docs.push_back(text);
    return;
  }
  for (size_t at = 0; at <= text.size();) {
    size_t end = text.find(o.separator, at);
    if (end == std::string_view::npos) end = text.size();
    docs.push_back(text.substr(at, end - at));
    at = end + o.separator.size();
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

PrepareSummary prepare_dataset(const PrepareOptions& o, std::ostream* progress) {
  PIPEMAT_CHECK(!o.output.empty(), ConfigError,
                "--output is empty; give the prefix of the dataset to write (PREFIX.bin and "
                "PREFIX.idx)");
  PIPEMAT_CHECK(o.threads >= 1, ConfigError, "--threads: ", o.threads, " is not >= 1");
  std::unique_ptr<data::Tokenizer> tokenizer;
  try {
    tokenizer = data::load_tokenizer(o.tokenizer);
  } catch (const DataError& e) {
    PIPEMAT_THROW(ConfigError, "--tokenizer: ", e.what());
  }
  PIPEMAT_CHECK(!o.append_eod || tokenizer->eos_id().has_value(), ConfigError,
                "--append-eod: ", tokenizer->describe(), " has no end-of-text token");
  const std::vector<TextFile> files = read_text_files(o.input, "--input");
  std::vector<std::string_view> docs;
  std::vector<std::string> owned;
  for (const TextFile& f : files) split_documents(f, o, docs, owned);
  for (const std::string& s : owned) docs.emplace_back(s);
  docs.erase(std::remove_if(docs.begin(), docs.end(), [](std::string_view d) { return d.empty(); }),
             docs.end());
  int64_t total_bytes = 0;
  for (std::string_view d : docs) total_bytes += static_cast<int64_t>(d.size());

  PrepareSummary summary;
  summary.files = static_cast<int64_t>(files.size());
  summary.tokenizer = tokenizer->describe();
  const data::TokenDtype dtype = data::dtype_for_vocab(tokenizer->vocab_size());
  summary.dtype = data::to_string(dtype);
  std::unique_ptr<data::IndexedDatasetWriter> writer;
  try {
    writer = std::make_unique<data::IndexedDatasetWriter>(o.output, dtype, o.overwrite);
  } catch (const DataError& e) {
    PIPEMAT_THROW(ConfigError, "--output: ", e.what(),
                  o.overwrite ? "" : " (--overwrite replaces it)");
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto last_report = t0;
  const auto report = [&](bool final) {
    if (progress == nullptr) return;
    const double s = std::max(seconds_since(t0), 1e-9);
    const double share = total_bytes > 0 ? 100.0 * static_cast<double>(summary.bytes) /
                                               static_cast<double>(total_bytes)
                                         : 100.0;
    char line[200];
    std::snprintf(
        line, sizeof(line), "\rprepare: %5.1f %% of %s, %s documents, %s tokens, %s tokens/s",
        share, format_bytes(total_bytes).c_str(), format_count(summary.documents).c_str(),
        format_count(summary.tokens).c_str(),
        format_count(static_cast<int64_t>(static_cast<double>(summary.tokens) / s)).c_str());
    *progress << line << (final ? "\n" : "") << std::flush;
  };
  // Batches of documents: each thread encodes every `threads`-th one, then the batch is written
  // in order.
  constexpr size_t kBatch = 4096;
  std::vector<std::vector<int32_t>> ids(kBatch);
  for (size_t first = 0; first < docs.size(); first += kBatch) {
    const size_t count = std::min(kBatch, docs.size() - first);
    std::vector<std::thread> workers;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(o.threads));
    for (int t = 0; t < o.threads; ++t) {
      workers.emplace_back([&, t] {
        try {
          for (size_t k = static_cast<size_t>(t); k < count; k += static_cast<size_t>(o.threads))
            ids[k] = tokenizer->encode(docs[first + k]);
        } catch (...) {
          errors[static_cast<size_t>(t)] = std::current_exception();
        }
      });
    }
    for (auto& w : workers) w.join();
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    for (size_t k = 0; k < count; ++k) {
      if (o.append_eod) ids[k].push_back(*tokenizer->eos_id());
      writer->add_sequence(ids[k]);
      writer->end_document();
      summary.tokens += static_cast<int64_t>(ids[k].size());
      summary.bytes += static_cast<int64_t>(docs[first + k].size());
      ++summary.documents;
    }
    if (seconds_since(last_report) >= 0.5) {
      report(false);
      last_report = std::chrono::steady_clock::now();
    }
  }
  writer->finish();
  summary.seconds = seconds_since(t0);
  report(true);
  summary.bin = o.output + ".bin";
  summary.idx = o.output + ".idx";
  return summary;
}

}  // namespace pipemat::train
