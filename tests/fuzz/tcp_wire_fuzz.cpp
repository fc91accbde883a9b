// Fuzz target: the bytes a tcp peer sends (comm/src/tcp/decode.h: the rendezvous handshake of
// Note [Rendezvous handshake], the rank table, the frame headers of the data stream; Note [Fuzz
// targets] in tests/fuzz/CMakeLists.txt).
//
// The input is what one peer wrote, in the order a rank reads it:
//   1 byte of choices: bit 0 gives the hello a valid mac and this job's digest (so the fuzzer
//     reaches the checks after them), bit 1 the same for the ack, bit 2 claims rank 2 already;
//   a Challenge (80 bytes): the connector's check_challenge;
//   a Hello (184 bytes): the acceptor's judge_hello (rank 0 of 4 accepting ranks 1..3);
//   an Ack (40 bytes): the connector's check_ack;
//   4 rank table entries (64 bytes each): table_address;
//   then frames until the input ends: a FrameHeader (16 bytes) each, judged by frame_kind with a
//   limit of 1 MiB, and the payload of a message skipped.
// A refusal must be a CommError (or a verdict other than kOk), never a crash; what is accepted
// must be what the checks promise.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "fuzz_expect.h"
#include "tcp/decode.h"

namespace {

void expect(bool ok, const char* what) { pipemat::fuzz::expect(ok, "tcp wire", what); }

using namespace pipemat::comm::detail::tcp;

// Reads the next sizeof(T) bytes into `out`; false when the input ends first.
template <typename T>
bool next(const uint8_t*& data, size_t& size, T& out) {
  if (size < sizeof(T)) return false;
  std::memcpy(&out, data, sizeof(T));
  data += sizeof(T);
  size -= sizeof(T);
  return true;
}

const std::string kSecret = "fuzz secret";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint8_t choices = 0;
  if (!next(data, size, choices)) return 0;
  const pipemat::Digest job = job_digest("fuzz job");
  std::vector<bool> claimed(4, false);
  claimed[2] = (choices & 4) != 0;
  const Acceptor acceptor{kSecret, job.data(), 0, 4, 1, 3, claimed};
  const Connector connector{
      kSecret, job.data(), 1, 4, "127.0.0.1:29500", "the master (rank 0)", "127.0.0.1:29500"};

  Challenge challenge;
  if (!next(data, size, challenge)) return 0;
  try {
    check_challenge(challenge, connector);
    expect(challenge.magic == kChallengeMagic && challenge.version == kProtocolVersion,
           "an accepted challenge is one of this protocol");
  } catch (const pipemat::CommError&) {
  }

  Hello hello;
  if (!next(data, size, hello)) return 0;
  if (choices & 1) {
    std::memcpy(hello.job, job.data(), sizeof(hello.job));
    const pipemat::Digest mac = hello_mac(kSecret, challenge, hello);
    std::memcpy(hello.mac, mac.data(), mac.size());
  }
  const HelloVerdict verdict = judge_hello(hello, challenge, acceptor);
  if (verdict.status == AckStatus::kOk) {
    expect(hello.magic == kHelloMagic && hello.version == kProtocolVersion, "a hello of v5");
    expect(hello.world_size == 4 && hello.rank >= 1 && hello.rank <= 3 &&
               !claimed[static_cast<size_t>(hello.rank)],
           "an admitted rank is one the acceptor waits for");
    expect(!announced_host(hello).empty(), "an admitted rank announces its address");
    expect(verdict.reason.empty() && verdict.fatal.empty(), "no reason to admit");
  } else {
    expect(!verdict.reason.empty(), "a refusal says why");
    expect(verdict.fatal.empty() || verdict.status == AckStatus::kWorldSize,
           "only another world size ends the rendezvous");
  }

  Ack ack;
  if (!next(data, size, ack)) return 0;
  if (choices & 2) {
    ack.magic = kAckMagic;
    const pipemat::Digest mac = ack_mac(kSecret, challenge, hello, ack.status);
    std::memcpy(ack.mac, mac.data(), mac.size());
  }
  try {
    check_ack(ack, challenge, hello, connector);
    expect(ack.status == static_cast<uint32_t>(AckStatus::kOk), "an accepted ack says ok");
  } catch (const pipemat::CommError&) {
  }

  for (int rank = 0; rank < 4; ++rank) {
    TableEntry entry;
    if (!next(data, size, entry)) return 0;
    try {
      const TableAddress address = table_address(entry, rank);
      expect(!address.host.empty() && address.port >= 1, "an address to connect to");
    } catch (const pipemat::CommError&) {
    }
  }

  constexpr size_t kLimit = size_t{1} << 20;
  FrameHeader header;
  while (next(data, size, header)) {
    switch (frame_kind(header, kLimit)) {
      case FrameKind::kBeat:
        expect(header.size == 0, "a heartbeat has no payload");
        continue;
      case FrameKind::kMessage: {
        expect(header.magic == kFrameMagic && header.size <= kLimit &&
                   pipemat::comm::detail::is_transport_tag(header.tag),
               "a message within the limit, with a tag a rank sends");
        const size_t skip = std::min<size_t>(header.size, size);
        data += skip;
        size -= skip;
        continue;
      }
      case FrameKind::kBadMagic:
      case FrameKind::kBadTag:
      case FrameKind::kTooLarge:
        return 0;  // the read loop refuses the peer here
    }
    expect(false, "a frame kind");
  }
  return 0;
}
