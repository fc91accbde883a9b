#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/bench/soak.h"
#include "pipemat/core/format.h"
#include "pipemat/pp/compute.h"
#include "pipemat/train/config.h"

namespace pipemat::launch {

void add_bench_soak_command(CLI::App& bench) {
  struct Flags {
    bench::BenchSoakOptions soak;
    std::string config;
    std::vector<std::string> overrides;
    int threads = 1;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  auto* cmd = bench.add_subcommand(
      "soak",
      "Does memory stay flat over a long run? Trains the zoo pipeline in this process (ranks as\n"
      "threads; the config's model and schedule) and then runs a remat unit loop (rmsnorm-gemm,\n"
      "rederive), each for --steps steps. After --warmup steps and then every --every steps it\n"
      "prints the tracking allocator's live bytes (exact) and the resident set size; the summary\n"
      "gives the allocator drift (0 is flat) and the RSS growth. Example:\n"
      "  pipemat bench soak --steps 1000000 --every 50000");
  cmd->add_option("--loops", f->soak.loops, "pipeline | remat | both")->capture_default_str();
  cmd->add_option("--steps", f->soak.steps, "Steps per loop")->capture_default_str();
  cmd->add_option("--every", f->soak.every, "Steps between samples")->capture_default_str();
  cmd->add_option("--warmup", f->soak.warmup, "Steps before the first sample")
      ->capture_default_str();
  cmd->add_option("--config", f->config,
                  "YAML config of the pipeline loop (default: the built-in defaults of "
                  "docs/config.md on 2 ranks: 1F1B, 4 micro-batches, pre-triggered recompute)");
  cmd->add_option("--set", f->overrides, "Override a config key: --set model.layers=4")->take_all();
  cmd->add_option("--layers", f->soak.layers, "Remat loop: layers")->capture_default_str();
  cmd->add_option("--tokens", f->soak.tokens, "Remat loop: tokens per step")->capture_default_str();
  cmd->add_option("--hidden", f->soak.hidden, "Remat loop: hidden size")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Compute threads (LibTorch and OpenBLAS)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_flag("--json", f->json, "Print one JSON object at the end instead of lines");
  cmd->callback([f] {
    const train::TrainConfig config =
        f->config.empty() ? train::parse_config(bench::kSoakPipeline, "bench soak", f->overrides)
                          : train::load_config(f->config, f->overrides);
    print_config_warnings(config.warnings);
    pp::set_compute_threads(f->threads);
    const auto print = [&](const bench::SoakSample& s) {
      if (f->json) return;
      std::cout << std::left << std::setw(9) << s.loop << std::right << " steps " << std::setw(9)
                << s.steps << "  allocator " << std::setw(11) << s.allocator_bytes << " B  rss "
                << format_bytes(s.rss_bytes) << std::endl;
    };
    const auto samples = bench::run_bench_soak(config, f->soak, print);
    const auto summaries = bench::summarize_soak(samples);
    if (f->json) {
      nlohmann::json out;
      out["steps"] = f->soak.steps;
      out["every"] = f->soak.every;
      out["warmup"] = f->soak.warmup;
      for (const auto& s : samples) {
        out["samples"].push_back({{"loop", s.loop},
                                  {"steps", s.steps},
                                  {"allocator_bytes", s.allocator_bytes},
                                  {"rss_bytes", s.rss_bytes}});
      }
      for (const auto& s : summaries) {
        out["summary"].push_back({{"loop", s.loop},
                                  {"samples", s.samples},
                                  {"allocator_bytes", s.allocator_bytes},
                                  {"allocator_drift_bytes", s.allocator_drift_bytes},
                                  {"rss_first_bytes", s.rss_first_bytes},
                                  {"rss_last_bytes", s.rss_last_bytes},
                                  {"rss_max_bytes", s.rss_max_bytes}});
      }
      std::cout << out.dump(2) << "\n";
      return;
    }
    for (const auto& s : summaries) {
      std::cout << s.loop << ": " << s.samples << " samples after " << f->soak.warmup
                << " warm-up steps; allocator " << s.allocator_bytes << " B, drift "
                << s.allocator_drift_bytes << " B; rss " << format_bytes(s.rss_first_bytes)
                << " -> " << format_bytes(s.rss_last_bytes) << " (max "
                << format_bytes(s.rss_max_bytes) << ")\n";
    }
  });
}

}  // namespace pipemat::launch
