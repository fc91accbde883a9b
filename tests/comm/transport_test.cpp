// The byte transport contract, parameterized over transport x world size (ranks are threads).

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>

#include "pipemat/core/error.h"
#include "test_util.h"

namespace pipemat::comm {
namespace {

// Only the transport that owns a Work completes it: a user holding a WorkPtr cannot finish it or
// set what it received (Note [Work contract]).
template <typename W>
constexpr bool can_finish = requires(W& w, Status s) {
  w.finish(s);
};
template <typename W>
constexpr bool can_set_received = requires(W& w) {
  w.set_received(size_t{0});
};
static_assert(!can_finish<Work> && !can_set_received<Work>);

using testing::Group;
using testing::make_group;
using testing::run_ranks;

using Param = testing::TransportParam;
using testing::param_name;

class TransportTest : public ::testing::TestWithParam<Param> {
 protected:
  Group make(TransportOptions options = {}) {
    if (options.timeout.count() == 0) options.timeout = std::chrono::seconds(30);
    return make_group(GetParam().kind, GetParam().world_size, options);
  }
};

struct Stamp {
  int32_t from, to, tag, seq;
};

TEST_P(TransportTest, DeliversInOrderPerPeerAndTag) {
  Group group = make();
  constexpr int kMessages = 24;
  run_ranks(group, [&](Transport& t) {
    const int world = t.world_size();
    std::vector<Stamp> in(static_cast<size_t>(world * 2 * kMessages));
    std::vector<Stamp> out(in.size());
    std::vector<WorkPtr> works;
    auto slot = [&](int peer, int tag, int seq) {
      return static_cast<size_t>((peer * 2 + tag) * kMessages + seq);
    };
    // Half of the receives are posted before any send, half after (unexpected-message path).
    for (int seq = 0; seq < kMessages / 2; ++seq) {
      for (int peer = 0; peer < world; ++peer) {
        if (peer == t.rank()) continue;
        for (int tag : {1, 0}) {
          works.push_back(t.recv(peer, tag, &in[slot(peer, tag, seq)], sizeof(Stamp)));
        }
      }
    }
    for (int seq = 0; seq < kMessages; ++seq) {
      for (int tag : {0, 1}) {
        for (int peer = 0; peer < world; ++peer) {
          if (peer == t.rank()) continue;
          Stamp& s = out[slot(peer, tag, seq)];
          s = Stamp{t.rank(), peer, tag, seq};
          works.push_back(t.send(peer, tag, &s, sizeof(Stamp)));
        }
      }
    }
    for (int seq = kMessages / 2; seq < kMessages; ++seq) {
      for (int peer = world - 1; peer >= 0; --peer) {
        if (peer == t.rank()) continue;
        for (int tag : {0, 1}) {
          works.push_back(t.recv(peer, tag, &in[slot(peer, tag, seq)], sizeof(Stamp)));
        }
      }
    }
    for (auto& w : works) w->wait();
    for (int peer = 0; peer < world; ++peer) {
      if (peer == t.rank()) continue;
      for (int tag : {0, 1}) {
        for (int seq = 0; seq < kMessages; ++seq) {
          const Stamp& s = in[slot(peer, tag, seq)];
          EXPECT_EQ(s.from, peer);
          EXPECT_EQ(s.to, t.rank());
          EXPECT_EQ(s.tag, tag);
          EXPECT_EQ(s.seq, seq) << "rank " << t.rank() << " from " << peer << " tag " << tag;
        }
      }
    }
  });
}

TEST_P(TransportTest, ManyOutstandingMessagesOfMixedSizes) {
  Group group = make();
  const std::vector<size_t> sizes = {0, 1, 7, 4096, 65536, 65537, 300000};
  constexpr int kRounds = 40;
  run_ranks(group, [&](Transport& t) {
    const int next = (t.rank() + 1) % t.world_size();
    const int prev = (t.rank() + t.world_size() - 1) % t.world_size();
    std::vector<std::vector<uint8_t>> in(kRounds), out(kRounds);
    std::vector<WorkPtr> recvs, sends;
    for (int i = 0; i < kRounds; ++i) {
      size_t size = sizes[static_cast<size_t>(i) % sizes.size()];
      in[static_cast<size_t>(i)].assign(size, 0);
      recvs.push_back(t.recv(prev, 5, in[static_cast<size_t>(i)].data(), size));
    }
    for (int i = 0; i < kRounds; ++i) {
      size_t size = sizes[static_cast<size_t>(i) % sizes.size()];
      auto& buf = out[static_cast<size_t>(i)];
      buf.resize(size);
      for (size_t k = 0; k < size; ++k) buf[k] = static_cast<uint8_t>(k * 31 + i + t.rank());
      sends.push_back(t.send(next, 5, buf.data(), size));
    }
    for (auto& w : sends) w->wait();
    for (int i = 0; i < kRounds; ++i) {
      recvs[static_cast<size_t>(i)]->wait();
      const auto& buf = in[static_cast<size_t>(i)];
      EXPECT_EQ(recvs[static_cast<size_t>(i)]->received_bytes(), buf.size());
      for (size_t k = 0; k < buf.size(); ++k) {
        if (buf[k] != static_cast<uint8_t>(k * 31 + i + prev)) {
          ADD_FAILURE() << "rank " << t.rank() << " message " << i << " byte " << k;
          break;
        }
      }
    }
  });
}

TEST_P(TransportTest, GatherScatterAndAnySize) {
  Group group = make();
  run_ranks(group, [&](Transport& t) {
    if (t.rank() > 1) return;
    const int peer = 1 - t.rank();
    if (t.rank() == 0) {
      std::string a = "pipe", b = "mat", c = "-comm";
      t.send(peer, 3,
             {ConstSpan{a.data(), a.size()}, ConstSpan{b.data(), b.size()},
              ConstSpan{c.data(), c.size()}})
          ->wait();
      t.send(peer, 4, a.data(), a.size())->wait();
    } else {
      char x[5] = {}, y[7] = {};
      auto w = t.recv(peer, 3, {MutableSpan{x, 5}, MutableSpan{y, 7}});
      w->wait();
      EXPECT_EQ(std::string(x, 5) + std::string(y, 7), "pipemat-comm");
      auto any = t.recv_any(peer, 4);
      any->wait();
      Buffer buffer = any->buffer();
      ASSERT_EQ(buffer.size(), 4u);
      EXPECT_EQ(std::string(reinterpret_cast<char*>(buffer.data()), 4), "pipe");
      EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % Buffer::kAlignment, 0u);
    }
  });
}

TEST_P(TransportTest, SizeMismatchNamesBothSizesAndRanks) {
  Group group = make();
  run_ranks(group, [&](Transport& t) {
    if (t.rank() == 1) {
      uint64_t value = 42;
      t.send(0, 6, &value, sizeof(value))->wait();
    } else if (t.rank() == 0) {
      uint32_t small = 0;
      auto w = t.recv(1, 6, &small, sizeof(small));
      try {
        w->wait();
        ADD_FAILURE() << "expected a size mismatch";
      } catch (const CommError& e) {
        std::string what = e.what();
        EXPECT_NE(what.find("rank 1 sent 8 bytes"), std::string::npos) << what;
        EXPECT_NE(what.find("rank 0 posted a recv of 4 bytes"), std::string::npos) << what;
        EXPECT_NE(what.find("tag 6"), std::string::npos) << what;
      }
      EXPECT_EQ(w->status().code, StatusCode::kSizeMismatch);
      EXPECT_EQ(w->buffer().size(), 8u);
    }
  });
}

TEST_P(TransportTest, SilentPeerTimesOutWithContextAndTransportStaysUsable) {
  Group group = make();
  run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      int value = 0;
      auto w = t.recv(1, 9, &value, sizeof(value));
      const auto start = Clock::now();
      try {
        w->wait(std::chrono::milliseconds(300));
        ADD_FAILURE() << "expected a timeout";
      } catch (const TimeoutError& e) {
        std::string what = e.what();
        EXPECT_NE(what.find("timed out after 300 ms"), std::string::npos) << what;
        EXPECT_NE(what.find("from rank 1 with tag 9 on rank 0"), std::string::npos) << what;
      }
      EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
      EXPECT_TRUE(w->is_completed());
      EXPECT_EQ(w->status().code, StatusCode::kTimeout);
      EXPECT_THROW(w->wait(), TimeoutError);  // the stored error is rethrown
    }
    t.barrier();
    // Still usable after the withdrawn receive.
    if (t.rank() == 1) {
      int value = 77;
      t.send(0, 10, &value, sizeof(value))->wait();
    } else if (t.rank() == 0) {
      int value = 0;
      t.recv(1, 10, &value, sizeof(value))->wait();
      EXPECT_EQ(value, 77);
    }
  });
}

TEST_P(TransportTest, AbortWithdrawsAPendingReceive) {
  Group group = make();
  run_ranks(group, [&](Transport& t) {
    if (t.rank() != 0) return;
    int value = 0;
    auto w = t.recv(1, 11, &value, sizeof(value));
    EXPECT_FALSE(w->is_completed());
    w->abort();
    EXPECT_TRUE(w->is_completed());
    EXPECT_EQ(w->status().code, StatusCode::kAborted);
    try {
      w->wait();
      ADD_FAILURE() << "expected CommError";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("aborted by the caller"), std::string::npos);
    }
  });
}

TEST_P(TransportTest, RepeatedBarriers) {
  Group group = make();
  run_ranks(group, [&](Transport& t) {
    for (int i = 0; i < 20; ++i) t.barrier();
  });
}

TEST_P(TransportTest, PeerShutdownFailsItsPendingReceivesPromptly) {
  Group group = make();
  testing::run_threads(GetParam().world_size, [&](int rank) {
    auto& t = group[static_cast<size_t>(rank)];
    if (rank == 1) {
      int value = 5;
      t->send(0, 12, &value, sizeof(value))->wait();
      t->barrier();
      t.reset();  // rank 1 leaves
      return;
    }
    t->barrier();
    if (rank != 0) return;
    int value = 0;
    t->recv(1, 12, &value, sizeof(value))->wait();  // sent before the shutdown: still delivered
    EXPECT_EQ(value, 5);
    auto w = t->recv(1, 13, &value, sizeof(value));
    const auto start = Clock::now();
    try {
      w->wait(std::chrono::seconds(20));
      ADD_FAILURE() << "expected CommError";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "expected a prompt CommError, got a timeout: " << e.what();
    } catch (const CommError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("rank 1"), std::string::npos) << what;
      EXPECT_NE(what.find("tag 13"), std::string::npos) << what;
      EXPECT_TRUE(what.find("closed the connection") != std::string::npos ||
                  what.find("shut down its transport") != std::string::npos)
          << what;
    }
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  });
}

TEST_P(TransportTest, SeveralThreadsPostAndWaitConcurrently) {
  Group group = make();
  constexpr int kThreads = 3;
  constexpr int kPerThread = 30;
  run_ranks(group, [&](Transport& t) {
    if (t.rank() > 1) return;
    const int peer = 1 - t.rank();
    // Each thread owns one tag: order per (peer, tag) must hold while threads interleave.
    testing::run_threads(kThreads, [&](int thread) {
      std::vector<int> in(kPerThread, -1), out(kPerThread);
      std::vector<WorkPtr> works;
      for (int i = 0; i < kPerThread; ++i) {
        works.push_back(t.recv(peer, 20 + thread, &in[static_cast<size_t>(i)], sizeof(int)));
        out[static_cast<size_t>(i)] = thread * 1000 + i;
        works.push_back(t.send(peer, 20 + thread, &out[static_cast<size_t>(i)], sizeof(int)));
      }
      for (auto& w : works) w->wait();
      for (int i = 0; i < kPerThread; ++i) EXPECT_EQ(in[static_cast<size_t>(i)], thread * 1000 + i);
    });
  });
}

TEST_P(TransportTest, ManyWaitersOnOneWorkSeeTheSameOutcome) {
  Group group = make();
  run_ranks(group, [&](Transport& t) {
    if (t.rank() > 1) return;
    int value = 0;
    if (t.rank() == 0) {
      auto w = t.recv(1, 14, &value, sizeof(value));
      testing::run_threads(4, [&](int) { w->wait(); });
      EXPECT_EQ(value, 99);
    } else {
      value = 99;
      t.send(0, 14, &value, sizeof(value))->wait();
    }
  });
}

TEST_P(TransportTest, DestroyingATransportFailsItsOwnPendingReceives) {
  Group group = make();
  int value = 0;
  // Rank 0 goes first while its peers are alive, so the receive fails because of its own
  // shutdown and not because a peer closed.
  WorkPtr pending = group[0]->recv(1, 15, &value, sizeof(value));
  group[0].reset();
  ASSERT_TRUE(pending->is_completed());
  EXPECT_EQ(pending->status().code, StatusCode::kAborted);
  try {
    pending->wait();
    ADD_FAILURE() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("was destroyed before the recv of 4 bytes from rank 1"),
              std::string::npos)
        << e.what();
  }
}

TEST_P(TransportTest, RejectsBadPeersAndTags) {
  Group group = make();
  Transport& t = *group[0];
  int value = 0;
  EXPECT_THROW(t.send(0, 1, &value, sizeof(value)), ConfigError);
  EXPECT_THROW(t.send(t.world_size(), 1, &value, sizeof(value)), ConfigError);
  EXPECT_THROW(t.recv(1, -1, &value, sizeof(value)), ConfigError);
  EXPECT_THROW(t.recv(1, kMaxUserTag + 1, &value, sizeof(value)), ConfigError);
  // Note [Tags on the wire]: no user send or receive reaches a tag outside 0..kMaxUserTag, the
  // reserved ones included; the device lanes' path takes only its own tags.
  for (const int tag : {-1, std::numeric_limits<int>::min(), kMaxUserTag + 1, kHeartbeatTag,
                        kLaneControlTag, kLaneBootstrapTag + 1, std::numeric_limits<int>::max()}) {
    EXPECT_THROW(t.send(1, tag, &value, sizeof(value)), ConfigError) << tag;
    EXPECT_THROW(t.recv_any(1, tag), ConfigError) << tag;
  }
  for (const int tag : {-1, 0, kBarrierTag, kHeartbeatTag, kLaneBootstrapTag + 1}) {
    EXPECT_THROW(send_reserved(t, 1, tag, {ConstSpan{&value, sizeof(value)}}), ConfigError) << tag;
    EXPECT_THROW(recv_any_reserved(t, 1, tag), ConfigError) << tag;
  }
}

// Note [Groups of ranks]: 4 ranks as 2 pipelines of 2 (ranks {0, 2} and {1, 3}) and 2 data
// groups of 2 ({0, 1} and {2, 3}). Every rank sends on both of its groups at once with the same
// tags; each message lands in its own group, barriers stay within a group, and errors name the
// parent's ranks.
void groups_of_a_data_x_pipeline_layout(TransportKind kind) {
  TransportOptions options;
  options.timeout = std::chrono::seconds(30);
  Group world = make_group(kind, 4, options);
  run_ranks(world, [&](Transport& t) {
    const int w = t.rank();
    const int replica = w % 2, stage = w / 2;
    auto pipe = ::pipemat::comm::make_group(t, {replica, 2 + replica});
    auto data = ::pipemat::comm::make_group(t, {2 * stage, 2 * stage + 1});
    EXPECT_EQ(pipe->rank(), stage);
    EXPECT_EQ(pipe->world_size(), 2);
    EXPECT_EQ(data->rank(), replica);
    EXPECT_EQ(data->world_size(), 2);
    EXPECT_EQ(pipe->kind(), kind);
    EXPECT_EQ(pipe->job_rank(), w);
    EXPECT_EQ(data->job_rank(), w);
    for (int round = 0; round < 3; ++round) {
      int32_t to_pipe = 1000 * w + round, to_data = 2000 * w + round;
      int32_t from_pipe = -1, from_data = -1;
      auto r1 = pipe->recv(1 - stage, 5, &from_pipe, sizeof(from_pipe));
      auto r2 = data->recv(1 - replica, 5, &from_data, sizeof(from_data));
      auto s1 = pipe->send(1 - stage, 5, &to_pipe, sizeof(to_pipe));
      auto s2 = data->send(1 - replica, 5, &to_data, sizeof(to_data));
      r1->wait();
      r2->wait();
      s1->wait();
      s2->wait();
      const int pipe_peer = (1 - stage) * 2 + replica, data_peer = stage * 2 + 1 - replica;
      EXPECT_EQ(from_pipe, 1000 * pipe_peer + round) << "rank " << w;
      EXPECT_EQ(from_data, 2000 * data_peer + round) << "rank " << w;
      pipe->barrier();
      data->barrier();
    }
    // A size mismatch in a group names the parent's ranks.
    if (stage == 0) {
      uint64_t big = 7;
      pipe->send(1, 6, &big, sizeof(big))->wait();
    } else {
      uint32_t small = 0;
      try {
        pipe->recv(0, 6, &small, sizeof(small))->wait();
        ADD_FAILURE() << "expected a size mismatch";
      } catch (const CommError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(::pipemat::detail::concat("rank ", replica, " sent 8 bytes")),
                  std::string::npos)
            << what;
      }
    }
    // Peers are the group's ranks.
    int32_t value = 0;
    EXPECT_THROW(pipe->send(2, 1, &value, sizeof(value)), ConfigError);
    data->barrier();
  });
  Transport& t0 = *world[0];
  EXPECT_THROW(::pipemat::comm::make_group(t0, {1, 2}), ConfigError);     // not in it
  EXPECT_THROW(::pipemat::comm::make_group(t0, {0, 0, 1}), ConfigError);  // twice
  EXPECT_THROW(::pipemat::comm::make_group(t0, {0, 4}), ConfigError);     // outside the world
  EXPECT_THROW(::pipemat::comm::make_group(t0, {}), ConfigError);
}

TEST(TransportGroups, LocalDataByPipelineLayout) {
  groups_of_a_data_x_pipeline_layout(TransportKind::kLocal);
}

TEST(TransportGroups, TcpDataByPipelineLayout) {
  groups_of_a_data_x_pipeline_layout(TransportKind::kTcp);
}

INSTANTIATE_TEST_SUITE_P(
    comm, TransportTest,
    ::testing::Values(Param{TransportKind::kLocal, 2}, Param{TransportKind::kLocal, 3},
                      Param{TransportKind::kLocal, 4}, Param{TransportKind::kTcp, 2},
                      Param{TransportKind::kTcp, 3}, Param{TransportKind::kTcp, 4}),
    param_name);

}  // namespace
}  // namespace pipemat::comm
