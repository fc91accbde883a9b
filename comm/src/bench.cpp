#include "pipemat/comm/bench.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "pipemat/comm/launcher.h"
#include "pipemat/comm/rank_threads.h"
#include "pipemat/comm/raw_bench.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::comm {
namespace {

constexpr int kBenchTag = 7;

// Mean round trip (seconds) of the pipemat tensor path: preallocated receive posted before the
// send, as the stage runtime does.
double pipemat_pingpong_seconds(Transport& t, int peer, int64_t bytes, int iterations, int warmup) {
  at::Tensor out = at::ones({bytes}, at::kByte);
  at::Tensor in = at::empty({bytes}, at::kByte);
  const bool lower = t.rank() < peer;
  t.barrier();
  Clock::time_point start;
  for (int i = 0; i < warmup + iterations; ++i) {
    if (i == warmup) start = Clock::now();
    if (lower) {
      TensorWork r = recv_tensor_into(t, peer, kBenchTag, in);
      send_tensor(t, peer, kBenchTag, out).wait();
      r.wait();
    } else {
      recv_tensor_into(t, peer, kBenchTag, in).wait();
      send_tensor(t, peer, kBenchTag, in).wait();
    }
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  t.barrier();
  return seconds / iterations;
}

}  // namespace

int p2p_iterations(const P2PBenchOptions& options, int64_t bytes) {
  if (options.iters > 0) return options.iters;
  int64_t n = (int64_t{256} << 20) / std::max<int64_t>(bytes, 1);
  return static_cast<int>(std::clamp<int64_t>(n, 10, 1000));
}

std::vector<P2PResult> run_p2p_bench(Transport& transport, const P2PBenchOptions& options) {
  PIPEMAT_CHECK(transport.world_size() >= 2, ConfigError,
                "bench p2p needs 2 ranks, the transport has ", transport.world_size(),
                "; run it as `mpirun -np 2 pipemat bench p2p --transport mpi`, or with "
                "--transport tcp (which starts its second process itself) or --transport local");
  std::vector<P2PResult> results;
  const int me = transport.rank();
  const int peer = me == 0 ? 1 : 0;
  for (int64_t bytes : options.sizes) {
    PIPEMAT_CHECK(bytes > 0, ConfigError, "bench p2p: sizes must be positive, got ", bytes);
    const int iters = p2p_iterations(options, bytes);
    double raw = 0, ours = 0;
    if (me <= 1) {
      raw =
          raw_pingpong_seconds(transport, peer, static_cast<size_t>(bytes), iters, options.warmup);
      ours = pipemat_pingpong_seconds(transport, peer, bytes, iters, options.warmup);
    }
    transport.barrier();
    if (me == 0) {
      P2PResult r;
      r.bytes = bytes;
      r.iters = iters;
      r.latency_us = ours / 2 * 1e6;
      r.raw_latency_us = raw / 2 * 1e6;
      r.gbps = 8.0 * static_cast<double>(bytes) / (ours / 2) / 1e9;
      r.raw_gbps = 8.0 * static_cast<double>(bytes) / (raw / 2) / 1e9;
      results.push_back(r);
    }
  }
  return results;
}

std::string format_p2p_json(const std::string& transport, const std::vector<P2PResult>& results) {
  // Times to the ns, rates to 0.1 Mbit/s: what a measurement of this kind can tell apart.
  const auto rounded = [](double v, double scale) { return std::round(v * scale) / scale; };
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const auto& r : results) {
    rows.push_back({{"bytes", r.bytes},
                    {"latency_us", rounded(r.latency_us, 1e3)},
                    {"gbps", rounded(r.gbps, 1e4)},
                    {"raw_gbps", rounded(r.raw_gbps, 1e4)},
                    {"raw_latency_us", rounded(r.raw_latency_us, 1e3)},
                    {"iters", r.iters}});
  }
  const nlohmann::ordered_json doc = {{"transport", transport}, {"results", rows}};
  return doc.dump();
}

std::string format_p2p_table(const std::string& transport, const std::vector<P2PResult>& results) {
  std::string out = "pipemat bench p2p (" + transport +
                    "): ping-pong between ranks 0 and 1, one-way time = round trip / 2\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%12s %8s %14s %12s %14s %12s %8s\n", "size", "iters",
                "latency_us", "gbps", "raw_latency_us", "raw_gbps", "ratio");
  out += line;
  for (const auto& r : results) {
    std::snprintf(line, sizeof(line), "%12s %8d %14.2f %12.3f %14.2f %12.3f %8.2f\n",
                  format_bytes(r.bytes).c_str(), r.iters, r.latency_us, r.gbps, r.raw_latency_us,
                  r.raw_gbps, r.raw_gbps > 0 ? r.gbps / r.raw_gbps : 0.0);
    out += line;
  }
  out += "gbps = Gbit/s; ratio = gbps / raw_gbps (raw: " +
         std::string(transport == "mpi"   ? "MPI_Send/MPI_Recv"
                     : transport == "tcp" ? "a plain blocking socket"
                                          : "memcpy between the two threads") +
         ")\n";
  return out;
}

P2PBenchReport run_p2p_command(const P2PBenchOptions& options,
                               const std::vector<std::string>& self_argv) {
  P2PBenchReport out;
  TransportOptions topts = options.transport;
  if (topts.kind == TransportKind::kLocal) {
    run_local_ranks(2, topts, [&](Transport& t) {
      std::vector<P2PResult> results = run_p2p_bench(t, options);
      if (t.rank() == 0) out.results = std::move(results);
    });
    out.transport = "local";
    out.report = true;
    return out;
  }
  if (topts.kind == TransportKind::kTcp && topts.rank < 0 && options.spawn &&
      std::getenv("PIPEMAT_RANK") == nullptr) {
    SpawnOptions spawn;
    spawn.world_size = 2;
    spawn.argv = self_argv;
    if (!spawn.argv.empty()) spawn.argv[0] = "/proc/self/exe";
    spawn.timeout = std::max(topts.timeout, std::chrono::milliseconds(std::chrono::minutes(10)));
    SpawnResult result = spawn_local_ranks(spawn);
    PIPEMAT_CHECK(result.ok(), CommError, "bench p2p: the spawned tcp ranks failed (",
                  result.describe(), "); see their messages above");
    out.transport = "tcp";
    return out;
  }
  auto transport = make_transport(topts);
  PIPEMAT_CHECK(transport->world_size() == 2, ConfigError, "bench p2p needs exactly 2 ranks, got ",
                transport->world_size(), " (", to_string(transport->kind()),
                "); run `mpirun -np 2 pipemat bench p2p "
                "--transport mpi`, or `pipemat bench p2p --transport tcp` which starts both ranks");
  out.transport = to_string(transport->kind());
  out.results = run_p2p_bench(*transport, options);
  out.report = transport->rank() == 0;
  return out;
}

}  // namespace pipemat::comm
