// Ranks as threads (rank_threads.h): every rank runs, each one's result lands, and of their
// failures the root cause is rethrown.

#include "pipemat/comm/rank_threads.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "pipemat/core/error.h"

namespace pipemat::comm {
namespace {

TransportOptions quick() {
  TransportOptions options;
  options.timeout = std::chrono::seconds(30);
  return options;
}

// Receives one int from `peer` (CommError once the peer's transport is gone).
int recv_int(Transport& t, int peer) {
  int value = -1;
  t.recv(peer, 0, &value, sizeof(value))->wait();
  return value;
}

// The message of what run() throws; "" when it returns.
template <typename F>
std::string error_of(F run) {
  try {
    run();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(RankThreadsTest, EveryRankRunsOnItsTransport) {
  std::vector<int> results(4, -1);
  run_local_ranks(4, quick(), [&](Transport& t) {
    // A ring: each rank sends 10 x its rank to the next one and keeps what the previous sent.
    const int next = (t.rank() + 1) % t.world_size();
    const int prev = (t.rank() + t.world_size() - 1) % t.world_size();
    const int mine = 10 * t.rank();
    WorkPtr sent = t.send(next, 0, &mine, sizeof(mine));
    results[static_cast<size_t>(t.rank())] = recv_int(t, prev);
    sent->wait();
  });
  EXPECT_EQ(results, (std::vector<int>{30, 0, 10, 20}));
}

TEST(RankThreadsTest, RethrowsTheFailingRanksErrorNotItsPeersCommErrors) {
  // Rank 1 fails; ranks 0 and 2 wait on it and fail with a CommError when its transport closes.
  std::atomic<int> comm_errors{0};
  const std::string message = error_of([&] {
    run_local_ranks(3, quick(), [&](Transport& t) {
      if (t.rank() == 1) throw ConfigError("rank 1: bad input");
      try {
        recv_int(t, 1);
      } catch (const CommError&) {
        ++comm_errors;
        throw;
      }
    });
  });
  EXPECT_EQ(message, "rank 1: bad input");
  EXPECT_EQ(comm_errors.load(), 2);
}

TEST(RankThreadsTest, RootCauseIsTheLowestRanksNonCommErrorElseItsCommError) {
  const auto throw_at = [](std::vector<int> comm, std::vector<int> other) {
    return error_of([&] {
      run_rank_threads(4, [&](int r) {
        for (int c : comm)
          if (c == r) throw CommError("comm " + std::to_string(r));
        for (int o : other)
          if (o == r) throw PipelineError("other " + std::to_string(r));
      });
    });
  };
  EXPECT_EQ(throw_at({0, 1}, {3, 2}), "other 2");
  EXPECT_EQ(throw_at({3, 1}, {}), "comm 1");
  EXPECT_EQ(throw_at({}, {}), "");
}

// A rank that ends a collective step because its peer's part failed only repeats that failure:
// the peer's own error is the root cause, whichever rank is lower.
TEST(RankThreadsTest, APeerFailedErrorIsNoRootCause) {
  EXPECT_EQ(error_of([&] {
              run_rank_threads(3, [&](int r) {
                if (r == 0) throw PeerFailedError("load: rank 2 could not load its part");
                if (r == 1) throw CommError("rank 2 closed the connection");
                if (r == 2) throw PipelineError("rank-2.pt is damaged");
              });
            }),
            "rank-2.pt is damaged");
  EXPECT_EQ(error_of([&] {
              run_rank_threads(2, [&](int r) {
                if (r == 1) throw PeerFailedError("rank 0 failed");
              });
            }),
            "rank 0 failed");
}

TEST(RankThreadsTest, OnRankEndRunsAfterEachRank) {
  std::vector<int> ran(3, 0), ended(3, 0);
  EXPECT_EQ(error_of([&] {
              run_rank_threads(
                  3,
                  [&](int r) {
                    ran[static_cast<size_t>(r)] = 1;
                    if (r == 2) throw PipelineError("rank 2 failed");
                  },
                  [&](int r) { ended[static_cast<size_t>(r)] = ran[static_cast<size_t>(r)] + 1; });
            }),
            "rank 2 failed");
  EXPECT_EQ(ended, (std::vector<int>{2, 2, 2}));
}

TEST(RankThreadsTest, GivenTransportsStayOpenForTheNextRun) {
  auto transports = make_local_transports(2, quick());
  std::vector<int> got(2, -1);
  for (int round = 1; round <= 2; ++round) {
    run_rank_threads(transports, [&](Transport& t) {
      const int mine = round * 100 + t.rank();
      WorkPtr sent = t.send(1 - t.rank(), 0, &mine, sizeof(mine));
      got[static_cast<size_t>(t.rank())] = recv_int(t, 1 - t.rank());
      sent->wait();
    });
  }
  EXPECT_EQ(got, (std::vector<int>{201, 200}));
}

TEST(RankThreadsTest, ThreadStartErrorSaysWhichThreadAndWhatToDo) {
  const ThreadStartError e(3, 8, "Resource temporarily unavailable");
  EXPECT_EQ(std::string(e.what()),
            "transport local: could not start thread 3 of 8 (Resource temporarily unavailable); "
            "run fewer ranks in one process or use transport.kind mpi / tcp");
  EXPECT_EQ(e.thread, 3);
  EXPECT_EQ(e.count, 8);
  EXPECT_EQ(e.reason, "Resource temporarily unavailable");
}

}  // namespace
}  // namespace pipemat::comm
