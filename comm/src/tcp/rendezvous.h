#pragma once
// The blocking steps of the tcp rendezvous (private): connecting, accepting and the handshake of
// Note [Rendezvous handshake] on both ends, each bounded by the rendezvous deadline.
//
// Rendezvous (the TcpTransport constructor, on the calling thread; TcpTransport::rendezvous in
// tcp/transport.cpp puts these steps together): rank 0 listens on the master host:port (that
// address only); every other rank connects to the master, opens its own listener on the local
// address of that connection and says hello (rank, world size, listen port); rank 0 answers with
// the table of all listeners. Then rank r connects to every rank 0 < s < r and accepts from
// every rank above it: exactly one connection per pair. Every connection starts with the
// authenticated handshake of Note [Rendezvous handshake].

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/comm/work.h"
#include "tcp/asio.h"
#include "tcp/wire.h"

namespace pipemat::comm::detail::tcp {

// Blocking rendezvous steps on the io_context of the core, each bounded by one deadline.
class Rendezvous {
 public:
  Rendezvous(asio::io_context& io, const TransportOptions& options)
      : io_(io),
        options_(options),
        deadline_(Clock::now() + options.timeout),
        job_(job_digest(options.job)) {}

  // Connects with retries (TransportOptions::connect_retries) and returns the socket once the
  // acceptor's first bytes arrived; a connection closed before them is retried like a refused
  // one.
  tcp::socket connect(const std::string& host, uint16_t port, const std::string& whom);
  void write(tcp::socket& socket, const void* data, size_t size, const std::string& what);
  void read(tcp::socket& socket, void* data, size_t size, const std::string& what);
  tcp::socket accept(tcp::acceptor& acceptor, const std::string& what);

  // A rank that completed the handshake on an acceptor.
  struct Joined {
    Hello hello;
    tcp::socket socket;
    std::string address;  // the address its connection comes from (no port)
  };

  // Accepts on `acceptor` until every rank lo..hi completed the handshake (Note [Rendezvous
  // handshake]); each connection is handled on its own with the handshake deadline, and one that
  // fails is dropped and reported on stderr. Throws TimeoutError at the rendezvous deadline
  // (naming the missing ranks and the last dropped connection), CommError for an authenticated
  // rank with another world size or a failing acceptor.
  std::vector<Joined> accept_ranks(tcp::acceptor& acceptor, int lo, int hi,
                                   const std::string& to_where);

  // The connecting side of Note [Rendezvous handshake] on a fresh connection to `whom` at
  // `address`. Throws CommError when the acceptor refuses the hello or cannot prove the secret.
  void authenticate(tcp::socket& socket, Hello hello, const std::string& whom,
                    const std::string& address);

 private:
  class Acceptance;  // the state of one accept_ranks call

  // Runs an async operation to completion or to the deadline; returns its error code
  // (asio::error::timed_out at the deadline). Callers turn a failure into an error with fail().
  template <typename Start, typename Cancel>
  error_code await(Start&& start, Cancel&& cancel, const std::string& what,
                   Clock::time_point deadline);

  template <typename Start, typename Cancel>
  error_code await(Start&& start, Cancel&& cancel, const std::string& what);

  [[noreturn]] void fail(const std::string& what, const error_code& ec) const;

  asio::io_context& io_;
  const TransportOptions& options_;
  const Clock::time_point deadline_;
  const Digest job_;  // job_digest(options.job)
};

// Listens on exactly the configured master host (every address it resolves to that is local).
tcp::acceptor listen_on_master(asio::io_context& io, const std::string& host, uint16_t port,
                               const std::string& master);

}  // namespace pipemat::comm::detail::tcp
