// TCP-specific behaviour: rendezvous failures, option resolution and hostile peers.

#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "test_util.h"

namespace pipemat::comm {
namespace {

// Rank 1 of 2 connecting to a master at 127.0.0.1:port with `retries` attempts 50 ms apart.
TransportOptions rank1_connecting(int port, int retries) {
  TransportOptions options;
  options.kind = TransportKind::kTcp;
  options.rank = 1;
  options.world_size = 2;
  options.master = "127.0.0.1:" + std::to_string(port);
  options.connect_retries = retries;
  options.connect_retry_interval = std::chrono::milliseconds(50);
  options.timeout = std::chrono::seconds(20);
  return options;
}

TEST(commTcpRendezvous, ClosedMasterPortFailsClearlyAfterRetries) {
  const int port = testing::free_port();  // nobody listens there
  const TransportOptions options = rank1_connecting(port, 4);
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

// A relay between hosts accepts at once and closes when nothing listens behind it yet: such a
// connection is retried like a refused one, and the error says what happened.
TEST(commTcpRendezvous, ConnectionClosedBeforeTheChallengeIsRetried) {
  const testing::LoopbackSocket bound = testing::bind_loopback(8);
  const int listener = bound.fd, port = bound.port;
  ASSERT_GE(listener, 0);
  int accepted = 0;
  std::thread relay([&] {
    for (int fd; (fd = ::accept(listener, nullptr, nullptr)) >= 0;) {
      ++accepted;
      ::close(fd);
    }
  });
  std::string what;
  try {
    make_transport(rank1_connecting(port, 3));
  } catch (const CommError& e) {
    what = e.what();
  }
  ::shutdown(listener, SHUT_RDWR);
  relay.join();
  ::close(listener);
  EXPECT_EQ(accepted, 3);
  EXPECT_NE(what.find("could not connect to the master (rank 0) at 127.0.0.1:" +
                      std::to_string(port) + " after 3 attempts"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("last error: accepted, then closed before the first byte"), std::string::npos)
      << what;
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

// A raw loopback connection to `port` at `address`; retries while nobody listens there yet.
class RawSocket {
 public:
  explicit RawSocket(int port, const char* address = "127.0.0.1") {
    for (int attempt = 0; attempt < 500 && fd_ < 0; ++attempt) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      ::inet_pton(AF_INET, address, &addr.sin_addr);
      addr.sin_port = htons(static_cast<uint16_t>(port));
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
        fd_ = fd;
      } else {
        ::close(fd);  // rank 0 is not listening yet: retry like the transport does
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    if (fd_ < 0) throw CommError("fake peer: could not connect to the master port");
    timeval limit{10, 0};  // bounded: a test fails instead of hanging
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  }
  ~RawSocket() { ::close(fd_); }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;

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
  // Reads until the other side closes (bounded by the 10 s receive timeout); returns the bytes.
  size_t read_until_closed() {
    size_t total = 0;
    uint8_t buffer[256];
    for (;;) {
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) return n == 0 ? total : std::numeric_limits<size_t>::max();
      total += static_cast<size_t>(n);
    }
  }

 private:
  int fd_ = -1;
};

// The rendezvous handshake of comm/src/tcp/wire.h (Note [Rendezvous handshake]) spoken
// by hand. Wire sizes: challenge 80 bytes (nonce at 16, job digest at 48), hello 184 (listener
// address at 24, nonce at 88, job digest at 120, mac over the first 152), ack 40 (status at 4).
constexpr size_t kChallengeBytes = 80, kHelloBytes = 184, kAckBytes = 40;

// The job digest of TransportOptions::job `job` as the hello carries it: SHA-256's 32 bytes.
std::vector<uint8_t> job_bytes(const std::string& job) {
  const std::string hex = sha256_hex(job);
  std::vector<uint8_t> out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::vector<uint8_t> read_challenge(RawSocket& socket) {
  std::vector<uint8_t> challenge(kChallengeBytes);
  socket.read(challenge.data(), challenge.size());
  return challenge;
}

// `job`: the hello's job digest; empty: that of TransportOptions' default job.
std::vector<uint8_t> make_hello(const std::vector<uint8_t>& challenge, const std::string& secret,
                                int32_t rank, int32_t world_size,
                                const std::string& listen_host = "127.0.0.1",
                                std::vector<uint8_t> job = {}) {
  std::vector<uint8_t> hello(kHelloBytes, 0);
  const uint32_t head[6] = {0x504d4832,  // "PMH2"
                            5,           // protocol version
                            static_cast<uint32_t>(rank),
                            static_cast<uint32_t>(world_size),
                            1,  // listen port
                            secret.empty() ? 0u : 1u};
  std::memcpy(hello.data(), head, sizeof(head));
  std::memcpy(hello.data() + 24, listen_host.data(), listen_host.size());
  for (size_t i = 0; i < 32; ++i) hello[88 + i] = static_cast<uint8_t>(i * 7 + 1);  // nonce
  if (job.empty()) job = job_bytes("");
  std::memcpy(hello.data() + 120, job.data(), job.size());
  HmacSha256 mac(secret);
  mac.update("pipemat hello", 13);
  mac.update(challenge.data() + 16, 32);
  mac.update(hello.data(), 152);
  const Digest digest = mac.finish();
  std::memcpy(hello.data() + 152, digest.data(), digest.size());
  return hello;
}

// Says the hello of `rank` and returns the status of the ack (0: accepted).
uint32_t say_hello(RawSocket& socket, const std::string& secret, int32_t rank, int32_t world_size,
                   const std::string& listen_host = "127.0.0.1") {
  const std::vector<uint8_t> hello =
      make_hello(read_challenge(socket), secret, rank, world_size, listen_host);
  socket.write(hello.data(), hello.size());
  std::vector<uint8_t> ack(kAckBytes);
  socket.read(ack.data(), ack.size());
  uint32_t status = 0;
  std::memcpy(&status, ack.data() + 4, 4);
  return status;
}

// Plays rank 1 of a world of 2 against a real rank 0 over a raw socket, speaking the
// rendezvous of comm/src/tcp/rendezvous.h (the handshake on the master port, then the rank
// table), so that a test can write whatever a broken or hostile peer would.
class FakePeer {
 public:
  explicit FakePeer(int master_port, const std::string& secret = "") : socket_(master_port) {
    if (say_hello(socket_, secret, 1, 2) != 0) throw CommError("fake peer: hello refused");
    std::vector<uint8_t> table(2 * 64);
    socket_.read(table.data(), table.size());
  }

  // A frame header (magic "PMC1", tag, size) followed by `payload` bytes of data.
  void send_frame(int32_t tag, uint64_t size, size_t payload) {
    std::vector<uint8_t> frame(16 + payload, 0x41);
    const uint32_t magic = 0x504d4331;
    std::memcpy(frame.data(), &magic, 4);
    std::memcpy(frame.data() + 4, &tag, 4);
    std::memcpy(frame.data() + 8, &size, 8);
    socket_.write(frame.data(), frame.size());
  }
  // Raw bytes on the data connection, e.g. a damaged frame.
  void write(const void* data, size_t size) { socket_.write(data, size); }

 private:
  RawSocket socket_;
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

// The real rank 0 (with `max_message_bytes`) waits in a receive of any size from rank 1 on
// `recv_tag` while a FakePeer rank 1 writes a frame header of `tag` and `size` and 4096 bytes:
// that receive and a later one fail with a CommError containing `what`.
void expect_frame_fails_the_peer(int32_t tag, uint64_t size, size_t max_message_bytes, int recv_tag,
                                 const std::string& what, const std::string& where) {
  HostilePair pair;
  connect_hostile_pair(pair, max_message_bytes);
  Transport& t = *pair.rank0;
  WorkPtr pending = t.recv_any(1, recv_tag);
  pair.rank1->send_frame(tag, size, 4096);
  expect_peer_error(pending, what, where);
  expect_peer_error(t.recv_any(1, recv_tag), what, where + ", later recv_any");
}

// A frame that passes the limit but cannot be allocated: the failure of the handler fails that
// peer (its pending receive gets the error) instead of being swallowed by the I/O loop.
TEST(commTcpHostilePeer, FrameThatCannotBeAllocatedFailsThePeer) {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (uint64_t size : {uint64_t{1} << 62, max, max - 63}) {
    expect_frame_fails_the_peer(5, size, std::numeric_limits<size_t>::max(), 5,
                                "rank 0 ran out of memory receiving a frame of " +
                                    std::to_string(size) +
                                    " bytes with tag 5 from rank 1 (std::bad_alloc); rank 0 closed "
                                    "the connection to rank 1",
                                "frame size " + std::to_string(size));
  }
}

// Note [Tags on the wire]: a data frame with a tag that no pipemat rank sends (negative, the
// heartbeat tag that tcp never puts in a frame, above the reserved ones) is a corrupt stream: it
// fails the peer, naming it and the tag, instead of being kept as an unexpected message that no
// receive can ever take.
TEST(commTcpHostilePeer, FrameWithATagNoRankSendsFailsThePeer) {
  for (const int32_t tag : {-1, std::numeric_limits<int32_t>::min(), kHeartbeatTag,
                            kLaneBootstrapTag + 1, std::numeric_limits<int32_t>::max()}) {
    expect_frame_fails_the_peer(tag, 4, kDefaultMaxMessageBytes, 3,
                                "corrupt stream from rank 1: a frame of 4 bytes with tag " +
                                    std::to_string(tag) +
                                    ", a tag no pipemat rank sends (user tags are "
                                    "0..1073741823); rank 0 closed the connection to rank 1",
                                "tag " + std::to_string(tag));
  }
  // The tags ranks send pass: the users' first and last, the barrier's, the device lanes'.
  HostilePair pair;
  connect_hostile_pair(pair);
  Transport& t = *pair.rank0;
  for (const int32_t tag : {kBarrierTag, kLaneDataTag, 0, kMaxUserTag}) {
    pair.rank1->send_frame(tag, 4, 4);
  }
  for (const int32_t tag : {0, kMaxUserTag}) {
    WorkPtr work = t.recv_any(1, tag);
    EXPECT_NO_THROW(work->wait(std::chrono::seconds(5))) << tag;
    EXPECT_EQ(work->received_bytes(), 4u) << tag;
  }
  EXPECT_NO_THROW(recv_any_reserved(t, 1, kLaneDataTag)->wait(std::chrono::seconds(5)));
}

// Note [Frame stream fuzzing]
// Deterministic mutation fuzzing of the tcp frame decoder: a fake rank 1 writes streams of
// frames with random tags and payloads (100 streams of 1000 frames, seeded by the stream index)
// while the real rank 0 receives them in batches posted before or after the frames arrive,
// with the exact size, any size or a wrong size. Every frame must be delivered with its bytes
// (a wrong size fails that receive only, with kSizeMismatch). Each stream ends in a damage
// drawn at random: a flipped magic byte, a size above the limit, half a header or half a
// payload and then a close, or random bytes. The damage must fail the peer with a CommError
// naming rank 1 (never a crash, a hang or a timeout), and later receives fail the same way.
struct FuzzFrame {
  int32_t tag = 0;
  std::vector<uint8_t> payload;
};

std::vector<uint8_t> frame_bytes(int32_t tag, uint64_t size, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out(16 + payload.size());
  const uint32_t magic = 0x504d4331;
  std::memcpy(out.data(), &magic, 4);
  std::memcpy(out.data() + 4, &tag, 4);
  std::memcpy(out.data() + 8, &size, 8);
  if (!payload.empty()) std::memcpy(out.data() + 16, payload.data(), payload.size());
  return out;
}

TEST(commTcpFrameFuzz, MutatedStreamsDeliverEveryFrameOrFailThePeerNamingIt) {
  constexpr int kStreams = 100, kFramesPerStream = 1000;
  constexpr size_t kLimit = 1 << 20;
  int64_t frames = 0, mismatches = 0;
  std::vector<int> damages(5, 0);
  for (int stream = 0; stream < kStreams; ++stream) {
    std::mt19937_64 rng(static_cast<uint64_t>(stream) * 7919 + 17);
    const std::string where = "stream " + std::to_string(stream);
    HostilePair pair;
    connect_hostile_pair(pair, kLimit);
    Transport& t = *pair.rank0;
    int sent = 0;
    while (sent < kFramesPerStream) {
      const int batch = std::min<int>(1 + static_cast<int>(rng() % 32), kFramesPerStream - sent);
      std::vector<FuzzFrame> fs(static_cast<size_t>(batch));
      for (auto& f : fs) {
        f.tag = static_cast<int32_t>(rng() % 8);
        const size_t size = rng() % 16 == 0 ? rng() % 8192 : rng() % 65;
        f.payload.resize(size);
        for (auto& b : f.payload) b = static_cast<uint8_t>(rng());
      }
      // 0: exact size, 1: any size, 2: a wrong size.
      std::vector<int> kinds(fs.size());
      for (auto& k : kinds) k = static_cast<int>(rng() % 8 == 0 ? 2 : rng() % 2);
      std::vector<std::vector<uint8_t>> into(fs.size());
      std::vector<WorkPtr> works(fs.size());
      const auto post = [&] {
        for (size_t i = 0; i < fs.size(); ++i) {
          if (kinds[i] == 1) {
            works[i] = t.recv_any(1, fs[i].tag);
            continue;
          }
          into[i].resize(kinds[i] == 0 ? fs[i].payload.size() : fs[i].payload.size() + 1);
          works[i] = t.recv(1, fs[i].tag, into[i].data(), into[i].size());
        }
      };
      const bool posted_first = rng() % 2 == 0;
      if (posted_first) post();
      std::vector<uint8_t> bytes;
      for (const auto& f : fs) {
        const auto one = frame_bytes(f.tag, f.payload.size(), f.payload);
        bytes.insert(bytes.end(), one.begin(), one.end());
      }
      pair.rank1->write(bytes.data(), bytes.size());
      if (!posted_first) post();
      for (size_t i = 0; i < fs.size(); ++i) {
        const std::string what = where + " frame " + std::to_string(sent + static_cast<int>(i));
        if (kinds[i] == 2) {
          EXPECT_THROW(works[i]->wait(std::chrono::seconds(10)), CommError) << what;
          EXPECT_EQ(works[i]->status().code, StatusCode::kSizeMismatch) << what;
          ++mismatches;
          continue;
        }
        ASSERT_NO_THROW(works[i]->wait(std::chrono::seconds(10))) << what;
        ASSERT_EQ(works[i]->received_bytes(), fs[i].payload.size()) << what;
        if (kinds[i] == 1) {
          const Buffer b = works[i]->buffer();
          ASSERT_TRUE(fs[i].payload.empty() ||
                      std::memcmp(b.data(), fs[i].payload.data(), fs[i].payload.size()) == 0)
              << what;
        } else {
          ASSERT_EQ(into[i], fs[i].payload) << what;
        }
      }
      sent += batch;
      frames += batch;
    }
    // The damage that ends the stream.
    const int damage = static_cast<int>(rng() % 5);
    ++damages[static_cast<size_t>(damage)];
    WorkPtr pending = t.recv_any(1, 3);
    std::vector<uint8_t> payload(64, 0x5a);
    std::vector<uint8_t> bytes = frame_bytes(3, payload.size(), payload);
    bool close = false;
    switch (damage) {
      case 0:  // a flipped magic byte
        bytes[rng() % 4] ^= static_cast<uint8_t>(1 + rng() % 255);
        break;
      case 1: {  // a size above the limit (up to 2^64 - 1)
        const uint64_t size = kLimit + 1 + rng() % (std::numeric_limits<uint64_t>::max() - kLimit);
        std::memcpy(bytes.data() + 8, &size, 8);
        break;
      }
      case 2:  // half a header, then the connection closes
        bytes.resize(1 + rng() % 15);
        close = true;
        break;
      case 3:  // half a payload, then the connection closes
        bytes.resize(16 + rng() % payload.size());
        close = true;
        break;
      default:  // random bytes (a valid magic has a chance of 2^-32)
        bytes.resize(16 + rng() % 48);
        for (auto& b : bytes) b = static_cast<uint8_t>(rng());
        break;
    }
    pair.rank1->write(bytes.data(), bytes.size());
    if (close) pair.rank1.reset();
    expect_peer_error(pending, "rank 1", where + " damage " + std::to_string(damage));
    expect_peer_error(t.recv_any(1, 5), "rank 1", where + " later recv");
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(frames, int64_t{kStreams} * kFramesPerStream);
  // The streams are seeded, so the counts are the generator's: every kind of receive and of
  // damage was drawn (the damages add up to one per stream).
  EXPECT_EQ(mismatches, 12544);
  EXPECT_EQ(damages, (std::vector<int>{16, 15, 30, 15, 24}));
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

// `world_size` tcp ranks with `timeout`; rank `silent` beats once an hour (it is silent unless it
// sends).
testing::Group group_with_a_silent_rank(int world_size, std::chrono::milliseconds timeout,
                                        int silent) {
  TransportOptions options;
  options.timeout = timeout;
  return testing::make_group(TransportKind::kTcp, world_size, options,
                             [silent](int rank, TransportOptions& mine) {
                               if (rank == silent) mine.heartbeat_interval = std::chrono::hours(1);
                             });
}

// Note [Liveness of a peer]: a timed-out wait tells a silent peer (nothing came, not even a
// heartbeat: stalled or unreachable) from one that is alive (a mismatch). Rank 1 beats once an
// hour: it is silent unless it sends.
TEST(commTcpTimeout, TheMessageSaysWhetherThePeerWasSilent) {
  testing::Group group = group_with_a_silent_rank(2, std::chrono::seconds(20), 1);
  int32_t value = 0;
  auto timeout_of = [&] {
    try {
      group[0]->recv(1, 9, &value, sizeof(value))->wait(std::chrono::milliseconds(300));
    } catch (const TimeoutError& e) {
      return std::string(e.what());
    }
    return std::string("no timeout");
  };
  const std::string silent = timeout_of();
  EXPECT_NE(silent.find("timed out after 300 ms waiting for recv of 4 bytes from rank 1 with tag "
                        "9 on rank 0 (tcp). Nothing arrived from rank 1 for the last "),
            std::string::npos)
      << silent;
  EXPECT_NE(silent.find(" s, not even its heartbeat: it is stalled or unreachable"),
            std::string::npos)
      << silent;
  // Rank 1 sends on tag 5 all through the wait, never on tag 9.
  std::atomic<bool> stop{false};
  std::thread chatter([&] {
    int32_t beat = 1;
    while (!stop) {
      group[1]->send(0, 5, &beat, sizeof(beat))->wait();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const std::string alive = timeout_of();
  stop = true;
  chatter.join();
  EXPECT_NE(alive.find("(tcp). Rank 1 is alive (it was last heard from "), std::string::npos)
      << alive;
  EXPECT_NE(alive.find(" ms ago) but did not send this one: check that both ranks post the "
                       "matching operation with the same tag"),
            std::string::npos)
      << alive;
}

// Note [Liveness of a peer]: wait() without a timeout gives a peer whose heartbeats arrive (an
// idle rank 1) twice the transport's timeout and one that is silent (rank 2 beats once an hour)
// the timeout. The timeout is 2 s, the beats every 500 ms.
TEST(commTcpTimeout, TheDefaultWaitGivesALivePeerTwiceTheTimeout) {
  testing::Group group = group_with_a_silent_rank(3, std::chrono::seconds(2), 2);
  int32_t value = 0;
  auto wait_for = [&](int peer) {
    const auto start = Clock::now();
    std::string what = "no timeout";
    try {
      group[0]->recv(peer, 9, &value, sizeof(value))->wait();
    } catch (const TimeoutError& e) {
      what = e.what();
    }
    return std::make_pair(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start), what);
  };
  const auto [alive_ms, alive] = wait_for(1);
  EXPECT_GE(alive_ms.count(), 4000) << alive;
  EXPECT_NE(alive.find("from rank 1 with tag 9 on rank 0 (tcp). Rank 1 is alive (it was last heard "
                       "from "),
            std::string::npos)
      << alive;
  const auto [silent_ms, silent] = wait_for(2);
  EXPECT_GE(silent_ms.count(), 2000) << silent;
  EXPECT_LT(silent_ms.count(), 4000) << silent;
  EXPECT_NE(silent.find("from rank 2 with tag 9 on rank 0 (tcp). Nothing arrived from rank 2 for "
                        "the last "),
            std::string::npos)
      << silent;
}

// ---- rendezvous hardening: binding, job secret, stray connections ----

TransportOptions tcp_rank(int rank, int port, const std::string& secret = "") {
  TransportOptions options;
  options.kind = TransportKind::kTcp;
  options.rank = rank;
  options.world_size = 2;
  options.master = "127.0.0.1:" + std::to_string(port);
  options.timeout = std::chrono::seconds(20);
  options.connect_retry_interval = std::chrono::milliseconds(20);
  options.connect_retries = 500;
  options.secret = secret;
  return options;
}

// One message each way between the two ranks of a world of 2.
void expect_round_trip(Transport& rank0, Transport& rank1) {
  int32_t value = 42, got = 0;
  rank0.send(1, 7, &value, sizeof(value))->wait();
  rank1.recv(0, 7, &got, sizeof(got))->wait();
  EXPECT_EQ(got, 42);
  value = 43;
  rank1.send(0, 8, &value, sizeof(value))->wait();
  rank0.recv(1, 8, &got, sizeof(got))->wait();
  EXPECT_EQ(got, 43);
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Runs fn on a thread; an exception becomes a test failure instead of ending the binary.
std::thread background(std::function<void()> fn) {
  return std::thread([fn = std::move(fn)] {
    try {
      fn();
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  });
}

// Returns errno of a connect to `address`:`port` (0 when it connected).
int connect_errno(const char* address, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, address, &addr.sin_addr);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int error = rc == 0 ? 0 : errno;
  ::close(fd);
  return error;
}

// Rank 0 listens on exactly the configured master host: 127.0.0.2 is loopback too, but a socket
// bound to 127.0.0.1 does not accept it (one bound to 0.0.0.0, as before, did).
TEST(commTcpRendezvous, MasterListensOnlyOnTheConfiguredHost) {
  const int port = testing::free_port();
  std::unique_ptr<Transport> rank0, rank1;
  std::thread master = background([&] { rank0 = make_transport(tcp_rank(0, port)); });
  {
    RawSocket probe(port);  // rank 0 is listening once this connects and gets its challenge
    read_challenge(probe);
    EXPECT_EQ(connect_errno("127.0.0.2", port), ECONNREFUSED);
    rank1 = make_transport(tcp_rank(1, port));
  }
  master.join();
  ASSERT_TRUE(rank0 && rank1);
  expect_round_trip(*rank0, *rank1);
}

// The listener of rank 1 (for the ranks above it) is bound to the address the rank table
// announces, 127.0.0.1, not to every interface. Rank 2 is played by hand to look at it; the
// table gives rank 2 at the address its hello announced (127.0.0.3), not at the one rank 0 saw
// its connection come from (Note [Announced listener address]).
TEST(commTcpRendezvous, PeerListenersBindTheAnnouncedAddress) {
  const int port = testing::free_port();
  std::unique_ptr<Transport> rank0, rank1;
  auto options = [&](int rank) {
    TransportOptions o = tcp_rank(rank, port, "s");
    o.world_size = 3;
    return o;
  };
  std::thread real = background([&] {
    testing::run_threads(
        2, [&](int rank) { (rank == 0 ? rank0 : rank1) = make_transport(options(rank)); });
  });
  {
    RawSocket to_master(port);
    EXPECT_EQ(say_hello(to_master, "s", 2, 3, "127.0.0.3"), 0u);
    std::vector<uint8_t> table(3 * 64);
    to_master.read(table.data(), table.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(table.data() + 2 * 64 + 4)), "127.0.0.3");
    uint32_t rank1_port = 0;
    std::memcpy(&rank1_port, table.data() + 64, 4);
    const std::string rank1_host(reinterpret_cast<const char*>(table.data() + 64 + 4));
    EXPECT_EQ(rank1_host, "127.0.0.1");
    EXPECT_EQ(connect_errno("127.0.0.2", static_cast<int>(rank1_port)), ECONNREFUSED);
    RawSocket to_rank1(static_cast<int>(rank1_port));
    EXPECT_EQ(say_hello(to_rank1, "s", 2, 3), 0u);
    real.join();
  }
  ASSERT_TRUE(rank0 && rank1);
  expect_round_trip(*rank0, *rank1);
}

TEST(commTcpRendezvous, MasterHostThatIsNotLocalIsAConfigError) {
  TransportOptions options = tcp_rank(0, testing::free_port());
  options.master = "192.0.2.1:" + std::to_string(testing::free_port());  // TEST-NET-1
  try {
    make_transport(options);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the master host '192.0.2.1'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("is not an address of this machine"), std::string::npos)
        << e.what();
  }
}

// Garbage, silence, half a hello, a wrong secret, an out-of-range rank and a listener address
// that is not an IP address, all before the real
// rank 1: each is dropped and reported once, and the real ranks still join.
TEST(commTcpRendezvous, StrayConnectionsAreDroppedAndTheRealRanksStillJoin) {
  const std::string secret = "0123456789abcdef0123456789abcdef";
  const int port = testing::free_port();
  std::unique_ptr<Transport> rank0, rank1;
  ::testing::internal::CaptureStderr();
  std::thread master = background([&] { rank0 = make_transport(tcp_rank(0, port, secret)); });
  {
    RawSocket garbage(port);
    std::mt19937 random(7);
    std::vector<uint8_t> noise(kHelloBytes);
    for (auto& b : noise) b = static_cast<uint8_t>(random());
    garbage.write(noise.data(), noise.size());
    RawSocket silent(port);
    RawSocket half(port);
    const std::vector<uint8_t> hello = make_hello(read_challenge(half), secret, 1, 2);
    half.write(hello.data(), hello.size() / 2);
    RawSocket wrong(port);
    EXPECT_EQ(say_hello(wrong, "not the secret", 1, 2), 1u);  // kWrongSecret
    RawSocket outside(port);
    EXPECT_EQ(say_hello(outside, secret, 5, 2), 3u);  // kBadRank
    RawSocket nameless(port);
    EXPECT_EQ(say_hello(nameless, secret, 1, 2, "rank1.example"), 5u);  // kBadProtocol
    // Rank 0 closed the refused ones while the rendezvous is still waiting for rank 1.
    EXPECT_EQ(wrong.read_until_closed(), 0u);
    EXPECT_EQ(outside.read_until_closed(), 0u);
    EXPECT_EQ(nameless.read_until_closed(), 0u);
    EXPECT_EQ(garbage.read_until_closed(), kChallengeBytes + kAckBytes);
    rank1 = make_transport(tcp_rank(1, port, secret));
    master.join();
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(rank0 && rank1);
  expect_round_trip(*rank0, *rank1);
  EXPECT_EQ(count_of(log, "pipemat tcp: rank 0 dropped a connection from 127.0.0.1:"), 6u) << log;
  EXPECT_EQ(count_of(log, "its hello announces no valid listener address"), 1u) << log;
  EXPECT_EQ(count_of(log, " during rendezvous: wrong job secret\n"), 1u) << log;
  EXPECT_EQ(count_of(log, "not a pipemat hello (bad magic)"), 1u) << log;
  EXPECT_EQ(count_of(log, "it announced rank 5, but rank 0 accepts only ranks 1..1 here"), 1u)
      << log;
  EXPECT_EQ(count_of(log, "the rendezvous ended before it completed its hello"), 2u) << log;
}

TEST(commTcpRendezvous, SilentConnectionIsDroppedAtTheHandshakeDeadline) {
  const int port = testing::free_port();
  std::unique_ptr<Transport> rank0, rank1;
  TransportOptions options = tcp_rank(0, port);
  options.handshake_timeout = std::chrono::milliseconds(200);
  ::testing::internal::CaptureStderr();
  std::thread master = background([&] { rank0 = make_transport(options); });
  {
    RawSocket silent(port);
    read_challenge(silent);
    const auto start = Clock::now();
    EXPECT_EQ(silent.read_until_closed(), 0u);
    EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(150));
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
    rank1 = make_transport(tcp_rank(1, port));
  }
  master.join();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(rank0 && rank1);
  expect_round_trip(*rank0, *rank1);
  EXPECT_EQ(count_of(log, "during rendezvous: no complete hello within 200 ms"), 1u) << log;
}

// The real rank 1 with another secret (or none): refused at once with the reason, and rank 0
// times out naming the missing rank and the dropped connection.
TEST(commTcpRendezvous, WrongSecretOnARealRankFailsBothSides) {
  for (const std::string rank1_secret : {"other secret", ""}) {
    const int port = testing::free_port();
    std::string rank0_error, rank1_error;
    ::testing::internal::CaptureStderr();
    const auto start = Clock::now();
    testing::run_threads(2, [&](int rank) {
      TransportOptions options = tcp_rank(rank, port, rank == 0 ? "the secret" : rank1_secret);
      options.timeout = rank == 0 ? std::chrono::milliseconds(1500) : std::chrono::seconds(5);
      try {
        make_transport(options);
      } catch (const Error& e) {
        (rank == 0 ? rank0_error : rank1_error) = e.what();
      }
    });
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
    ::testing::internal::GetCapturedStderr();
    EXPECT_NE(rank1_error.find("tcp rendezvous: the master (rank 0) at 127.0.0.1:" +
                               std::to_string(port) + " refused rank 1: wrong job secret"),
              std::string::npos)
        << rank1_error;
    EXPECT_NE(rank1_error.find("PIPEMAT_JOB_SECRET"), std::string::npos) << rank1_error;
    EXPECT_NE(rank0_error.find("timed out after 1500 ms waiting for ranks 1 to connect to port"),
              std::string::npos)
        << rank0_error;
    EXPECT_NE(rank0_error.find("dropped 1 connection meanwhile, the last from 127.0.0.1:"),
              std::string::npos)
        << rank0_error;
    EXPECT_NE(rank0_error.find(": wrong job secret"), std::string::npos) << rank0_error;
    if (rank1_secret.empty()) {
      EXPECT_NE(rank1_error.find("this rank has no job secret, there a job secret"),
                std::string::npos)
          << rank1_error;
    }
  }
}

// Two jobs on one master port, neither with a secret: the other job's rank is refused at once,
// both sides naming both job digests, and rank 0 goes on waiting for its own rank 1 (it times
// out here: there is none).
TEST(commTcpRendezvous, ARankOfAnotherJobIsRefusedWithOrWithoutASecret) {
  for (const std::string secret : {"", "shared secret"}) {
    const int port = testing::free_port();
    std::string rank0_error, rank1_error;
    ::testing::internal::CaptureStderr();
    testing::run_threads(2, [&](int rank) {
      TransportOptions options = tcp_rank(rank, port, secret);
      options.job = rank == 0 ? "job A" : "job B";
      options.timeout = rank == 0 ? std::chrono::milliseconds(1500) : std::chrono::seconds(5);
      try {
        make_transport(options);
      } catch (const Error& e) {
        (rank == 0 ? rank0_error : rank1_error) = e.what();
      }
    });
    const std::string log = ::testing::internal::GetCapturedStderr();
    const std::string a = sha256_hex("job A").substr(0, 12), b = sha256_hex("job B").substr(0, 12);
    EXPECT_NE(rank1_error.find("refused rank 1: it belongs to another job (job digest " + a +
                               ", this rank's " + b + ")"),
              std::string::npos)
        << rank1_error;
    EXPECT_NE(rank0_error.find("waiting for ranks 1 to connect"), std::string::npos) << rank0_error;
    EXPECT_NE(log.find("it belongs to another job (job digest " + b + ", this job's " + a + ")"),
              std::string::npos)
        << log;
  }
  // The same job text joins.
  const int port = testing::free_port();
  std::unique_ptr<Transport> rank0, rank1;
  testing::run_threads(2, [&](int rank) {
    TransportOptions options = tcp_rank(rank, port);
    options.job = "job A";
    (rank == 0 ? rank0 : rank1) = make_transport(options);
  });
  expect_round_trip(*rank0, *rank1);
}

// What the real rank 1 of a world of 2 made of a master played by hand (FakeMaster).
struct FakeMasterRun {
  std::string error;       // rank 1's error; empty when it joined
  size_t hello_bytes = 0;  // how much of its hello arrived
};

// Plays the master (rank 0) on a raw listener against the real rank 1 (with `secret`): sends a
// challenge ("PMN1", version 5) carrying job digest `job`, reads the hello and answers with an
// ack ("PMA1") of `status` and no valid mac. An empty `job` leaves the digest zero.
FakeMasterRun fake_master(const std::string& secret, const std::vector<uint8_t>& job,
                          uint8_t status) {
  const testing::LoopbackSocket bound = testing::bind_loopback(4);
  if (bound.fd < 0) throw CommError("fake master: could not listen");
  FakeMasterRun run;
  std::thread rank1([&] {
    try {
      make_transport(tcp_rank(1, bound.port, secret));
    } catch (const Error& e) {
      run.error = e.what();
    }
  });
  const int fd = ::accept(bound.fd, nullptr, nullptr);
  uint8_t challenge[kChallengeBytes] = {0x31, 0x4e, 0x4d, 0x50, 5};
  if (job.size() == 32) std::memcpy(challenge + 48, job.data(), job.size());
  ::send(fd, challenge, sizeof(challenge), MSG_NOSIGNAL);
  uint8_t hello[kHelloBytes];
  while (run.hello_bytes < sizeof(hello)) {
    const ssize_t n = ::recv(fd, hello + run.hello_bytes, sizeof(hello) - run.hello_bytes, 0);
    if (n <= 0) break;
    run.hello_bytes += static_cast<size_t>(n);
  }
  uint8_t ack[kAckBytes] = {0x31, 0x41, 0x4d, 0x50, status};
  ::send(fd, ack, sizeof(ack), MSG_NOSIGNAL);
  rank1.join();
  ::close(fd);
  ::close(bound.fd);
  return run;
}

// Two job digests that share their first 6 bytes (12 hex digits, all that the refusal used to
// name of each: "job digest 0fb339324c58, this job's 0fb339324c58") are named far enough to tell
// them apart, on both sides of the rendezvous: up to the first hex digit where they differ, all
// 64 where that is the last one.
TEST(commTcpRendezvous, TheRefusalOfAnotherJobTellsDigestsThatShareAPrefixApart) {
  const std::vector<uint8_t> ours = job_bytes("");  // TransportOptions' default job
  const std::string ours_hex = sha256_hex("");
  for (const size_t differing_byte : {size_t{7}, size_t{31}}) {
    std::vector<uint8_t> theirs = ours;
    theirs[differing_byte] ^= 0x01;  // the byte's second hex digit differs
    Digest theirs_digest{};
    std::memcpy(theirs_digest.data(), theirs.data(), theirs_digest.size());
    const std::string theirs_hex = to_hex(theirs_digest);
    const size_t shown = 2 * differing_byte + 2;
    const std::string where = "byte " + std::to_string(differing_byte);
    // A connecting rank of another job, refused by the real rank 0.
    {
      const int port = testing::free_port();
      std::unique_ptr<Transport> rank0, rank1;
      ::testing::internal::CaptureStderr();
      std::thread master = background([&] { rank0 = make_transport(tcp_rank(0, port)); });
      {
        RawSocket other(port);
        const std::vector<uint8_t> hello =
            make_hello(read_challenge(other), "", 1, 2, "127.0.0.1", theirs);
        other.write(hello.data(), hello.size());
        std::vector<uint8_t> ack(kAckBytes);
        other.read(ack.data(), ack.size());
        EXPECT_EQ(ack[4], 6u) << where;  // kOtherJob
        rank1 = make_transport(tcp_rank(1, port));
      }
      master.join();
      const std::string log = ::testing::internal::GetCapturedStderr();
      EXPECT_NE(log.find("it belongs to another job (job digest " + theirs_hex.substr(0, shown) +
                         ", this job's " + ours_hex.substr(0, shown) + ")"),
                std::string::npos)
          << where << ": " << log;
    }
    // A master of another job, as the real rank 1 sees it: the challenge carries its digest.
    const std::string error = fake_master("", theirs, 6).error;  // kOtherJob
    EXPECT_NE(error.find("refused rank 1: it belongs to another job (job digest " +
                         theirs_hex.substr(0, shown) + ", this rank's " +
                         ours_hex.substr(0, shown) + ")"),
              std::string::npos)
        << where << ": " << error;
  }
}

// A process squatting on the master port without the secret cannot pose as rank 0.
TEST(commTcpRendezvous, MasterThatCannotProveTheSecretIsRefused) {
  const FakeMasterRun run = fake_master("the secret", {}, 0);  // status 0, no valid mac
  EXPECT_EQ(run.hello_bytes, kHelloBytes);
  EXPECT_NE(run.error.find("accepted rank 1 but could not prove the job secret"), std::string::npos)
      << run.error;
}

TEST(commTcpRendezvous, SameSecretOrNoSecretOnEveryRankWorks) {
  for (const std::string secret : {"", "a shared job secret"}) {
    TransportOptions options;
    options.timeout = std::chrono::seconds(20);
    options.secret = secret;
    testing::Group group = testing::make_group(TransportKind::kTcp, 3, options);
    expect_round_trip(*group[0], *group[1]);
    int32_t value = 5, got = 0;
    group[2]->send(1, 9, &value, sizeof(value))->wait();
    group[1]->recv(2, 9, &got, sizeof(got))->wait();
    EXPECT_EQ(got, 5) << "secret '" << secret << "'";
  }
}

TEST(commTransportOptions, ResolvesTheJobSecretFromTheEnvironment) {
  TransportOptions options = tcp_rank(0, 1);
  ::setenv("PIPEMAT_JOB_SECRET", "from-env", 1);
  EXPECT_EQ(resolve_options(options).secret, "from-env");
  options.secret = "explicit";
  EXPECT_EQ(resolve_options(options).secret, "explicit");
  ::unsetenv("PIPEMAT_JOB_SECRET");
  options.secret.clear();
  EXPECT_EQ(resolve_options(options).secret, "");
  options.handshake_timeout = std::chrono::milliseconds(0);
  EXPECT_THROW(resolve_options(options), ConfigError);
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

// A counting BufferMemory: what it handed out and took back, in bytes.
std::atomic<int64_t> g_counted_bytes{0};
std::map<void*, size_t>& counted_blocks() {
  static std::map<void*, size_t> blocks;
  return blocks;
}
void* counting_allocate(size_t bytes) {
  void* p = std::aligned_alloc(Buffer::kAlignment, bytes);
  counted_blocks()[p] = bytes;
  g_counted_bytes += static_cast<int64_t>(bytes);
  return p;
}
void counting_release(void* p) {
  g_counted_bytes -= static_cast<int64_t>(counted_blocks().at(p));
  counted_blocks().erase(p);
  std::free(p);
}

TEST(commBuffer, AllocatesFromTheProcessBufferMemory) {
  Buffer before = Buffer::allocate(10);  // the default memory's, freed by std::free below
  set_buffer_memory({&counting_allocate, &counting_release});
  {
    Buffer a = Buffer::allocate(100);  // rounded up to 128
    EXPECT_EQ(g_counted_bytes.load(), 128);
    Buffer b = Buffer::allocate(1000);
    EXPECT_EQ(g_counted_bytes.load(), 128 + 1024);
    EXPECT_EQ(counted_blocks().count(b.data()), 1u);
    EXPECT_EQ(a.size(), 100u);
  }
  EXPECT_EQ(g_counted_bytes.load(), 0);
  Buffer during = Buffer::allocate(64);
  set_buffer_memory({});  // back to the default; `during` still goes back to the counting one
  void* from_default = buffer_memory().allocate(64);
  EXPECT_NE(from_default, nullptr);
  buffer_memory().release(from_default);
  before = Buffer();
  during = Buffer();
  EXPECT_EQ(g_counted_bytes.load(), 0);
  EXPECT_TRUE(counted_blocks().empty());
  EXPECT_THROW(set_buffer_memory({&counting_allocate, nullptr}), ConfigError);
  EXPECT_THROW(set_buffer_memory({nullptr, &counting_release}), ConfigError);
}

// A transport's control messages (tags above kMaxUserTag) never come from the process's
// BufferMemory: a barrier token buffered for a rank that has not reached the barrier yet is not
// the user's memory (it made a soak's measured bytes move by 64 under load).
TEST(commBuffer, ControlMessagesNeverUseTheProcessBufferMemory) {
  set_buffer_memory({&counting_allocate, &counting_release});
  {
    Buffer user = Buffer::allocate_for_tag(1, 5);
    EXPECT_EQ(g_counted_bytes.load(), 64);
    Buffer control = Buffer::allocate_for_tag(1, kMaxUserTag + 1);
    EXPECT_EQ(g_counted_bytes.load(), 64);
    EXPECT_EQ(counted_blocks().count(control.data()), 0u);
    EXPECT_EQ(control.size(), 1u);
  }
  EXPECT_EQ(g_counted_bytes.load(), 0);
  TransportOptions options;
  options.kind = TransportKind::kLocal;
  auto transports = make_local_transports(2, options);
  // A user message sent before its receive is posted is copied (eagerly) into counted memory.
  const uint8_t byte = 7;
  transports[1]->send(0, 5, &byte, 1)->wait();
  EXPECT_EQ(g_counted_bytes.load(), 64);
  uint8_t got = 0;
  transports[0]->recv(1, 5, &got, 1)->wait();
  EXPECT_EQ(got, 7);
  EXPECT_EQ(g_counted_bytes.load(), 0);
  // Rank 1 reaches the barrier first: its token waits in the hub, outside the counted memory.
  std::atomic<bool> rank1_done{false};
  std::thread rank1([&] {
    transports[1]->barrier();
    rank1_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(rank1_done.load());
  EXPECT_EQ(g_counted_bytes.load(), 0);
  transports[0]->barrier();
  rank1.join();
  EXPECT_EQ(g_counted_bytes.load(), 0);
  transports.clear();
  set_buffer_memory({});
  EXPECT_TRUE(counted_blocks().empty());
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
