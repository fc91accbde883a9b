// What a rank makes of the bytes a peer sent: tcp/decode.h.

#include "tcp/decode.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>

#include "common.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail::tcp {

FrameKind frame_kind(const FrameHeader& header, size_t max_message_bytes) {
  if (header.magic == kBeatMagic && header.size == 0) return FrameKind::kBeat;
  if (header.magic != kFrameMagic) return FrameKind::kBadMagic;
  if (!is_transport_tag(header.tag)) return FrameKind::kBadTag;  // Note [Tags on the wire]
  // Checked before anything is allocated or read: the size is whatever the peer wrote.
  if (header.size > max_message_bytes) return FrameKind::kTooLarge;
  return FrameKind::kMessage;
}

HelloVerdict judge_hello(const Hello& h, const Challenge& challenge, const Acceptor& a) {
  const bool has_secret = !a.secret.empty();
  HelloVerdict v;
  const auto refuse = [&v](AckStatus status, std::string reason) {
    v.status = status;
    v.reason = std::move(reason);
    return v;
  };
  if (h.magic == kHelloMagicV1) {
    return refuse(AckStatus::kBadProtocol,
                  "it speaks the unauthenticated rendezvous of an older pipemat (hello version "
                  "1); start every rank from the same pipemat build");
  }
  if (h.magic != kHelloMagic) {
    return refuse(AckStatus::kBadProtocol,
                  "not a pipemat hello (bad magic); is another program connecting to this port?");
  }
  if (h.version != kProtocolVersion) {
    return refuse(AckStatus::kBadProtocol,
                  concat("rendezvous protocol version ", h.version, ", expected ", kProtocolVersion,
                         "; start every rank from the same pipemat build"));
  }
  if (const Digest mac = hello_mac(a.secret, challenge, h);
      !equal_digest(mac.data(), h.mac, mac.size())) {
    std::string reason = "wrong job secret";
    if (((h.flags & kHasSecret) != 0) != has_secret) {
      reason += concat(" (it has ", secret_state((h.flags & kHasSecret) != 0), ", rank ", a.rank,
                       " has ", secret_state(has_secret), ")");
    }
    return refuse(AckStatus::kWrongSecret, std::move(reason));
  }
  if (!equal_digest(h.job, a.job, sizeof(h.job))) {
    return refuse(AckStatus::kOtherJob,
                  concat(another_job(h.job, a.job, "this job's"),
                         ": a job started with another config, or another job on the same master "
                         "port"));
  }
  if (announced_host(h).empty()) {
    return refuse(AckStatus::kBadProtocol, "its hello announces no valid listener address");
  }
  if (h.world_size != a.world_size) {
    v.fatal = concat("tcp rendezvous: rank ", h.rank, " was started with world size ", h.world_size,
                     " but rank ", a.rank, " with world size ", a.world_size,
                     "; start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");
    return refuse(AckStatus::kWorldSize,
                  concat("rank ", h.rank, " was started with world size ", h.world_size));
  }
  if (h.rank < a.lo || h.rank > a.hi) {
    return refuse(AckStatus::kBadRank, concat("it announced rank ", h.rank, ", but rank ", a.rank,
                                              " accepts only ranks ", a.lo, "..", a.hi, " here"));
  }
  if (a.claimed[static_cast<size_t>(h.rank)]) {
    return refuse(AckStatus::kDuplicateRank,
                  concat("it claims rank ", h.rank,
                         ", which another process already holds; give every process a distinct "
                         "PIPEMAT_RANK / --rank"));
  }
  return v;
}

void check_challenge(const Challenge& challenge, const Connector& c) {
  PIPEMAT_CHECK(challenge.magic == kChallengeMagic && challenge.version == kProtocolVersion,
                CommError, "tcp rendezvous: rank ", c.rank, " connected to ", c.whom, " at ",
                c.address, ", which does not speak the pipemat rendezvous protocol ",
                kProtocolVersion, "; is another program or an older pipemat listening there?");
}

void check_ack(const Ack& ack, const Challenge& challenge, const Hello& hello, const Connector& c) {
  const bool has_secret = !c.secret.empty();
  const std::string prefix =
      concat("tcp rendezvous: ", c.whom, " at ", c.address, " refused rank ", c.rank, ": ");
  PIPEMAT_CHECK(ack.magic == kAckMagic, CommError, prefix,
                "its answer is not a pipemat ack; is another program listening there?");
  switch (static_cast<AckStatus>(ack.status)) {
    case AckStatus::kOk:
      break;
    case AckStatus::kWrongSecret:
      PIPEMAT_THROW(CommError, prefix, "wrong job secret (this rank has ", secret_state(has_secret),
                    ", there ", secret_state(challenge.flags & 1),
                    "). Start every rank of a job with the same PIPEMAT_JOB_SECRET "
                    "(pipemat-run --tcp sets one per job) or all without one.");
    case AckStatus::kWorldSize:
      PIPEMAT_THROW(CommError, prefix, "it runs a different world size than this rank's ",
                    c.world_size,
                    "; start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");
    case AckStatus::kOtherJob:
      PIPEMAT_THROW(CommError, prefix, another_job(challenge.job, c.job, "this rank's"),
                    ": every rank of a job must run the same config; is another job using "
                    "the master port ",
                    c.master, "? Give each job its own port (and PIPEMAT_JOB_SECRET)");
    case AckStatus::kBadRank:
      PIPEMAT_THROW(CommError, prefix, "rank ", c.rank,
                    " is not expected to connect there (check PIPEMAT_RANK / --rank)");
    case AckStatus::kDuplicateRank:
      PIPEMAT_THROW(CommError, prefix, "another process already joined as rank ", c.rank,
                    "; give every process a distinct PIPEMAT_RANK / --rank");
    default:
      PIPEMAT_THROW(CommError, prefix, "protocol mismatch (status ", ack.status,
                    "); start every rank from the same pipemat build");
  }
  const Digest proof = ack_mac(c.secret, challenge, hello, ack.status);
  PIPEMAT_CHECK(equal_digest(proof.data(), ack.mac, proof.size()), CommError,
                "tcp rendezvous: ", c.whom, " at ", c.address, " accepted rank ", c.rank,
                " but could not prove the job secret: it has a different PIPEMAT_JOB_SECRET, or "
                "another program is listening on that port");
}

TableAddress table_address(const TableEntry& entry, int rank) {
  const size_t n = strnlen(entry.host, sizeof(entry.host));
  const std::string host(entry.host, n);
  in6_addr parsed{};
  const bool ip = n < sizeof(entry.host) && (::inet_pton(AF_INET, host.c_str(), &parsed) == 1 ||
                                             ::inet_pton(AF_INET6, host.c_str(), &parsed) == 1);
  PIPEMAT_CHECK(ip && entry.port >= 1 && entry.port <= 65535, CommError,
                "tcp rendezvous: the rank table from the master gives rank ", rank,
                " no address to connect to (", ip ? "port " : "host of ",
                ip ? std::to_string(entry.port) : std::to_string(n) + " bytes",
                "); the master is another program or an incompatible pipemat");
  return {host, static_cast<uint16_t>(entry.port)};
}

}  // namespace pipemat::comm::detail::tcp
