#pragma once
// `pipemat bench p2p`: ping-pong latency and bandwidth of the pipemat tensor path against a raw
// baseline on the same medium (pipemat/comm/raw_bench.h), measured in the same run.
// Target pipemat_comm_tensor.

#include <cstdint>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"

namespace pipemat::comm {

struct P2PBenchOptions {
  TransportOptions transport;  // kind mpi|tcp|local; tcp rank/world/master or env
  std::vector<int64_t> sizes = {int64_t{4} << 10, int64_t{64} << 10, int64_t{1} << 20,
                                int64_t{16} << 20};
  int iters = 0;  // timed round trips per size; 0: 256 MiB / size, clamped to [10, 1000]
  int warmup = 3;
  // tcp without a rank (no --rank, no PIPEMAT_RANK): start two local processes of this
  // program with the same arguments (spawn_local_ranks) instead of failing.
  bool spawn = true;
};

struct P2PResult {
  int64_t bytes = 0;
  int iters = 0;
  double latency_us = 0;      // one-way time: round trip / 2, pipemat tensor path
  double gbps = 0;            // 8 * bytes / one-way time / 1e9 (Gbit/s)
  double raw_latency_us = 0;  // same for the raw baseline
  double raw_gbps = 0;
};

// Iterations used for one size (the rule above when options.iters == 0).
int p2p_iterations(const P2PBenchOptions& options, int64_t bytes);

// Runs the bench between ranks 0 and 1 of `transport` (every rank calls it; ranks above 1 only
// take part in barriers). Returns the results on rank 0, an empty vector elsewhere.
std::vector<P2PResult> run_p2p_bench(Transport& transport, const P2PBenchOptions& options);

// One line: {"transport":"tcp","results":[{"bytes":4096,"latency_us":...,"gbps":...,
//   "raw_gbps":...,"raw_latency_us":...,"iters":...},...]}; times rounded to 3 decimals, rates
//   to 4.
std::string format_p2p_json(const std::string& transport, const std::vector<P2PResult>& results);
// A readable table with the pipemat/raw bandwidth ratio per size.
std::string format_p2p_table(const std::string& transport, const std::vector<P2PResult>& results);

// What one process of the command measured. `report` is true where the results are: the local
// run, and rank 0 of an mpi or tcp run; false on rank 1 and in a process that spawned the two
// tcp ranks (each of them reports for itself).
struct P2PBenchReport {
  std::string transport;  // "local", "mpi" or "tcp"
  std::vector<P2PResult> results;
  bool report = false;
};

// The whole measurement behind `pipemat bench p2p` (the command prints the report): local runs
// two threads; mpi uses this process under mpirun (exactly 2 ranks); tcp uses the given / env
// rank, or spawns two processes of `self_argv` (the program's own argv) when none is given.
// Throws ConfigError (wrong world size) or CommError (a failed run or spawned rank).
P2PBenchReport run_p2p_command(const P2PBenchOptions& options,
                               const std::vector<std::string>& self_argv);

}  // namespace pipemat::comm
