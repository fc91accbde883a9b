// `pipemat checkpoint DIR`: a checkpoint's layout and tensors (pp::read_checkpoint_manifest) and
// every file verified (pp::verify_checkpoint); exit 1 naming each damaged file.

#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/checkpoint.h"

namespace pipemat::launch {
namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// The field of an optimizer state's name ("x:exp_avg" -> "exp_avg"), "" for a weight.
std::string field_of(const std::string& name) {
  const auto colon = name.rfind(':');
  return colon == std::string::npos ? "" : name.substr(colon + 1);
}

}  // namespace

void add_checkpoint_command(CLI::App& app) {
  struct Flags {
    std::string dir;
    bool all = false;
    bool no_verify = false;
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = app.add_subcommand(
      "checkpoint",
      "Show a checkpoint: the layout that wrote it, its tensors by global name with dtypes and\n"
      "shapes, and every file verified against the SHA-256 its manifest recorded.");
  cmd->footer(
      "Examples:\n"
      "  pipemat checkpoint runs/fortunes/checkpoints/step-000650\n"
      "  pipemat checkpoint runs/fortunes/checkpoints/step-000650 --all   # optimizer state too\n"
      "Exit code: 0 when every file is the one its manifest recorded; 1 naming each missing,\n"
      "damaged or replaced file (or an incomplete or damaged checkpoint). Any layout resumes a\n"
      "checkpoint of format 4: pipemat train --resume DIR on other ranks, split, schedule or data\n"
      "degree (docs/training.md).");
  cmd->add_option("dir", f->dir, "A step-NNNNNN directory of a checkpoint")->required();
  cmd->add_flag("--all", f->all,
                "List the optimizer state's tensors too (by default: the parameters and buffers)");
  cmd->add_flag("--no-verify", f->no_verify, "List only; do not read the files");
  cmd->callback([f] {
    const pp::CheckpointManifest m = pp::read_checkpoint_manifest(f->dir);
    std::cout << "checkpoint " << f->dir << ": format " << m.format << ", step " << m.step
              << ", run " << (m.run_id.empty() ? std::string("(none)") : m.run_id)
              << "\nwritten on " << pp::describe_layout(m) << ", " << m.micro_batches
              << " micro-batches per replica";
    if (m.format >= 4) {
      std::cout << ", optimizer " << m.optimizer << ", seed "
                << (m.seed.empty() ? std::string("none") : m.seed);
    }
    std::cout << "\n";
    if (m.format < 4) {
      std::cout << "format " << m.format
                << " names its tensors by rank and stage: it resumes on the layout that wrote "
                   "it\n";
    } else {
      int64_t weights = 0, weight_elements = 0, state = 0;
      std::map<std::string, int64_t> fields;
      for (const pp::CheckpointTensor& t : m.tensors) {
        const std::string field = field_of(t.name);
        if (field.empty() && t.stage >= 0) {
          ++weights;
          weight_elements += t.numel();
        } else if (!field.empty()) {
          ++state;
          ++fields[field];
        }
        if (!field.empty() && !f->all) continue;
        std::printf("  %-56s %-5s %-16s stage %d, %zu piece%s\n", t.name.c_str(), t.dtype.c_str(),
                    shape_text(t.shape).c_str(), t.stage, t.pieces.size(),
                    t.pieces.size() == 1 ? "" : "s");
      }
      std::fflush(stdout);
      std::cout << weights << " parameters and buffers (" << format_count(double(weight_elements))
                << " elements), " << state << " tensors of optimizer state (";
      bool first = true;
      for (const auto& [field, n] : fields) {
        std::cout << (first ? "" : ", ") << field << " " << n;
        first = false;
      }
      std::cout << ")";
      for (const auto& [key, name] : m.ties)
        std::cout << "; tied '" << key << "' stored as " << name;
      std::cout << "\n";
    }
    if (f->no_verify) return;
    const std::vector<pp::CheckpointFileCheck> checks = pp::verify_checkpoint(f->dir);
    int64_t bytes = 0;
    std::vector<std::string> bad;
    for (const pp::CheckpointFileCheck& c : checks) {
      bytes += static_cast<int64_t>(c.bytes);
      std::cout << "  " << c.file << "  " << format_bytes(static_cast<int64_t>(c.bytes)) << "  "
                << (c.problem.empty() ? "ok" : c.problem) << "\n";
      if (!c.problem.empty()) bad.push_back(c.file + ": " + c.problem);
    }
    std::cout << std::flush;
    PIPEMAT_CHECK(bad.empty(), PipelineError, "checkpoint ", f->dir, ": ", bad.size(), " of ",
                  checks.size(),
                  " files are not the ones its manifest recorded: ", join(bad, "; "));
    std::cout << "verified " << checks.size() << " files, " << format_bytes(bytes)
              << ": every one is the file its manifest recorded\n";
  });
}

}  // namespace pipemat::launch
