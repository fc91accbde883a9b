#pragma once
// What the tcp backend writes on the wire (private): the frame header of every message, the
// structs of the authenticated rendezvous handshake and their MACs, the rank table, and the
// parsing of the master address.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "pipemat/core/digest.h"

namespace pipemat::comm::detail::tcp {

constexpr uint32_t kFrameMagic = 0x504d4331;      // "PMC1"
constexpr uint32_t kBeatMagic = 0x504d4231;       // "PMB1": a heartbeat, tag 0, size 0
constexpr uint32_t kHelloMagicV1 = 0x504d4831;    // "PMH1": the unauthenticated hello before v2
constexpr uint32_t kHelloMagic = 0x504d4832;      // "PMH2"
constexpr uint32_t kChallengeMagic = 0x504d4e31;  // "PMN1"
constexpr uint32_t kAckMagic = 0x504d4131;        // "PMA1"
// 3: the hello carries the listener address; 4: heartbeat frames (Note [Liveness of a peer]);
// 5: the challenge and the hello carry the job digest.
constexpr uint32_t kProtocolVersion = 5;
constexpr uint32_t kHasSecret = 1;  // flag: the sender has a job secret
constexpr size_t kNonceBytes = 32;

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  int32_t tag = 0;
  uint64_t size = 0;
};
static_assert(sizeof(FrameHeader) == 16, "frame header layout");

// Note [Rendezvous handshake]
// Every rendezvous connection (to the master and between ranks) is a challenge-response keyed with
// the job secret (TransportOptions::secret):
//   acceptor  -> Challenge {fresh random nonce N_a}
//   connector -> Hello {rank, world size, listener address and port, nonce N_c,
//                       mac = HMAC-SHA256(secret, "pipemat hello" || N_a || hello fields)}
//   acceptor  -> Ack {status, mac = HMAC-SHA256(secret, "pipemat ack" || N_c || N_a || rank ||
//                                               status)}
// Both the challenge and the hello carry the job digest (the SHA-256 of TransportOptions::job,
// which `pipemat train` sets to its config's digest): a connector of another job, with the
// secret or without one, is refused with kOtherJob, and both sides name both digests. Two jobs
// started by hand on one master port therefore never train together.
// The acceptor's fresh nonce makes a recorded hello useless later; the connector's nonce makes
// the acceptor prove the secret too, so a process squatting on the master port cannot pose as
// rank 0. The secret itself never goes over the wire. Without a secret the key is empty: the
// same exchange, checking nothing but the protocol (any local process may join; documented).
// The acceptor handles each connection on its own with a short deadline: a connection that is
// silent, sends garbage or fails a check is closed and reported on stderr, and the rendezvous
// goes on, except for an authenticated rank with another world size (a real misconfiguration).
struct Challenge {
  uint32_t magic = kChallengeMagic;
  uint32_t version = kProtocolVersion;
  uint32_t flags = 0;
  uint32_t reserved = 0;
  uint8_t nonce[kNonceBytes] = {};
  uint8_t job[32] = {};  // the acceptor's job digest
};
static_assert(sizeof(Challenge) == 80, "challenge layout");

struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t version = kProtocolVersion;
  int32_t rank = -1;
  int32_t world_size = -1;
  uint32_t listen_port = 0;
  uint32_t flags = 0;
  // The address the connector's listener is bound to, as text (NUL-terminated): the rank table
  // announces it (Note [Announced listener address]).
  char listen_host[64] = {};
  uint8_t nonce[kNonceBytes] = {};
  uint8_t job[32] = {};  // the connector's job digest
  uint8_t mac[32] = {};  // last: the mac covers everything before it
};
static_assert(sizeof(Hello) == 184 && offsetof(Hello, mac) == 152, "hello layout");

enum class AckStatus : uint32_t {
  kOk = 0,
  kWrongSecret = 1,
  kWorldSize = 2,
  kBadRank = 3,
  kDuplicateRank = 4,
  kBadProtocol = 5,
  kOtherJob = 6,
};

struct Ack {
  uint32_t magic = kAckMagic;
  uint32_t status = 0;
  uint8_t mac[32] = {};
};
static_assert(sizeof(Ack) == 40, "ack layout");

// The mac of `hello` in answer to `challenge` (Note [Rendezvous handshake]).
Digest hello_mac(const std::string& secret, const Challenge& challenge, const Hello& hello);

// The mac of an ack with `status` for `hello` in answer to `challenge`.
Digest ack_mac(const std::string& secret, const Challenge& challenge, const Hello& hello,
               uint32_t status);

// The job digest of TransportOptions::job: its SHA-256.
Digest job_digest(const std::string& job);

// "it belongs to another job (job digest <theirs>, <whose> <ours>)": the refusal of a rank of
// another job. Each digest is named by its first 12 hex digits, or by as many as it takes to
// reach the first digit where the two differ (all 64 where they differ only at the end): two
// digests never read the same.
std::string another_job(const uint8_t* theirs, const uint8_t* ours, const char* whose);

// Fills `out` with kNonceBytes random bytes; throws CommError when getrandom() fails.
void fill_nonce(uint8_t* out);

// Note [Announced listener address]
// The rank table gives, for every rank, the address its listener is bound to as the rank itself
// announced it in its hello, not the address the master saw the connection come from. Without
// anything between the hosts the two are the same (the listener is bound to the address the rank
// reaches the master from). With a proxy or a router that relays connections between hosts, the
// master sees the relay's address, which does not lead to the rank; the rank's own address does:
// the relay forwards connections to it like any other (the cross-host test of docs/reliability.md
// runs through such a relay).
// Writes `host` (an IP address as text, at most 59 characters: a TableEntry) into the hello.
void set_listen_host(Hello& hello, const std::string& host);
// The hello's listener address when it is a NUL-terminated IPv4 or IPv6 address, else "".
std::string announced_host(const Hello& hello);

// "a job secret" / "no job secret", for the messages of a wrong secret.
std::string secret_state(bool has_secret);

// One entry of the rank table that rank 0 sends every rank after the hellos: where rank r
// listens for the ranks above it.
struct TableEntry {
  uint32_t port = 0;
  char host[60] = {};
};
static_assert(sizeof(TableEntry) == 64, "table entry layout");

// Splits TransportOptions::master ("host:port", "[v6]:port") into host and port; throws
// ConfigError when it is not one.
std::pair<std::string, uint16_t> parse_master(const std::string& master);

}  // namespace pipemat::comm::detail::tcp
