// What a tcp rank makes of the bytes a peer sent (comm/src/tcp/decode.h), without a socket: the
// frame header's kind, the acceptor's verdict on a hello, the connector's checks of a challenge
// and an ack, and the rank table's entries. The fuzz target tests/fuzz/tcp_wire_fuzz.cpp calls
// the same functions.

#include "tcp/decode.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common.h"
#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail::tcp {
namespace {

std::string what_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

TEST(TcpDecode, AFrameHeaderIsJudgedBeforeAnythingIsRead) {
  const auto kind = [](uint32_t magic, int32_t tag, uint64_t size) {
    FrameHeader h;
    h.magic = magic;
    h.tag = tag;
    h.size = size;
    return frame_kind(h, 1024);
  };
  EXPECT_EQ(kind(kFrameMagic, 0, 0), FrameKind::kMessage);
  EXPECT_EQ(kind(kFrameMagic, kMaxUserTag, 1024), FrameKind::kMessage);
  EXPECT_EQ(kind(kFrameMagic, kBarrierTag, 1), FrameKind::kMessage);
  EXPECT_EQ(kind(kFrameMagic, kLaneBootstrapTag, 1), FrameKind::kMessage);
  EXPECT_EQ(kind(kBeatMagic, 0, 0), FrameKind::kBeat);
  EXPECT_EQ(kind(kBeatMagic, 0, 1), FrameKind::kBadMagic);  // a heartbeat carries nothing
  EXPECT_EQ(kind(kHelloMagic, 0, 0), FrameKind::kBadMagic);
  EXPECT_EQ(kind(kFrameMagic, -1, 0), FrameKind::kBadTag);
  EXPECT_EQ(kind(kFrameMagic, kHeartbeatTag, 0), FrameKind::kBadTag);  // mpi's, never tcp's
  EXPECT_EQ(kind(kFrameMagic, kLaneBootstrapTag + 1, 0), FrameKind::kBadTag);
  EXPECT_EQ(kind(kFrameMagic, 0, 1025), FrameKind::kTooLarge);
  EXPECT_EQ(kind(kFrameMagic, 0, ~uint64_t{0}), FrameKind::kTooLarge);
}

struct Handshake {
  std::string secret = "s3cret";
  Digest job = job_digest("job a");
  Challenge challenge;
  Hello hello;
  std::vector<bool> claimed = std::vector<bool>(4, false);

  Handshake() {
    challenge.flags = kHasSecret;
    hello.rank = 2;
    hello.world_size = 4;
    hello.listen_port = 29501;
    hello.flags = kHasSecret;
    set_listen_host(hello, "10.0.0.2");
    std::memcpy(hello.job, job.data(), job.size());
    sign();
  }
  void sign() {
    const Digest mac = hello_mac(secret, challenge, hello);
    std::memcpy(hello.mac, mac.data(), mac.size());
  }
  HelloVerdict judge() const {
    return judge_hello(hello, challenge, Acceptor{secret, job.data(), 0, 4, 1, 3, claimed});
  }
};

TEST(TcpDecode, TheAcceptorAdmitsOnlyAnAuthenticatedRankItWaitsFor) {
  Handshake h;
  EXPECT_EQ(h.judge().status, AckStatus::kOk);
  EXPECT_EQ(h.judge().reason, "");

  Handshake v1;
  v1.hello.magic = kHelloMagicV1;
  EXPECT_EQ(v1.judge().status, AckStatus::kBadProtocol);
  EXPECT_NE(v1.judge().reason.find("hello version 1"), std::string::npos);

  Handshake wrong;
  wrong.secret = "other";  // the acceptor's secret differs from the one the hello was signed with
  EXPECT_EQ(wrong.judge().status, AckStatus::kWrongSecret);
  EXPECT_EQ(wrong.judge().reason, "wrong job secret");

  Handshake other_job;
  other_job.hello.job[0] ^= 1;
  other_job.sign();
  EXPECT_EQ(other_job.judge().status, AckStatus::kOtherJob);

  Handshake no_address;
  std::memset(no_address.hello.listen_host, 'x', sizeof(no_address.hello.listen_host));
  no_address.sign();
  EXPECT_EQ(no_address.judge().status, AckStatus::kBadProtocol);
  EXPECT_EQ(no_address.judge().reason, "its hello announces no valid listener address");

  Handshake world;
  world.hello.world_size = 3;
  world.sign();
  const HelloVerdict w = world.judge();
  EXPECT_EQ(w.status, AckStatus::kWorldSize);
  EXPECT_EQ(w.fatal,
            "tcp rendezvous: rank 2 was started with world size 3 but rank 0 with world size 4; "
            "start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");

  Handshake rank;
  rank.hello.rank = 0;
  rank.sign();
  EXPECT_EQ(rank.judge().status, AckStatus::kBadRank);
  EXPECT_EQ(rank.judge().reason, "it announced rank 0, but rank 0 accepts only ranks 1..3 here");
  EXPECT_TRUE(rank.judge().fatal.empty());

  Handshake twice;
  twice.claimed[2] = true;
  EXPECT_EQ(twice.judge().status, AckStatus::kDuplicateRank);
}

TEST(TcpDecode, TheConnectorChecksTheChallengeAndTheAck) {
  Handshake h;
  const Connector connector{
      h.secret, h.job.data(), 2, 4, "10.0.0.1:29500", "the master (rank 0)", "10.0.0.1:29500"};
  EXPECT_EQ(what_of([&] { check_challenge(h.challenge, connector); }), "");
  Challenge old = h.challenge;
  old.version = 4;
  EXPECT_EQ(what_of([&] { check_challenge(old, connector); }),
            "tcp rendezvous: rank 2 connected to the master (rank 0) at 10.0.0.1:29500, which does "
            "not speak the pipemat rendezvous protocol 5; is another program or an older pipemat "
            "listening there?");

  Ack ack;
  const Digest mac = ack_mac(h.secret, h.challenge, h.hello, 0);
  std::memcpy(ack.mac, mac.data(), mac.size());
  // The error of the ack `ack` changed by `change`.
  const auto ack_error = [&](const std::function<void(Ack&)>& change) {
    Ack changed = ack;
    change(changed);
    return what_of([&] { check_ack(changed, h.challenge, h.hello, connector); });
  };
  EXPECT_EQ(ack_error([](Ack&) {}), "");
  EXPECT_NE(ack_error([](Ack& a) {
              a.mac[0] ^= 1;
            }).find("accepted rank 2 but could not prove the job secret"),
            std::string::npos);
  EXPECT_EQ(ack_error([](Ack& a) { a.status = static_cast<uint32_t>(AckStatus::kDuplicateRank); }),
            "tcp rendezvous: the master (rank 0) at 10.0.0.1:29500 refused rank 2: another process "
            "already joined as rank 2; give every process a distinct PIPEMAT_RANK / --rank");
  EXPECT_NE(ack_error([](Ack& a) { a.status = 77; }).find("protocol mismatch (status 77)"),
            std::string::npos);
  EXPECT_NE(ack_error([](Ack& a) { a.magic = 0; }).find("its answer is not a pipemat ack"),
            std::string::npos);
}

TEST(TcpDecode, ARankTableEntryIsAnAddressOrAnErrorNamingTheRank) {
  TableEntry entry;
  entry.port = 29501;
  std::strcpy(entry.host, "10.0.0.2");
  const TableAddress address = table_address(entry, 2);
  EXPECT_EQ(address.host, "10.0.0.2");
  EXPECT_EQ(address.port, 29501);
  std::strcpy(entry.host, "::1");
  EXPECT_EQ(table_address(entry, 2).host, "::1");

  entry.port = 70000;  // read as 4464 before: another port, silently
  EXPECT_EQ(what_of([&] { table_address(entry, 2); }),
            "tcp rendezvous: the rank table from the master gives rank 2 no address to connect to "
            "(port 70000); the master is another program or an incompatible pipemat");
  entry.port = 29501;
  std::strcpy(entry.host, "example.org");
  EXPECT_NE(what_of([&] { table_address(entry, 3); }).find("gives rank 3 no address"),
            std::string::npos);
  std::memset(entry.host, '1', sizeof(entry.host));  // no NUL within the entry
  EXPECT_NE(what_of([&] { table_address(entry, 1); }).find("(host of 60 bytes)"),
            std::string::npos);
}

}  // namespace
}  // namespace pipemat::comm::detail::tcp
