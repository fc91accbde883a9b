// `pipemat bench p2p` as a library: the local run end to end (the report) and the output formats.

#include <gtest/gtest.h>

#include "pipemat/comm/bench.h"

namespace pipemat::comm {
namespace {

TEST(commP2PBench, LocalRunReportsEverySizeInTheDocumentedJson) {
  P2PBenchOptions options;
  options.transport.kind = TransportKind::kLocal;
  options.sizes = {4096, 65536};
  options.iters = 5;
  const P2PBenchReport report = run_p2p_command(options, {});
  EXPECT_TRUE(report.report);
  EXPECT_EQ(report.transport, "local");
  ASSERT_EQ(report.results.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(report.results[i].bytes, options.sizes[i]);
    EXPECT_EQ(report.results[i].iters, 5);
    EXPECT_GT(report.results[i].latency_us, 0);  // a measured time
  }
  const std::string json = format_p2p_json(report.transport, report.results);
  EXPECT_EQ(json.rfind("{\"transport\":\"local\",\"results\":[{\"bytes\":4096,\"latency_us\":", 0),
            0u)
      << json;
  for (const char* key : {"\"gbps\":", "\"raw_gbps\":", "\"bytes\":65536", "\"iters\":5}"}) {
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
