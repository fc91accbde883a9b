// `pipemat bench p2p`: flags -> P2PBenchOptions -> comm::run_p2p_command (pipemat/comm/bench.h),
// and the report printed as a table or JSON.

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "pipemat/comm/bench.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::launch {
namespace {

struct P2PFlags {
  std::string transport = "local";
  std::string sizes = "4KiB,64KiB,1MiB,16MiB";
  int iters = 0;
  int warmup = 3;
  bool json = false;
  int rank = -1;
  int world_size = -1;
  std::string master;
  double timeout_s = 0;  // 0: PIPEMAT_COMM_TIMEOUT or the transport default
  bool no_spawn = false;
};

}  // namespace

void add_bench_p2p_command(CLI::App& bench) {
  auto flags = std::make_shared<P2PFlags>();
  auto* cmd = bench.add_subcommand(
      "p2p",
      "point-to-point ping-pong of the comm transport vs a raw baseline on the same medium "
      "(mpi: run under `mpirun -np 2`; tcp: starts its second process unless --rank is given)");
  cmd->add_option("--transport", flags->transport, "mpi | tcp | local")
      ->check(CLI::IsMember({"mpi", "tcp", "local"}))
      ->capture_default_str();
  cmd->add_option("--sizes", flags->sizes, "comma-separated message sizes (4KiB, 1MiB, ...)")
      ->capture_default_str();
  cmd->add_option("--iters", flags->iters,
                  "timed round trips per size (default: 256 MiB / size, in [10, 1000])")
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", flags->warmup, "untimed round trips per size")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  cmd->add_flag("--json", flags->json, "print one JSON object on rank 0");
  cmd->add_option("--rank", flags->rank, "tcp: this rank (default PIPEMAT_RANK)");
  cmd->add_option("--world-size", flags->world_size,
                  "tcp: number of ranks (default PIPEMAT_WORLD_SIZE)");
  cmd->add_option("--master", flags->master, "tcp: rank 0's host:port (default PIPEMAT_MASTER)");
  cmd->add_option("--timeout", flags->timeout_s,
                  "comm timeout in seconds (default: PIPEMAT_COMM_TIMEOUT, else 300)");
  cmd->add_flag("--no-spawn", flags->no_spawn,
                "tcp: fail instead of starting the second process when no rank is given");
  cmd->callback([flags, cmd] {
    comm::P2PBenchOptions options;
    options.transport.kind = comm::parse_transport_kind(flags->transport);
    options.transport.timeout =
        std::chrono::milliseconds(static_cast<long long>(flags->timeout_s * 1000));
    options.transport.rank = flags->rank;
    options.transport.world_size = flags->world_size;
    options.transport.master = flags->master;
    options.sizes.clear();
    for (const auto& item : split(flags->sizes, ',')) {
      if (!item.empty()) options.sizes.push_back(parse_bytes(item, "--sizes"));
    }
    options.iters = flags->iters;
    options.warmup = flags->warmup;
    options.spawn = !flags->no_spawn;
    // The spawned ranks rerun this very command line.
    std::vector<std::string> argv = {"/proc/self/exe",
                                     "bench",
                                     "p2p",
                                     "--transport",
                                     flags->transport,
                                     "--sizes",
                                     flags->sizes,
                                     "--warmup",
                                     std::to_string(flags->warmup),
                                     "--timeout",
                                     std::to_string(flags->timeout_s)};
    if (flags->iters > 0) argv.insert(argv.end(), {"--iters", std::to_string(flags->iters)});
    if (flags->json) argv.push_back("--json");
    const comm::P2PBenchReport report = comm::run_p2p_command(options, argv);
    if (report.report) {
      std::cout << (flags->json ? comm::format_p2p_json(report.transport, report.results)
                                : comm::format_p2p_table(report.transport, report.results))
                << std::endl;
    }
  });
}

}  // namespace pipemat::launch
