#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "pipemat/bench/remat.h"

namespace pipemat::launch {
namespace {

// One object: the options, then per mode its numbers (BenchRematMode's fields), then the empty
// SAVE region's call cost.
std::string bench_remat_json(const bench::BenchRematOptions& o,
                             const bench::BenchRematReport& report) {
  nlohmann::ordered_json j;
  j["scenario"] = o.scenario;
  j["layers"] = o.layers;
  j["tokens"] = o.tokens;
  j["hidden"] = o.hidden;
  if (o.scenario == "moe") {
    j["experts"] = o.experts;
    j["top_k"] = o.top_k;
  }
  j["dtype"] = "float32";
  j["steps"] = o.steps;
  j["repeat"] = o.repeat;
  nlohmann::ordered_json modes;
  for (const bench::BenchRematMode& m : report.modes) {
    nlohmann::ordered_json row;
    row["resident_bytes"] = m.resident_bytes;
    row["replay_peak_bytes"] = m.replay_peak_bytes;
    row["peak_bytes"] = m.peak_bytes;
    row["step_ms"] = m.step_ms;
    row["host_overhead_us"] = m.host_overhead_us;
    row["loss"] = m.loss;
    row["grad_norm"] = m.grad_norm;
    row["save_body_calls"] = m.save_body_calls;
    row["recompute_body_calls"] = m.recompute_body_calls;
    modes[m.mode] = row;
  }
  j["modes"] = modes;
  j["empty_save_region_call_us"] = report.empty_save_region_call_us;
  return j.dump();
}

std::string bench_remat_table(const bench::BenchRematOptions& o,
                              const bench::BenchRematReport& report) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof(line),
                "bench remat: %s, %lld layers, %lld tokens, hidden %lld, float32\n",
                o.scenario.c_str(), static_cast<long long>(o.layers),
                static_cast<long long>(o.tokens), static_cast<long long>(o.hidden));
  out += line;
  std::snprintf(line, sizeof(line), "%-9s %14s %14s %14s %9s %10s %6s %6s %12s\n", "mode",
                "resident B", "replay peak B", "step peak B", "step ms", "host us", "save",
                "recomp", "loss");
  out += line;
  for (const bench::BenchRematMode& m : report.modes) {
    std::snprintf(line, sizeof(line), "%-9s %14lld %14lld %14lld %9.2f %10.1f %6lld %6lld %12.6f\n",
                  m.mode.c_str(), static_cast<long long>(m.resident_bytes),
                  static_cast<long long>(m.replay_peak_bytes), static_cast<long long>(m.peak_bytes),
                  m.step_ms, m.host_overhead_us, static_cast<long long>(m.save_body_calls),
                  static_cast<long long>(m.recompute_body_calls), m.loss);
    out += line;
  }
  std::snprintf(line, sizeof(line), "empty SAVE region call inside a unit: %.3f us host overhead\n",
                report.empty_save_region_call_us);
  out += line;
  return out;
}

}  // namespace

void add_bench_remat_command(CLI::App& bench) {
  struct Flags {
    bench::BenchRematOptions bench;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  bench::BenchRematOptions& o = f->bench;
  auto* cmd = bench.add_subcommand(
      "remat",
      "Memory and time of remat modes: none, full (checkpoint every layer), legacy (GEMM as a\n"
      "SAVE region, input kept), rederive (the default: the GEMM input is rederived by replay).\n"
      "Bytes are exact (tracking CPU allocator); times are medians over steps x repetitions.");
  cmd->add_option("--scenario", o.scenario,
                  "rmsnorm-gemm | moe | save-chain | gpt (the main job's decoder blocks, 4 heads, "
                  "sequences of 128)")
      ->capture_default_str();
  cmd->add_option("--layers", o.layers, "Layers (checkpoint units)")->capture_default_str();
  cmd->add_option("--tokens", o.tokens, "Tokens per step")->capture_default_str();
  cmd->add_option("--hidden", o.hidden, "Hidden size")->capture_default_str();
  cmd->add_option("--experts", o.experts, "Experts (moe)")->capture_default_str();
  cmd->add_option("--top-k", o.top_k, "Experts per token (moe)")->capture_default_str();
  cmd->add_option("--steps", o.steps, "Steps per mode and repetition")->capture_default_str();
  cmd->add_option("--repeat", o.repeat, "Repetitions (modes interleave)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of weights and data")->capture_default_str();
  cmd->add_flag("--json", f->json, "Print one JSON object instead of a table");
  cmd->callback([f] {
    const bench::BenchRematOptions& options = f->bench;
    const auto progress = [&](int64_t repetition, const std::string& mode) {
      std::fprintf(stderr, "bench remat: repetition %lld/%lld, mode %s done\n",
                   static_cast<long long>(repetition), static_cast<long long>(options.repeat),
                   mode.c_str());
    };
    const bench::BenchRematReport report =
        f->json ? bench::run_bench_remat(options) : bench::run_bench_remat(options, progress);
    std::cout << (f->json ? bench_remat_json(options, report) + "\n"
                          : bench_remat_table(options, report));
  });
}

}  // namespace pipemat::launch
