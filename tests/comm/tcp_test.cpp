// TCP-specific behaviour: rendezvous failures and option resolution.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"
#include "test_util.h"

namespace pipemat::comm {
namespace {

TEST(commTcpRendezvous, ClosedMasterPortFailsClearlyAfterRetries) {
  const int port = testing::free_port();  // nobody listens there
  TransportOptions options;
  options.kind = TransportKind::kTcp;
  options.rank = 1;
  options.world_size = 2;
  options.master = "127.0.0.1:" + std::to_string(port);
  options.connect_retries = 4;
  options.connect_retry_interval = std::chrono::milliseconds(50);
  options.timeout = std::chrono::seconds(20);
  const auto start = Clock::now();
  try {
    make_transport(options);
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("rank 1 could not connect to the master (rank 0) at 127.0.0.1:" +
                        std::to_string(port) + " after 4 attempts"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("Connection refused"), std::string::npos) << what;
    EXPECT_NE(what.find("PIPEMAT_MASTER"), std::string::npos) << what;
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
}

TEST(commTcpRendezvous, MissingRanksTimeOutNamingThem) {
  TransportOptions options;
  options.kind = TransportKind::kTcp;
  options.rank = 0;
  options.world_size = 3;
  options.master = "127.0.0.1:" + std::to_string(testing::free_port());
  options.timeout = std::chrono::milliseconds(300);
  try {
    make_transport(options);
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("waiting for ranks 1, 2 to connect"), std::string::npos) << what;
  }
}

TEST(commTcpRendezvous, WorldSizeDisagreementIsReported) {
  const std::string master = "127.0.0.1:" + std::to_string(testing::free_port());
  std::string rank0_error, rank1_error;
  testing::run_threads(2, [&](int rank) {
    TransportOptions options;
    options.kind = TransportKind::kTcp;
    options.rank = rank;
    options.world_size = rank == 0 ? 2 : 3;
    options.master = master;
    options.timeout = std::chrono::seconds(3);
    options.connect_retry_interval = std::chrono::milliseconds(20);
    try {
      make_transport(options);
    } catch (const Error& e) {
      (rank == 0 ? rank0_error : rank1_error) = e.what();
    }
  });
  EXPECT_NE(rank0_error.find("rank 1 was started with world size 3 but rank 0 with world size 2"),
            std::string::npos)
      << rank0_error;
  EXPECT_FALSE(rank1_error.empty());
}

TEST(commTransportOptions, ResolvesTcpSettingsFromTheEnvironment) {
  ::setenv("PIPEMAT_RANK", "1", 1);
  ::setenv("PIPEMAT_WORLD_SIZE", "4", 1);
  ::setenv("PIPEMAT_MASTER", "10.0.0.1:29500", 1);
  ::setenv("PIPEMAT_COMM_TIMEOUT", "2.5", 1);
  TransportOptions options;
  options.kind = TransportKind::kTcp;
  TransportOptions resolved = resolve_options(options);
  EXPECT_EQ(resolved.rank, 1);
  EXPECT_EQ(resolved.world_size, 4);
  EXPECT_EQ(resolved.master, "10.0.0.1:29500");
  EXPECT_EQ(resolved.timeout, std::chrono::milliseconds(2500));
  ::setenv("PIPEMAT_RANK", "x", 1);
  EXPECT_THROW(resolve_options(options), ConfigError);
  ::setenv("PIPEMAT_RANK", "4", 1);
  EXPECT_THROW(resolve_options(options), ConfigError);  // outside the world
  for (const char* name :
       {"PIPEMAT_RANK", "PIPEMAT_WORLD_SIZE", "PIPEMAT_MASTER", "PIPEMAT_COMM_TIMEOUT"}) {
    ::unsetenv(name);
  }
  EXPECT_THROW(resolve_options(options), ConfigError);  // rank missing
  EXPECT_EQ(resolve_options(TransportOptions{}).timeout, kDefaultTimeout);
  EXPECT_THROW(parse_transport_kind("nccl"), ConfigError);
  EXPECT_THROW(make_transport(TransportOptions{}), ConfigError);  // auto: no mpirun, no master
}

TEST(commTransportOptions, RejectsMalformedMasterAddress) {
  TransportOptions options;
  options.kind = TransportKind::kTcp;
  options.rank = 0;
  options.world_size = 2;
  options.master = "localhost";
  EXPECT_THROW(make_transport(options), ConfigError);
  options.master = "localhost:99999";
  EXPECT_THROW(make_transport(options), ConfigError);
}

}  // namespace
}  // namespace pipemat::comm
