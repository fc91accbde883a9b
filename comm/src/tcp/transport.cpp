// The tcp Transport on Boost.Asio: the rendezvous of tcp/rendezvous.h on construction, then
// every message through a TcpCore (tcp/core.h) on its I/O thread.

#include "tcp/transport.h"

#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "common.h"
#include "pipemat/core/error.h"
#include "tcp/asio.h"
#include "tcp/core.h"
#include "tcp/decode.h"
#include "tcp/rendezvous.h"
#include "tcp/wire.h"

namespace pipemat::comm::detail {
namespace tcp {
namespace {

class TcpTransport final : public SpanTransport<TcpTransport, TcpWork> {
 public:
  explicit TcpTransport(const TransportOptions& options)
      : SpanTransport(TransportKind::kTcp, options.rank, options.world_size, options.timeout),
        shutdown_timeout_(options.shutdown_timeout),
        core_(std::make_shared<TcpCore>(options.rank, options.world_size, options.max_message_bytes,
                                        PeerClocks::beat_interval(options))) {
    rendezvous(options);
    core_->start();
  }

  // During an exception (a failed step) the peers are gone or stuck: no drain.
  ~TcpTransport() override {
    core_->shutdown(std::uncaught_exceptions() > 0 ? std::chrono::milliseconds(0)
                                                   : shutdown_timeout_);
  }

  const Endpoints& endpoints() const { return endpoints_; }

  // SpanTransport's post_send / post_recv hand their work to this.
  const std::shared_ptr<TcpCore>& core() const { return core_; }

 private:
  void rendezvous(const TransportOptions& options) {
    if (options.world_size == 1) return;
    auto [host, port] = parse_master(options.master);
    endpoints_.master_host = host;
    auto& io = core_->io;
    auto& peers = core_->peers;
    Rendezvous rv(io, options);
    const int world = options.world_size;
    const int me = options.rank;
    if (me == 0) {
      tcp::acceptor acceptor = listen_on_master(io, host, port, options.master);
      error_code ec;
      endpoints_.listen_address = acceptor.local_endpoint(ec).address();
      auto joined = rv.accept_ranks(acceptor, 1, world - 1, concat(" to connect to port ", port));
      std::vector<TableEntry> table(static_cast<size_t>(world));
      for (auto& j : joined) {
        auto& entry = table[static_cast<size_t>(j.hello.rank)];
        entry.port = j.hello.listen_port;
        // Note [Announced listener address]: the rank's own, checked when its hello came in.
        const std::string announced = announced_host(j.hello);
        std::strncpy(entry.host, announced.c_str(), sizeof(entry.host) - 1);
        peers[static_cast<size_t>(j.hello.rank)] =
            std::make_unique<Peer>(j.hello.rank, std::move(j.socket));
      }
      for (int r = 1; r < world; ++r) {
        rv.write(peers[static_cast<size_t>(r)]->socket, table.data(),
                 table.size() * sizeof(TableEntry), "sending the rank table");
      }
      return;
    }
    tcp::socket master = rv.connect(host, port, "the master (rank 0)");
    // Own listener before the hello, so lower ranks' table entries are connectable at once; bound
    // to the address this rank reaches the master from (the one the table announces), not to
    // every interface.
    tcp::acceptor listener(io);
    {
      error_code ec;
      const tcp::endpoint local(master.local_endpoint(ec).address(), 0);
      if (!ec) listener.open(local.protocol(), ec);
      if (!ec) listener.bind(local, ec);
      if (!ec) listener.listen(asio::socket_base::max_listen_connections, ec);
      PIPEMAT_CHECK(!ec, CommError, "tcp transport: rank ", me,
                    " could not open its listener for the other ranks (", ec.message(), ")");
    }
    Hello hello;
    hello.rank = me;
    hello.world_size = world;
    hello.listen_port = listener.local_endpoint().port();
    set_listen_host(hello, listener.local_endpoint().address().to_string());
    rv.authenticate(master, hello, "the master (rank 0)", options.master);
    std::vector<TableEntry> table(static_cast<size_t>(world));
    rv.read(master, table.data(), table.size() * sizeof(TableEntry),
            "waiting for the rank table from the master (are all ranks started?)");
    peers[0] = std::make_unique<Peer>(0, std::move(master));
    for (int s = 1; s < me; ++s) {
      const TableAddress entry = table_address(table[static_cast<size_t>(s)], s);
      tcp::socket socket = rv.connect(entry.host, entry.port, concat("rank ", s));
      rv.authenticate(socket, hello, concat("rank ", s), concat(entry.host, ":", entry.port));
      peers[static_cast<size_t>(s)] = std::make_unique<Peer>(s, std::move(socket));
    }
    if (me + 1 < world) {
      auto joined =
          rv.accept_ranks(listener, me + 1, world - 1, concat(" to connect to rank ", me));
      for (auto& j : joined) {
        peers[static_cast<size_t>(j.hello.rank)] =
            std::make_unique<Peer>(j.hello.rank, std::move(j.socket));
      }
    }
  }

  const std::chrono::milliseconds shutdown_timeout_;
  std::shared_ptr<TcpCore> core_;
  Endpoints endpoints_;
};

}  // namespace

const Endpoints* endpoints_of(const Transport& transport) {
  const auto* tcp_transport = dynamic_cast<const TcpTransport*>(&transport);
  return tcp_transport != nullptr ? &tcp_transport->endpoints() : nullptr;
}

}  // namespace tcp

std::unique_ptr<Transport> make_tcp_transport(const TransportOptions& options) {
  return std::make_unique<tcp::TcpTransport>(options);
}

}  // namespace pipemat::comm::detail
