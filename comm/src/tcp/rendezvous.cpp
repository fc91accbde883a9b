// The blocking steps of the tcp rendezvous: awaiting one Asio operation against the deadline,
// connecting with retries, the acceptor side of the handshake for many connections at once,
// the connector side, and rank 0's listener on the master address.

#include "tcp/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "common.h"
#include "pipemat/core/error.h"

namespace pipemat::comm::detail::tcp {
namespace {

// The cancel of await() for an operation on `closable` (a socket or an acceptor): closing it
// completes the pending operation with operation_aborted; an error of close() changes nothing.
template <typename Closable>
auto close_of(Closable& closable) {
  return [&closable] {
    error_code ignored;
    closable.close(ignored);
  };
}

}  // namespace

template <typename Start, typename Cancel>
error_code Rendezvous::await(Start&& start, Cancel&& cancel, const std::string& what,
                             Clock::time_point deadline) {
  bool done = false;
  error_code result;
  start([&](const error_code& ec, auto&&...) {
    result = ec;
    done = true;
  });
  io_.restart();
  while (!done) {
    io_.run_one_until(deadline);
    if (!done && Clock::now() >= deadline) {
      cancel();
      io_.restart();
      while (!done) io_.run_one();  // NOLINT(bugprone-infinite-loop): set by the handler
      if (result == asio::error::operation_aborted) result = asio::error::timed_out;
      return result;
    }
  }
  return result;
}

template <typename Start, typename Cancel>
error_code Rendezvous::await(Start&& start, Cancel&& cancel, const std::string& what) {
  return await(std::forward<Start>(start), std::forward<Cancel>(cancel), what, deadline_);
}

void Rendezvous::fail(const std::string& what, const error_code& ec) const {
  if (ec == asio::error::timed_out || Clock::now() >= deadline_) {
    PIPEMAT_THROW(TimeoutError, "tcp rendezvous of rank ", options_.rank, " (world size ",
                  options_.world_size, ", master ", options_.master, ") timed out after ",
                  options_.timeout.count(), " ms ", what,
                  ". Start every rank with the same PIPEMAT_WORLD_SIZE, PIPEMAT_MASTER and "
                  "PIPEMAT_JOB_SECRET, or raise the timeout (PIPEMAT_COMM_TIMEOUT).");
  }
  PIPEMAT_THROW(CommError, "tcp rendezvous of rank ", options_.rank, " failed ", what, ": ",
                ec.message());
}

tcp::socket Rendezvous::connect(const std::string& host, uint16_t port, const std::string& whom) {
  error_code last;
  bool closed_early = false;  // the last attempt's connection closed before its first byte
  const auto start = Clock::now();
  int attempt = 0;
  for (attempt = 1; attempt <= options_.connect_retries; ++attempt) {
    tcp::resolver resolver(io_);
    error_code ec;
    auto endpoints = resolver.resolve(host, std::to_string(port), ec);
    closed_early = false;
    if (!ec) {
      for (const auto& entry : endpoints) {
        closed_early = false;
        tcp::socket socket(io_);
        ec = await([&](auto handler) { socket.async_connect(entry.endpoint(), handler); },
                   close_of(socket), "connecting");
        // The acceptor speaks first (its challenge). A connection closed before any byte of it
        // counts as refused: a relay between the hosts (a proxy, a port forward) accepts at
        // once and closes when the rank behind it does not listen yet.
        if (!ec) {
          ec = await([&](auto handler) { socket.async_wait(tcp::socket::wait_read, handler); },
                     close_of(socket), "waiting for the first byte");
        }
        if (!ec && socket.available(ec) == 0 && !ec) {
          ec = asio::error::connection_refused;
          closed_early = true;
        }
        if (!ec) {
          socket.set_option(tcp::no_delay(true));
          return socket;
        }
        if (Clock::now() >= deadline_) break;
      }
    }
    last = ec;
    if (attempt == options_.connect_retries ||
        Clock::now() + options_.connect_retry_interval >= deadline_) {
      break;
    }
    std::this_thread::sleep_for(options_.connect_retry_interval);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  PIPEMAT_THROW(CommError, "tcp transport: rank ", options_.rank, " could not connect to ", whom,
                " at ", host, ":", port, " after ", std::min(attempt, options_.connect_retries),
                " attempts over ", static_cast<int>(seconds * 10) / 10.0, " s (last error: ",
                closed_early ? "accepted, then closed before the first byte" : last.message(),
                "). Check that rank 0 is running, that --master / PIPEMAT_MASTER names its "
                "host:port, and that the port is reachable.");
}

void Rendezvous::write(tcp::socket& socket, const void* data, size_t size,
                       const std::string& what) {
  auto ec =
      await([&](auto handler) { asio::async_write(socket, asio::buffer(data, size), handler); },
            close_of(socket), what);
  if (ec) fail(what, ec);
}

void Rendezvous::read(tcp::socket& socket, void* data, size_t size, const std::string& what) {
  auto ec =
      await([&](auto handler) { asio::async_read(socket, asio::buffer(data, size), handler); },
            close_of(socket), what);
  if (ec) fail(what, ec);
}

tcp::socket Rendezvous::accept(tcp::acceptor& acceptor, const std::string& what) {
  tcp::socket socket(io_);
  auto ec = await([&](auto handler) { acceptor.async_accept(socket, handler); }, close_of(acceptor),
                  what);
  if (ec) fail(what, ec);
  socket.set_option(tcp::no_delay(true));
  return socket;
}

std::vector<Rendezvous::Joined> Rendezvous::accept_ranks(tcp::acceptor& acceptor, int lo, int hi,
                                                         const std::string& to_where) {
  struct Incoming {
    explicit Incoming(asio::io_context& io) : socket(io), timer(io) {}
    tcp::socket socket;
    asio::steady_timer timer;
    std::string from = "an unknown address";
    std::string address;  // `from` without the port
    Challenge challenge;
    Hello hello;
    Ack ack;
    int claimed = -1;       // the rank it holds while its ack is being written
    bool finished = false;  // joined or dropped
  };
  const int count = hi - lo + 1;
  const bool has_secret = !options_.secret.empty();
  const auto handshake_timeout = std::min(options_.handshake_timeout, options_.timeout);
  std::vector<Joined> joined;
  std::vector<bool> claimed(static_cast<size_t>(options_.world_size), false);
  std::vector<std::shared_ptr<Incoming>> incoming;
  std::string fatal;
  error_code accept_error;
  int dropped = 0;
  std::string last_drop;

  auto drop = [&](Incoming& in, const std::string& reason) {
    if (in.finished) return;
    in.finished = true;
    if (in.claimed >= 0) claimed[static_cast<size_t>(in.claimed)] = false;
    in.timer.cancel();
    ++dropped;
    last_drop = concat("from ", in.from, ": ", reason);
    std::fprintf(stderr,
                 "pipemat tcp: rank %d dropped a connection from %s during rendezvous: %s\n",
                 options_.rank, in.from.c_str(), reason.c_str());
  };
  auto close = [](Incoming& in) {
    error_code ignored;
    in.socket.close(ignored);
  };
  // The start of the handshake's write handlers: true when the connection is done with, because
  // it finished already or because `what` failed with `ec` (then it is dropped and closed).
  auto stop_after = [&](Incoming& in, const error_code& ec, const char* what) {
    if (in.finished) return true;
    if (!ec) return false;
    drop(in, concat(what, " failed (", ec.message(), ")"));
    close(in);
    return true;
  };

  auto judge = [&](const std::shared_ptr<Incoming>& in) {
    const Hello& h = in->hello;
    AckStatus status = AckStatus::kOk;
    std::string reason;
    if (h.magic == kHelloMagicV1) {
      status = AckStatus::kBadProtocol;
      reason =
          "it speaks the unauthenticated rendezvous of an older pipemat (hello version 1); "
          "start every rank from the same pipemat build";
    } else if (h.magic != kHelloMagic) {
      status = AckStatus::kBadProtocol;
      reason = "not a pipemat hello (bad magic); is another program connecting to this port?";
    } else if (h.version != kProtocolVersion) {
      status = AckStatus::kBadProtocol;
      reason = concat("rendezvous protocol version ", h.version, ", expected ", kProtocolVersion,
                      "; start every rank from the same pipemat build");
    } else if (const Digest mac = hello_mac(options_.secret, in->challenge, h);
               !equal_digest(mac.data(), h.mac, mac.size())) {
      status = AckStatus::kWrongSecret;
      reason = "wrong job secret";
      if (((h.flags & kHasSecret) != 0) != has_secret) {
        reason += concat(" (it has ", secret_state((h.flags & kHasSecret) != 0), ", rank ",
                         options_.rank, " has ", secret_state(has_secret), ")");
      }
    } else if (const std::string host = announced_host(h); host.empty()) {
      status = AckStatus::kBadProtocol;
      reason = "its hello announces no valid listener address";
    } else if (h.world_size != options_.world_size) {
      status = AckStatus::kWorldSize;
      reason = concat("rank ", h.rank, " was started with world size ", h.world_size);
      fatal = concat("tcp rendezvous: rank ", h.rank, " was started with world size ", h.world_size,
                     " but rank ", options_.rank, " with world size ", options_.world_size,
                     "; start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");
    } else if (h.rank < lo || h.rank > hi) {
      status = AckStatus::kBadRank;
      reason = concat("it announced rank ", h.rank, ", but rank ", options_.rank,
                      " accepts only ranks ", lo, "..", hi, " here");
    } else if (claimed[static_cast<size_t>(h.rank)]) {
      status = AckStatus::kDuplicateRank;
      reason = concat("it claims rank ", h.rank,
                      ", which another process already holds; give every process a distinct "
                      "PIPEMAT_RANK / --rank");
    }
    in->ack.status = static_cast<uint32_t>(status);
    if (status != AckStatus::kOk) {
      // The refusal tells a misconfigured rank why at once; it reveals nothing of the secret.
      drop(*in, reason);
      asio::async_write(in->socket, asio::buffer(&in->ack, sizeof(Ack)),
                        [in, close](const error_code&, size_t) { close(*in); });
      return;
    }
    in->claimed = h.rank;
    claimed[static_cast<size_t>(h.rank)] = true;
    const Digest mac = ack_mac(options_.secret, in->challenge, h, in->ack.status);
    std::memcpy(in->ack.mac, mac.data(), mac.size());
    asio::async_write(in->socket, asio::buffer(&in->ack, sizeof(Ack)),
                      [&, in](const error_code& ec, size_t) {
                        if (stop_after(*in, ec, "sending the ack")) return;
                        in->finished = true;
                        in->timer.cancel();
                        joined.push_back(Joined{in->hello, std::move(in->socket), in->address});
                      });
  };

  auto handshake = [&](const std::shared_ptr<Incoming>& in) {
    incoming.push_back(in);
    error_code ec;
    const auto remote = in->socket.remote_endpoint(ec);
    if (!ec) {
      in->address = remote.address().to_string();
      in->from = concat(in->address, ":", remote.port());
    }
    in->socket.set_option(tcp::no_delay(true), ec);
    in->challenge.flags = has_secret ? kHasSecret : 0;
    fill_nonce(in->challenge.nonce);
    in->timer.expires_after(handshake_timeout);
    in->timer.async_wait([&, in](const error_code& wait_ec) {
      if (wait_ec || in->finished) return;
      drop(*in, concat("no complete hello within ", handshake_timeout.count(), " ms"));
      close(*in);
    });
    asio::async_write(
        in->socket, asio::buffer(&in->challenge, sizeof(Challenge)),
        [&, in](const error_code& write_ec, size_t) {
          if (stop_after(*in, write_ec, "sending the challenge")) return;
          asio::async_read(
              in->socket, asio::buffer(&in->hello, sizeof(Hello)),
              [&, in](const error_code& read_ec, size_t n) {
                if (in->finished) return;
                if (read_ec) {
                  drop(*in, read_ec == asio::error::eof
                                ? concat("it closed the connection after ", n, " of the ",
                                         sizeof(Hello), " bytes of a hello")
                                : concat("reading its hello failed (", read_ec.message(), ")"));
                  close(*in);
                  return;
                }
                judge(in);
              });
        });
  };

  std::function<void()> start_accept = [&] {
    auto in = std::make_shared<Incoming>(io_);
    acceptor.async_accept(in->socket, [&, in](const error_code& ec) {
      if (ec == asio::error::operation_aborted) return;
      if (ec && ec != asio::error::connection_aborted) {
        accept_error = ec;
        return;
      }
      start_accept();
      if (!ec) handshake(in);
    });
  };

  start_accept();
  io_.restart();
  while (static_cast<int>(joined.size()) < count && fatal.empty() && !accept_error &&
         Clock::now() < deadline_) {
    io_.run_one_until(deadline_);
  }
  // Stop what is still in flight and let its handlers run out before the locals they use go.
  error_code ignored;
  acceptor.close(ignored);
  for (auto& in : incoming) {
    if (!in->finished) {
      drop(*in, "the rendezvous ended before it completed its hello");
      close(*in);
    }
    in->timer.cancel();
  }
  io_.restart();
  io_.run();

  if (!fatal.empty()) PIPEMAT_THROW(CommError, fatal);
  if (accept_error) fail(concat("accepting connections", to_where), accept_error);
  if (static_cast<int>(joined.size()) < count) {
    std::string missing;
    for (int r = lo; r <= hi; ++r) {
      if (!claimed[static_cast<size_t>(r)]) missing += (missing.empty() ? "" : ", ") + concat(r);
    }
    std::string what = concat("waiting for ranks ", missing, to_where);
    if (dropped > 0) {
      what += concat(" (dropped ", dropped, dropped == 1 ? " connection" : " connections",
                     " meanwhile, the last ", last_drop, ")");
    }
    fail(what, asio::error::timed_out);
  }
  return joined;
}

void Rendezvous::authenticate(tcp::socket& socket, Hello hello, const std::string& whom,
                              const std::string& address) {
  const bool has_secret = !options_.secret.empty();
  Challenge challenge;
  read(socket, &challenge, sizeof(challenge), concat("waiting for the challenge of ", whom));
  PIPEMAT_CHECK(challenge.magic == kChallengeMagic && challenge.version == kProtocolVersion,
                CommError, "tcp rendezvous: rank ", options_.rank, " connected to ", whom, " at ",
                address, ", which does not speak the pipemat rendezvous protocol ",
                kProtocolVersion, "; is another program or an older pipemat listening there?");
  hello.flags = has_secret ? kHasSecret : 0;
  fill_nonce(hello.nonce);
  const Digest mac = hello_mac(options_.secret, challenge, hello);
  std::memcpy(hello.mac, mac.data(), mac.size());
  write(socket, &hello, sizeof(hello), concat("sending a hello to ", whom));
  Ack ack;
  read(socket, &ack, sizeof(ack), concat("waiting for ", whom, " to accept the hello"));
  const std::string prefix =
      concat("tcp rendezvous: ", whom, " at ", address, " refused rank ", options_.rank, ": ");
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
                    options_.world_size,
                    "; start every rank with the same PIPEMAT_WORLD_SIZE / --world-size");
    case AckStatus::kBadRank:
      PIPEMAT_THROW(CommError, prefix, "rank ", options_.rank,
                    " is not expected to connect there (check PIPEMAT_RANK / --rank)");
    case AckStatus::kDuplicateRank:
      PIPEMAT_THROW(CommError, prefix, "another process already joined as rank ", options_.rank,
                    "; give every process a distinct PIPEMAT_RANK / --rank");
    default:
      PIPEMAT_THROW(CommError, prefix, "protocol mismatch (status ", ack.status,
                    "); start every rank from the same pipemat build");
  }
  const Digest proof = ack_mac(options_.secret, challenge, hello, ack.status);
  PIPEMAT_CHECK(equal_digest(proof.data(), ack.mac, proof.size()), CommError,
                "tcp rendezvous: ", whom, " at ", address, " accepted rank ", options_.rank,
                " but could not prove the job secret: it has a different PIPEMAT_JOB_SECRET, or "
                "another program is listening on that port");
}

tcp::acceptor listen_on_master(asio::io_context& io, const std::string& host, uint16_t port,
                               const std::string& master) {
  tcp::resolver resolver(io);
  error_code ec;
  auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  PIPEMAT_CHECK(!ec && !endpoints.empty(), ConfigError, "tcp transport: rank 0 cannot resolve ",
                "the host '", host, "' of master address '", master, "' (", ec.message(),
                "); set --master / PIPEMAT_MASTER to host:port of this machine");
  std::string addresses;
  error_code last;
  bool only_not_local = true;
  for (const auto& entry : endpoints) {
    addresses += (addresses.empty() ? "" : ", ") + entry.endpoint().address().to_string();
    tcp::acceptor acceptor(io);
    acceptor.open(entry.endpoint().protocol(), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(entry.endpoint(), ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (!ec) return acceptor;
    last = ec;
    if (ec != boost::system::errc::address_not_available) only_not_local = false;
  }
  PIPEMAT_CHECK(!only_not_local, ConfigError, "tcp transport: the master host '", host, "' (",
                addresses, ") of master address '", master,
                "' is not an address of this machine, so rank 0 cannot listen there; run rank 0 "
                "on that host or set --master / PIPEMAT_MASTER to one of its addresses "
                "(127.0.0.1:port for a single machine)");
  PIPEMAT_THROW(CommError, "tcp transport: rank 0 could not listen on port ", port, " of master ",
                master, " (", last.message(), "); choose a free port in --master / PIPEMAT_MASTER");
}

}  // namespace pipemat::comm::detail::tcp
