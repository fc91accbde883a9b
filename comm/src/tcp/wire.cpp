// The MACs of the rendezvous handshake, its nonces, the listener address a hello announces, and
// the parsing of the master address.

#include "tcp/wire.h"

#include <arpa/inet.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "pipemat/core/error.h"
#include "pipemat/core/parse.h"

namespace pipemat::comm::detail::tcp {

Digest hello_mac(const std::string& secret, const Challenge& challenge, const Hello& hello) {
  HmacSha256 mac(secret);
  mac.update("pipemat hello", 13);
  mac.update(challenge.nonce, kNonceBytes);
  mac.update(&hello, offsetof(Hello, mac));
  return mac.finish();
}

Digest ack_mac(const std::string& secret, const Challenge& challenge, const Hello& hello,
               uint32_t status) {
  HmacSha256 mac(secret);
  mac.update("pipemat ack", 11);
  mac.update(hello.nonce, kNonceBytes);
  mac.update(challenge.nonce, kNonceBytes);
  mac.update(&hello.rank, sizeof(hello.rank));
  mac.update(&status, sizeof(status));
  return mac.finish();
}

Digest job_digest(const std::string& job) {
  Sha256 sha;
  sha.update(job.data(), job.size());
  return sha.finish();
}

std::string another_job(const uint8_t* theirs, const uint8_t* ours, const char* whose) {
  Digest a{}, b{};
  std::memcpy(a.data(), theirs, a.size());
  std::memcpy(b.data(), ours, b.size());
  const std::string hex_a = to_hex(a), hex_b = to_hex(b);
  size_t same = 0;
  while (same < hex_a.size() && hex_a[same] == hex_b[same]) ++same;
  const size_t shown = std::max<size_t>(12, same + 1);
  return ::pipemat::detail::concat("it belongs to another job (job digest ", hex_a.substr(0, shown),
                                   ", ", whose, " ", hex_b.substr(0, shown), ")");
}

void fill_nonce(uint8_t* out) {
  size_t filled = 0;
  while (filled < kNonceBytes) {
    const ssize_t n = ::getrandom(out + filled, kNonceBytes - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    PIPEMAT_CHECK(n > 0, CommError, "tcp rendezvous: getrandom() failed (", std::strerror(errno),
                  "); cannot make a handshake nonce");
    filled += static_cast<size_t>(n);
  }
}

void set_listen_host(Hello& hello, const std::string& host) {
  constexpr size_t kLongest = sizeof(TableEntry{}.host) - 1;  // what the rank table holds
  PIPEMAT_CHECK(host.size() <= kLongest, CommError, "tcp rendezvous: listener address '", host,
                "' is longer than the ", kLongest, " characters the rank table holds");
  std::memset(hello.listen_host, 0, sizeof(hello.listen_host));
  std::memcpy(hello.listen_host, host.data(), host.size());
}

std::string announced_host(const Hello& hello) {
  const size_t n = strnlen(hello.listen_host, sizeof(hello.listen_host));
  if (n == sizeof(hello.listen_host)) return "";
  std::string host(hello.listen_host, n);
  in6_addr parsed{};
  const bool ip = ::inet_pton(AF_INET, host.c_str(), &parsed) == 1 ||
                  ::inet_pton(AF_INET6, host.c_str(), &parsed) == 1;
  return ip ? host : "";
}

std::string secret_state(bool has_secret) { return has_secret ? "a job secret" : "no job secret"; }

std::pair<std::string, uint16_t> parse_master(const std::string& master) {
  if (const auto address = parse_host_port(master)) return {address->host, address->port};
  const auto colon = master.rfind(':');
  PIPEMAT_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < master.size(), ConfigError,
                "tcp transport: master address '", master,
                "' is not host:port (e.g. 127.0.0.1:29500); set --master or PIPEMAT_MASTER");
  PIPEMAT_THROW(ConfigError, "tcp transport: port '", master.substr(colon + 1),
                "' in master address '", master, "' is not a port number 1..65535");
}

}  // namespace pipemat::comm::detail::tcp
