#pragma once
// tcp backend (private). See pipemat/comm/transport.h for the contract.

#include <boost/asio/ip/address.hpp>
#include <memory>
#include <string>

#include "pipemat/comm/transport.h"

namespace pipemat::comm::detail {

std::unique_ptr<Transport> make_tcp_transport(const TransportOptions& options);

}  // namespace pipemat::comm::detail

namespace pipemat::comm::detail::tcp {

// Where a tcp transport met its peers; the raw baseline (raw_bench/tcp.cpp) opens its own
// socket the same way.
struct Endpoints {
  std::string master_host;                  // the host of TransportOptions::master
  boost::asio::ip::address listen_address;  // rank 0: the address its master listener was bound to
};

// The endpoints of `transport`, or null when it is not a tcp transport.
const Endpoints* endpoints_of(const Transport& transport);

}  // namespace pipemat::comm::detail::tcp
