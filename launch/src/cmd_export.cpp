// `pipemat export`: a checkpoint -> train::export_weights -> one safetensors file; prints what
// it wrote.

#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/compute.h"
#include "pipemat/train/weights.h"

namespace pipemat::launch {

void add_export_command(CLI::App& app) {
  struct Flags {
    std::string checkpoint;
    std::string out;
    bool overwrite = false;
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "export",
      "Write the parameters of a checkpoint (every rank's file) as one safetensors file, under\n"
      "the names of the single-process model, in float32.");
  cmd->footer(
      "Examples:\n"
      "  pipemat export --checkpoint runs/gpt-fortunes/checkpoints/step-000650 --out "
      "gpt.safetensors\n"
      "  pipemat export --checkpoint runs/llama-fortunes/checkpoints/step-000650 --out "
      "hf-llama/model.safetensors\n"
      "The file's metadata holds the model's config, so `pipemat generate --checkpoint FILE` and\n"
      "training.init_from read it back. A llama's file carries Hugging Face's names, and a\n"
      "config.json is written next to it: transformers loads the directory. See docs/training.md.");
  cmd->add_option("--checkpoint", f->checkpoint,
                  "A step-NNNNNN directory that `pipemat train` wrote")
      ->required();
  cmd->add_option("--out", f->out,
                  "The safetensors file to write (its directory is created). Never inside a "
                  "checkpoint directory, never through a symlink; an existing file only with "
                  "--overwrite. Every file is written, or none")
      ->required();
  cmd->add_flag("--overwrite", f->overwrite,
                "Replace --out (and a llama's config.json beside it) when it exists");
  cmd->callback([f] {
    pp::set_compute_threads(pp::default_compute_threads(1));
    const train::ExportSummary s = train::export_weights(f->checkpoint, f->out, f->overwrite);
    std::cout << "exported " << f->checkpoint << " (" << s.kind << ", step " << s.step << ", "
              << s.stages << " stages over " << s.ranks << " ranks): " << s.tensors << " tensors, "
              << format_count(s.elements) << " parameters, " << format_bytes(s.bytes) << " -> "
              << s.path << (s.config_json.empty() ? "" : " and " + s.config_json) << "\n"
              << std::flush;
  });
}

}  // namespace pipemat::launch
