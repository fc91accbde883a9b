// `pipemat prepare`: flags -> PrepareOptions -> train::prepare_dataset; prints what it wrote.

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "commands.h"
#include "pipemat/core/format.h"
#include "pipemat/train/prepare.h"

namespace pipemat::launch {

void add_prepare_command(CLI::App& app) {
  struct Flags {
    train::PrepareOptions options;
    bool quiet = false;
  };
  auto f = std::make_shared<Flags>();
  f->options.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto* cmd = app.add_subcommand(
      "prepare",
      "Tokenize text into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx), the input of\n"
      "data.format: indexed; megatron-core, GPT-NeoX and NeMo read the same files.");
  cmd->footer(
      "Examples:\n"
      "  pipemat prepare --tokenizer configs/tokenizers/fortunes-bpe --input "
      "/usr/share/games/fortunes \\\n"
      "      --separator $'\\n%\\n' --append-eod --output data/fortunes-bpe\n"
      "  pipemat prepare --tokenizer hf-llama/tokenizer.json --input corpus.jsonl --output "
      "data/corpus\n"
      "Documents: a .jsonl file holds one per line (the --json-key string field of a JSON\n"
      "object, as Megatron's preprocess_data.py reads it); other text is one per file, or the\n"
      "pieces between --separator. Train on it with data.format: indexed and data.path: PREFIX\n"
      "(and data.tokenizer for generate and the loss per byte). See docs/data.md.");
  cmd->add_option("--tokenizer", f->options.tokenizer,
                  "A Hugging Face tokenizer.json (byte-level BPE), a SentencePiece .model, or a\n"
                  "directory holding one")
      ->required();
  cmd->add_option("--input", f->options.input,
                  "A text or .jsonl file, or a directory of them (read recursively, in path\n"
                  "order; binary files skipped)")
      ->required();
  cmd->add_option("--output", f->options.output,
                  "The prefix of the dataset: PREFIX.bin and PREFIX.idx are written (under\n"
                  "temporary names, renamed when complete)")
      ->required();
  cmd->add_option("--separator", f->options.separator,
                  "Split plain text into documents at this string (e.g. $'\\n%\\n' for fortune\n"
                  "files); default: one document per file");
  cmd->add_option("--json-key", f->options.json_key,
                  "The field of each .jsonl line that holds the text (default text)");
  cmd->add_flag("--append-eod", f->options.append_eod,
                "Append the tokenizer's end-of-text token to every document");
  cmd->add_option("--threads", f->options.threads,
                  "Threads that encode (default: the machine's hardware threads)")
      ->check(CLI::Range(1, 1024));
  cmd->add_flag("--overwrite", f->options.overwrite, "Replace PREFIX.bin and PREFIX.idx");
  cmd->add_flag("--quiet", f->quiet, "No progress line");
  cmd->callback([f] {
    const train::PrepareSummary s =
        train::prepare_dataset(f->options, f->quiet ? nullptr : &std::cerr);
    char rate[64];
    std::snprintf(rate, sizeof(rate), "%.0f", s.seconds > 0 ? s.tokens / s.seconds : 0.0);
    std::cout << "prepared " << s.documents << " documents of " << s.files << " files ("
              << format_bytes(s.bytes) << " of text) with " << s.tokenizer << ": "
              << format_count(s.tokens) << " tokens (" << s.dtype << ") in "
              << format_fixed(s.seconds, 2) << " s, " << rate << " tokens/s on "
              << f->options.threads << " threads -> " << s.bin << ", " << s.idx << "\n"
              << std::flush;
  });
}

}  // namespace pipemat::launch
