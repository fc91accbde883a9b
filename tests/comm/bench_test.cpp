// `pipemat bench p2p` as a library: the local run end to end and the output formats.

#include <gtest/gtest.h>

#include <sstream>

#include "pipemat/comm/bench.h"

namespace pipemat::comm {
namespace {

TEST(commP2PBench, LocalRunPrintsTheDocumentedJson) {
  P2PBenchOptions options;
  options.transport.kind = TransportKind::kLocal;
  options.sizes = {4096, 65536};
  options.iters = 5;
  options.json = true;
  std::ostringstream out;
  EXPECT_EQ(bench_p2p_main(options, {}, out), 0);
  const std::string json = out.str();
  EXPECT_EQ(
      json.rfind("{\"transport\": \"local\", \"results\": [{\"bytes\": 4096, \"latency_us\": ", 0),
      0u)
      << json;
  for (const char* key : {"\"gbps\": ", "\"raw_gbps\": ", "\"bytes\": 65536"}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " in " << json;
  }
}

TEST(commP2PBench, TableShowsTheRatio) {
  P2PResult r;
  r.bytes = 1 << 20;
  r.iters = 10;
  r.latency_us = 100;
  r.gbps = 40;
  r.raw_latency_us = 80;
  r.raw_gbps = 50;
  std::string table = format_p2p_table("tcp", {r});
  EXPECT_NE(table.find("1.00 MiB"), std::string::npos) << table;
  EXPECT_NE(table.find("0.80"), std::string::npos) << table;
}

TEST(commP2PBench, IterationRule) {
  P2PBenchOptions options;
  EXPECT_EQ(p2p_iterations(options, 4096), 1000);
  EXPECT_EQ(p2p_iterations(options, 1 << 20), 256);
  EXPECT_EQ(p2p_iterations(options, 1 << 30), 10);
  options.iters = 7;
  EXPECT_EQ(p2p_iterations(options, 4096), 7);
}

}  // namespace
}  // namespace pipemat::comm
