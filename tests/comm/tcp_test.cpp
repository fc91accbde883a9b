// TCP-specific behaviour: rendezvous failures, option resolution and hostile peers.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <thread>
#include <vector>

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

// Plays rank 1 of a world of 2 against a real rank 0 over a raw socket, speaking the
// rendezvous of comm/src/tcp/transport.cpp (a hello to the master port, then the rank table), so
// that a test can write whatever a broken or hostile peer would.
class FakePeer {
 public:
  explicit FakePeer(int master_port) {
    for (int attempt = 0; attempt < 500 && fd_ < 0; ++attempt) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(master_port));
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
        fd_ = fd;
      } else {
        ::close(fd);  // rank 0 is not listening yet: retry like the transport does
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    if (fd_ < 0) throw CommError("fake peer: could not connect to the master port");
    const uint32_t hello[4] = {0x504d4831, 1, 2, 1};  // magic "PMH1", rank, world size, port
    write(hello, sizeof(hello));
    std::vector<uint8_t> table(2 * 64);
    read(table.data(), table.size());
  }
  ~FakePeer() { ::close(fd_); }
  FakePeer(const FakePeer&) = delete;
  FakePeer& operator=(const FakePeer&) = delete;

  // A frame header (magic "PMC1", tag, size) followed by `payload` bytes of data.
  void send_frame(int32_t tag, uint64_t size, size_t payload) {
    std::vector<uint8_t> frame(16 + payload, 0x41);
    const uint32_t magic = 0x504d4331;
    std::memcpy(frame.data(), &magic, 4);
    std::memcpy(frame.data() + 4, &tag, 4);
    std::memcpy(frame.data() + 8, &size, 8);
    write(frame.data(), frame.size());
  }

 private:
  void write(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      const ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
      if (n <= 0) throw CommError("fake peer: send failed");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }
  void read(void* data, size_t size) {
    auto* p = static_cast<uint8_t*>(data);
    while (size > 0) {
      const ssize_t n = ::recv(fd_, p, size, 0);
      if (n <= 0) throw CommError("fake peer: recv failed");
      p += n;
      size -= static_cast<size_t>(n);
    }
  }

  int fd_ = -1;
};

// Rank 0 (a real tcp transport) connected to a FakePeer as rank 1.
struct HostilePair {
  std::unique_ptr<Transport> rank0;
  std::optional<FakePeer> rank1;
};

void connect_hostile_pair(HostilePair& pair, size_t max_message_bytes = kDefaultMaxMessageBytes) {
  const int port = testing::free_port();
  testing::run_threads(2, [&](int rank) {
    if (rank == 1) {
      pair.rank1.emplace(port);
      return;
    }
    TransportOptions options;
    options.kind = TransportKind::kTcp;
    options.rank = 0;
    options.world_size = 2;
    options.master = "127.0.0.1:" + std::to_string(port);
    options.timeout = std::chrono::seconds(20);
    options.max_message_bytes = max_message_bytes;
    pair.rank0 = make_transport(options);
  });
}

// Waits for `work` and expects a CommError (not a timeout) containing `text`.
void expect_peer_error(const WorkPtr& work, const std::string& text, const std::string& where) {
  try {
    work->wait(std::chrono::seconds(5));
    ADD_FAILURE() << where << ": expected a CommError containing: " << text;
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << where << ": timeout instead of the error: " << e.what();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << where << ": " << e.what();
  }
}

// A frame whose size is above TransportOptions::max_message_bytes is refused before anything
// is allocated: near 2^64 the rounded allocation size used to wrap around to a tiny block that
// the payload then overflowed; 2^62 used to end in a misleading timeout.
TEST(commTcpHostilePeer, OversizedFrameFailsThePeerNamingSizeAndLimit) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (uint64_t size : {max, max - 62, max - 63, uint64_t{1} << 62, (uint64_t{16} << 30) + 1}) {
    const std::string where = "frame size " + std::to_string(size);
    HostilePair pair;
    connect_hostile_pair(pair);
    Transport& t = *pair.rank0;
    std::vector<uint8_t> into(16);
    WorkPtr pending = t.recv(1, 3, into.data(), into.size());
    pair.rank1->send_frame(3, size, 4096);
    const std::string what = "rank 1 sent a frame of " + std::to_string(size) +
                             " bytes with tag 3 to rank 0, more than the limit of 17179869184 "
                             "bytes (TransportOptions::max_message_bytes); rank 0 closed the "
                             "connection to rank 1";
    expect_peer_error(pending, what, where);
    // Whether the receive was matched before or after the frame arrived, the text is the same.
    EXPECT_NE(pending->status().message.find("recv of 16 bytes from rank 1 with tag 3 on rank 0 "
                                             "(tcp) failed: rank 1 sent a frame"),
              std::string::npos)
        << pending->status().message;
    // Later receives from that peer, on any tag, get the same error at once.
    expect_peer_error(t.recv_any(1, 3), what, where + ", later recv_any");
    expect_peer_error(t.recv_any(1, 4), what, where + ", other tag");
  }
}

// A frame that passes the limit but cannot be allocated: the failure of the handler fails that
// peer (its pending receive gets the error) instead of being swallowed by the I/O loop.
TEST(commTcpHostilePeer, FrameThatCannotBeAllocatedFailsThePeer) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (uint64_t size : {uint64_t{1} << 62, max, max - 63}) {
    const std::string where = "frame size " + std::to_string(size);
    HostilePair pair;
    connect_hostile_pair(pair, std::numeric_limits<size_t>::max());
    Transport& t = *pair.rank0;
    WorkPtr pending = t.recv_any(1, 5);
    pair.rank1->send_frame(5, size, 4096);
    const std::string what = "rank 0 ran out of memory receiving a frame of " +
                             std::to_string(size) +
                             " bytes with tag 5 from rank 1 (std::bad_alloc); rank 0 closed the "
                             "connection to rank 1";
    expect_peer_error(pending, what, where);
    expect_peer_error(t.recv_any(1, 5), what, where + ", later recv_any");
  }
}

// Genuine ranks with a small limit: messages up to the limit pass, the first larger one fails
// the connection on the receiving side with the sizes.
TEST(commTcpHostilePeer, MessagesAboveTheLimitFailTheReceivingRank) {
  TransportOptions options;
  options.timeout = std::chrono::seconds(20);
  options.max_message_bytes = 1024;
  testing::Group group = testing::make_group(TransportKind::kTcp, 2, options);
  std::vector<uint8_t> ok(1024, 7), too_big(1025, 8);
  std::vector<uint8_t> into(1024);
  group[1]->send(0, 4, ok.data(), ok.size())->wait();
  group[0]->recv(1, 4, into.data(), into.size())->wait();
  EXPECT_EQ(into, ok);
  group[1]->send(0, 4, too_big.data(), too_big.size())->wait();
  expect_peer_error(group[0]->recv_any(1, 4),
                    "rank 1 sent a frame of 1025 bytes with tag 4 to rank 0, more than the limit "
                    "of 1024 bytes (TransportOptions::max_message_bytes)",
                    "1025 bytes");
}

TEST(commBuffer, AllocateRefusesSizesThatWrapWhenRounded) {
  const size_t max = std::numeric_limits<size_t>::max();
  for (size_t size : {max, max - 1, max - 62, max - 63}) {
    EXPECT_THROW(Buffer::allocate(size), std::bad_alloc) << size;
  }
  Buffer buffer = Buffer::allocate(100);
  EXPECT_EQ(buffer.size(), 100u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % Buffer::kAlignment, 0u);
  EXPECT_EQ(Buffer::allocate(0).size(), 0u);
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
  TransportOptions zero_limit;
  zero_limit.kind = TransportKind::kLocal;
  zero_limit.max_message_bytes = 0;
  EXPECT_THROW(resolve_options(zero_limit), ConfigError);
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
