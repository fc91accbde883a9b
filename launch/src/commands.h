#pragma once
// Each subcommand of the `pipemat` binary lives in its own cmd_<name>.cpp and registers itself
// here. A command parses flags into its module's options struct and calls the library; it holds
// no logic of its own.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace pipemat::train {
struct PlanOptions;
}

namespace pipemat::launch {

void add_checkpoint_command(CLI::App& app);  // cmd_checkpoint.cpp
void add_config_command(CLI::App& app);      // cmd_config.cpp
void add_demo_command(CLI::App& app);        // cmd_demo.cpp
void add_export_command(CLI::App& app);      // cmd_export.cpp
void add_prepare_command(CLI::App& app);     // cmd_prepare.cpp
void add_generate_command(CLI::App& app);    // cmd_generate.cpp
void add_schedule_command(CLI::App& app);    // cmd_schedule.cpp
void add_project_command(CLI::App& app);     // cmd_project.cpp
void add_plan_command(CLI::App& app);        // cmd_plan.cpp
void add_train_command(CLI::App& app);       // cmd_train.cpp

// `pipemat bench <what>`: benchmarks that print measured numbers.
void add_bench_remat_command(CLI::App& bench);     // cmd_bench_remat.cpp
void add_bench_p2p_command(CLI::App& bench);       // cmd_bench_p2p.cpp
void add_bench_soak_command(CLI::App& bench);      // cmd_bench_soak.cpp
void add_bench_pipeline_command(CLI::App& bench);  // cmd_bench_pipeline.cpp
void add_bench_plan_command(CLI::App& bench);      // cmd_bench_plan.cpp

// Prints what parse_config noticed (TrainConfig::warnings, e.g. a deprecated key) to stderr, one
// "pipemat: warning: ..." line each; under a launcher only rank 0 prints (config_warnings.cpp).
void print_config_warnings(const std::vector<std::string>& warnings);
// Comma-separated sizes ("24MiB,28MiB") of `flag`; ConfigError naming the flag and `expected`
// when the list is empty or an item is no size (cmd_plan.cpp).
std::vector<int64_t> parse_byte_list(const std::string& text, const std::string& flag,
                                     const std::string& expected);
// The profiler and step-model flags of `pipemat plan` and `pipemat bench plan` (--repeats,
// --profile-warmup, --max-save-leaves, --cores) into `plan` (cmd_plan.cpp).
void add_plan_profile_flags(CLI::App& cmd, train::PlanOptions& plan);

}  // namespace pipemat::launch
