// The blocking steps of the tcp rendezvous: awaiting one Asio operation against the deadline,
// connecting with retries, the acceptor side of the handshake for many connections at once,
// the connector side, and rank 0's listener on the master address.

#include "tcp/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "common.h"
#include "pipemat/core/error.h"
#include "tcp/decode.h"

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

// One accept_ranks call: the connections in flight on the acceptor and what they settled.
class Rendezvous::Acceptance {
 public:
  Acceptance(Rendezvous& rendezvous, tcp::acceptor& acceptor, int lo, int hi)
      : rv_(rendezvous),
        options_(rendezvous.options_),
        acceptor_(acceptor),
        lo_(lo),
        hi_(hi),
        has_secret_(!options_.secret.empty()),
        handshake_timeout_(std::min(options_.handshake_timeout, options_.timeout)),
        claimed_(static_cast<size_t>(options_.world_size), false) {}

  std::vector<Joined> run(const std::string& to_where);

 private:
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
  using IncomingPtr = std::shared_ptr<Incoming>;

  void start_accept();
  void handshake(const IncomingPtr& in);
  void read_hello(const IncomingPtr& in);
  void judge(const IncomingPtr& in);
  AckStatus check_hello(const Incoming& in, std::string& reason);
  void refuse(const IncomingPtr& in, const std::string& reason);
  void admit(const IncomingPtr& in);
  void drop(Incoming& in, const std::string& reason);
  bool stop_after(Incoming& in, const error_code& ec, const char* what);
  void stop_in_flight();
  [[noreturn]] void throw_failure(const std::string& to_where);

  static void close(Incoming& in) {
    error_code ignored;
    in.socket.close(ignored);
  }

  Rendezvous& rv_;
  const TransportOptions& options_;
  tcp::acceptor& acceptor_;
  const int lo_;
  const int hi_;
  const bool has_secret_;
  const std::chrono::milliseconds handshake_timeout_;
  std::vector<Joined> joined_;
  std::vector<bool> claimed_;
  std::vector<IncomingPtr> incoming_;
  std::string fatal_;
  error_code accept_error_;
  int dropped_ = 0;
  std::string last_drop_;
};

std::vector<Rendezvous::Joined> Rendezvous::Acceptance::run(const std::string& to_where) {
  const int count = hi_ - lo_ + 1;
  start_accept();
  rv_.io_.restart();
  while (static_cast<int>(joined_.size()) < count && fatal_.empty() && !accept_error_ &&
         Clock::now() < rv_.deadline_) {
    rv_.io_.run_one_until(rv_.deadline_);
  }
  stop_in_flight();
  if (!fatal_.empty()) PIPEMAT_THROW(CommError, fatal_);
  if (accept_error_) rv_.fail(concat("accepting connections", to_where), accept_error_);
  if (static_cast<int>(joined_.size()) < count) throw_failure(to_where);
  return std::move(joined_);
}

void Rendezvous::Acceptance::start_accept() {
  auto in = std::make_shared<Incoming>(rv_.io_);
  acceptor_.async_accept(in->socket, [this, in](const error_code& ec) {
    if (ec == asio::error::operation_aborted) return;
    if (ec && ec != asio::error::connection_aborted) {
      accept_error_ = ec;
      return;
    }
    start_accept();
    if (!ec) handshake(in);
  });
}

// Sends the challenge of a fresh connection and arms its handshake deadline.
void Rendezvous::Acceptance::handshake(const IncomingPtr& in) {
  incoming_.push_back(in);
  error_code ec;
  const auto remote = in->socket.remote_endpoint(ec);
  if (!ec) {
    in->address = remote.address().to_string();
    in->from = concat(in->address, ":", remote.port());
  }
  in->socket.set_option(tcp::no_delay(true), ec);
  in->challenge.flags = has_secret_ ? kHasSecret : 0;
  fill_nonce(in->challenge.nonce);
  std::memcpy(in->challenge.job, rv_.job_.data(), sizeof(in->challenge.job));
  in->timer.expires_after(handshake_timeout_);
  in->timer.async_wait([this, in](const error_code& wait_ec) {
    if (wait_ec || in->finished) return;
    drop(*in, concat("no complete hello within ", handshake_timeout_.count(), " ms"));
    close(*in);
  });
  asio::async_write(in->socket, asio::buffer(&in->challenge, sizeof(Challenge)),
                    [this, in](const error_code& write_ec, size_t) {
                      if (stop_after(*in, write_ec, "sending the challenge")) return;
                      read_hello(in);
                    });
}

void Rendezvous::Acceptance::read_hello(const IncomingPtr& in) {
  asio::async_read(in->socket, asio::buffer(&in->hello, sizeof(Hello)),
                   [this, in](const error_code& read_ec, size_t n) {
                     if (in->finished) return;
                     if (read_ec) {
                       drop(*in,
                            read_ec == asio::error::eof
                                ? concat("it closed the connection after ", n, " of the ",
                                         sizeof(Hello), " bytes of a hello")
                                : concat("reading its hello failed (", read_ec.message(), ")"));
                       close(*in);
                       return;
                     }
                     judge(in);
                   });
}

void Rendezvous::Acceptance::judge(const IncomingPtr& in) {
  std::string reason;
  const AckStatus status = check_hello(*in, reason);
  in->ack.status = static_cast<uint32_t>(status);
  if (status != AckStatus::kOk) {
    refuse(in, reason);
  } else {
    admit(in);
  }
}

// The status of the ack for a complete hello, with the reason of a refusal; sets fatal_ for an
// authenticated rank with another world size.
AckStatus Rendezvous::Acceptance::check_hello(const Incoming& in, std::string& reason) {
  const Acceptor acceptor{
      options_.secret, rv_.job_.data(), options_.rank, options_.world_size, lo_, hi_, claimed_};
  HelloVerdict verdict = judge_hello(in.hello, in.challenge, acceptor);
  reason = std::move(verdict.reason);
  if (!verdict.fatal.empty()) fatal_ = std::move(verdict.fatal);
  return verdict.status;
}

// The refusal tells a misconfigured rank why at once; it reveals nothing of the secret.
void Rendezvous::Acceptance::refuse(const IncomingPtr& in, const std::string& reason) {
  drop(*in, reason);
  asio::async_write(in->socket, asio::buffer(&in->ack, sizeof(Ack)),
                    [in](const error_code&, size_t) { close(*in); });
}

// Claims the rank of an accepted hello and joins it once its ack is written.
void Rendezvous::Acceptance::admit(const IncomingPtr& in) {
  const Hello& h = in->hello;
  in->claimed = h.rank;
  claimed_[static_cast<size_t>(h.rank)] = true;
  const Digest mac = ack_mac(options_.secret, in->challenge, h, in->ack.status);
  std::memcpy(in->ack.mac, mac.data(), mac.size());
  asio::async_write(in->socket, asio::buffer(&in->ack, sizeof(Ack)),
                    [this, in](const error_code& ec, size_t) {
                      if (stop_after(*in, ec, "sending the ack")) return;
                      in->finished = true;
                      in->timer.cancel();
                      joined_.push_back(Joined{in->hello, std::move(in->socket), in->address});
                    });
}

void Rendezvous::Acceptance::drop(Incoming& in, const std::string& reason) {
  if (in.finished) return;
  in.finished = true;
  if (in.claimed >= 0) claimed_[static_cast<size_t>(in.claimed)] = false;
  in.timer.cancel();
  ++dropped_;
  last_drop_ = concat("from ", in.from, ": ", reason);
  std::fprintf(stderr, "pipemat tcp: rank %d dropped a connection from %s during rendezvous: %s\n",
               options_.rank, in.from.c_str(), reason.c_str());
}

// The start of the handshake's write handlers: true when the connection is done with, because
// it finished already or because `what` failed with `ec` (then it is dropped and closed).
bool Rendezvous::Acceptance::stop_after(Incoming& in, const error_code& ec, const char* what) {
  if (in.finished) return true;
  if (!ec) return false;
  drop(in, concat(what, " failed (", ec.message(), ")"));
  close(in);
  return true;
}

// Stops what is still in flight and lets its handlers run out before the state they use goes.
void Rendezvous::Acceptance::stop_in_flight() {
  error_code ignored;
  acceptor_.close(ignored);
  for (auto& in : incoming_) {
    if (!in->finished) {
      drop(*in, "the rendezvous ended before it completed its hello");
      close(*in);
    }
    in->timer.cancel();
  }
  rv_.io_.restart();
  rv_.io_.run();
}

// The rendezvous deadline passed before every rank joined.
void Rendezvous::Acceptance::throw_failure(const std::string& to_where) {
  std::string missing;
  for (int r = lo_; r <= hi_; ++r) {
    if (!claimed_[static_cast<size_t>(r)]) missing += (missing.empty() ? "" : ", ") + concat(r);
  }
  std::string what = concat("waiting for ranks ", missing, to_where);
  if (dropped_ > 0) {
    what += concat(" (dropped ", dropped_, dropped_ == 1 ? " connection" : " connections",
                   " meanwhile, the last ", last_drop_, ")");
  }
  rv_.fail(what, asio::error::timed_out);
}

std::vector<Rendezvous::Joined> Rendezvous::accept_ranks(tcp::acceptor& acceptor, int lo, int hi,
                                                         const std::string& to_where) {
  Acceptance acceptance(*this, acceptor, lo, hi);
  return acceptance.run(to_where);
}

void Rendezvous::authenticate(tcp::socket& socket, Hello hello, const std::string& whom,
                              const std::string& address) {
  const bool has_secret = !options_.secret.empty();
  Challenge challenge;
  read(socket, &challenge, sizeof(challenge), concat("waiting for the challenge of ", whom));
  const Connector connector{options_.secret, job_.data(), options_.rank, options_.world_size,
                            options_.master, whom,        address};
  check_challenge(challenge, connector);
  hello.flags = has_secret ? kHasSecret : 0;
  fill_nonce(hello.nonce);
  std::memcpy(hello.job, job_.data(), sizeof(hello.job));
  const Digest mac = hello_mac(options_.secret, challenge, hello);
  std::memcpy(hello.mac, mac.data(), mac.size());
  write(socket, &hello, sizeof(hello), concat("sending a hello to ", whom));
  Ack ack;
  read(socket, &ack, sizeof(ack), concat("waiting for ", whom, " to accept the hello"));
  check_ack(ack, challenge, hello, connector);
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
