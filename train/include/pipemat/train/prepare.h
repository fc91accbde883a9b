#pragma once
// `pipemat prepare`: text to a Megatron indexed dataset (PREFIX.bin + PREFIX.idx,
// pipemat/data/indexed_dataset.h) of a tokenizer's ids, the input of data.format: indexed.
//
// Documents: a .jsonl input (or every .jsonl file of a directory) holds one document per line,
// the string field `json_key` of a JSON object (as Megatron's tools/preprocess_data.py reads
// it); other text is one document per file, or, with `separator`, the pieces between its
// occurrences (e.g. "\n%\n" for fortune files). Empty documents are left out. Each document is
// one sequence of its token ids, with the tokenizer's end-of-text id appended when `append_eod`.
// The token dtype is the smallest megatron-core picks for the vocabulary (dtype_for_vocab).
// Documents are encoded on `threads` threads in batches and written in input order, so the
// output is the same for any thread count.

#include <cstdint>
#include <ostream>
#include <string>

namespace pipemat::train {

struct PrepareOptions {
  std::string tokenizer;  // a tokenizer.json, a SentencePiece .model or a directory of one
  std::string input;      // a text or .jsonl file, or a directory of them
  std::string output;     // the prefix: PREFIX.bin and PREFIX.idx
  std::string separator;  // "": one document per file (per line for .jsonl)
  std::string json_key = "text";
  bool append_eod = false;
  bool overwrite = false;
  int threads = 1;
};

struct PrepareSummary {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;  // of text encoded
  int64_t files = 0;
  double seconds = 0;  // encoding and writing, not reading the input
  std::string dtype;
  std::string tokenizer;  // describe()
  std::string bin, idx;
};

// ConfigError naming --tokenizer / --input / --output / --json-key for what does not fit
// (a tokenizer without an end-of-text id and append_eod, a .jsonl line that is not an object
// with that string field, an existing output without overwrite); progress (bytes, tokens,
// tokens/s) to `progress` when given, about twice a second.
PrepareSummary prepare_dataset(const PrepareOptions& options, std::ostream* progress);

}  // namespace pipemat::train
