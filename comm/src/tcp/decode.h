#pragma once
// What a rank makes of the bytes a peer sent (private): the frame header of every message, the
// acceptor's judgement of a hello, the connector's of a challenge and an ack, and the entries of
// the rank table. Pure functions over the structs of tcp/wire.h, with no socket: the read loop
// (tcp/core_recv.cpp) and the rendezvous (tcp/rendezvous.cpp, tcp/transport.cpp) call them, and
// so does the fuzz target of the wire (tests/fuzz/tcp_wire_fuzz.cpp), directly.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tcp/wire.h"

namespace pipemat::comm::detail::tcp {

// What a frame header announces, judged before anything is allocated or read.
enum class FrameKind {
  kMessage,   // a message: header.size bytes of payload with header.tag follow
  kBeat,      // a heartbeat, no payload (Note [Liveness of a peer])
  kBadMagic,  // not a pipemat frame: the stream is corrupt
  kBadTag,    // a tag no pipemat rank sends (Note [Tags on the wire] in common.h)
  kTooLarge,  // a payload above the receiver's max_message_bytes
};
FrameKind frame_kind(const FrameHeader& header, size_t max_message_bytes);

// What the acceptor of a rendezvous connection knows when a hello comes in.
struct Acceptor {
  const std::string& secret;         // TransportOptions::secret
  const uint8_t* job = nullptr;      // its job digest (32 bytes)
  int rank = 0;                      // the acceptor's own rank
  int world_size = 0;                // its world size
  int lo = 0, hi = 0;                // the ranks it accepts on this acceptor
  const std::vector<bool>& claimed;  // [world_size]: ranks that joined already
};

// The acceptor's answer to a complete hello sent in answer to `challenge` (Note [Rendezvous
// handshake]): kOk, or the status of the refusal and its reason for the log. `fatal` (else
// empty) is the error that ends the rendezvous: an authenticated rank of another world size.
struct HelloVerdict {
  AckStatus status = AckStatus::kOk;
  std::string reason;
  std::string fatal;
};
HelloVerdict judge_hello(const Hello& hello, const Challenge& challenge, const Acceptor& acceptor);

// What the connector of a rendezvous connection knows, and whom it connected to (for messages).
struct Connector {
  const std::string& secret;     // TransportOptions::secret
  const uint8_t* job = nullptr;  // its job digest (32 bytes)
  int rank = 0;
  int world_size = 0;
  std::string master;   // TransportOptions::master
  std::string whom;     // "the master (rank 0)", "rank 2"
  std::string address;  // where it connected: "host:port"
};

// CommError unless `challenge` is a pipemat challenge of this protocol version.
void check_challenge(const Challenge& challenge, const Connector& connector);

// CommError unless `ack` accepts `hello` (sent in answer to `challenge`) and proves the secret;
// the error says why the acceptor refused it.
void check_ack(const Ack& ack, const Challenge& challenge, const Hello& hello,
               const Connector& connector);

// Where rank `rank` listens, as the rank table from the master says: CommError naming the rank
// when the entry is not a NUL-terminated IP address and a port 1..65535.
struct TableAddress {
  std::string host;
  uint16_t port = 0;
};
TableAddress table_address(const TableEntry& entry, int rank);

}  // namespace pipemat::comm::detail::tcp
