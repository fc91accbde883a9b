// `pipemat generate`: flags -> SampleOptions -> train::generate_text; prints the prompt and
// its continuation.

#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "pipemat/pp/compute.h"
#include "pipemat/train/generate.h"

namespace pipemat::launch {

void add_generate_command(CLI::App& app) {
  struct Flags {
    std::string checkpoint;
    train::SampleOptions sample;
    bool quiet = false;
    bool ids = false;
  };
  auto f = std::make_shared<Flags>();
  f->sample.tokens = 200;
  auto* cmd =
      app.add_subcommand("generate",
                         "Sample text from a trained gpt or llama checkpoint: every stage "
                         "of the pipeline run is loaded into\n"
                         "this one process and continues the prompt token by token (byte by "
                         "byte without a tokenizer).");
  cmd->footer(
      "Examples:\n"
      "  pipemat generate --checkpoint runs/gpt-fortunes/checkpoints/step-000650 --prompt \"Q: "
      "\"\n"
      "  pipemat generate --checkpoint DIR --tokens 500 --temperature 1.0 --top-k 0 --seed 3\n"
      "  pipemat generate --checkpoint HF_DIR --greedy --prompt \"Once upon a time\"\n"
      "The checkpoint's manifest holds the run's config (and its data.tokenizer), so no --config\n"
      "is needed. A Hugging Face Llama directory (config.json, safetensors, tokenizer.json or\n"
      "tokenizer.model) as transformers wrote it works too. Lower --temperature (e.g. 0.5) gives\n"
      "safer, more repetitive text; --top-k 0 samples from every token. See docs/training.md.");
  cmd->add_option("--checkpoint", f->checkpoint,
                  "A step-NNNNNN directory that `pipemat train` wrote for a gpt or llama, a\n"
                  "safetensors file (or directory) that `pipemat export` wrote from one, or a\n"
                  "Hugging Face Llama directory")
      ->required();
  cmd->add_option("--prompt", f->sample.prompt, "The text to continue (default: a newline)");
  cmd->add_option("--tokens", f->sample.tokens,
                  "Tokens (bytes without a tokenizer) to generate (default 200)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--temperature", f->sample.temperature, "Softmax temperature, > 0 (default 0.8)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--top-k", f->sample.top_k,
                  "Sample among the k most likely tokens; 0: all (default 40)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 22));
  cmd->add_flag("--greedy", f->sample.greedy,
                "Take the most likely token each time (no sampling: --temperature, --top-k and\n"
                "--seed are unused)");
  cmd->add_option("--tokenizer", f->sample.tokenizer,
                  "A tokenizer.json, a SentencePiece .model or a directory holding one (default:\n"
                  "the run's data.tokenizer; none: bytes)");
  cmd->add_option("--seed", f->sample.seed, "Seed of the sampling generator (default 0)");
  cmd->add_flag("--quiet", f->quiet, "Print only the generated text");
  cmd->add_flag("--ids", f->ids,
                "Also print the generated token ids, one line \"ids: 17 4 ...\" after the text");
  cmd->callback([f] {
    pp::set_compute_threads(pp::default_compute_threads(1));
    const train::GenerateResult r = train::generate_text(f->checkpoint, f->sample);
    if (!f->quiet) {
      std::cout << "# " << f->checkpoint << ": " << r.model
                << (r.step >= 0 ? ", after " + std::to_string(r.step) + " steps" : std::string())
                << "\n"
                << f->sample.prompt;
    }
    std::cout << r.text << (f->quiet ? "" : "\n");
    if (f->ids) {
      std::cout << (f->quiet ? "\n" : "") << "ids:";
      for (int64_t id : r.ids) std::cout << " " << id;
      std::cout << "\n";
    }
    std::cout << std::flush;
  });
}

}  // namespace pipemat::launch
