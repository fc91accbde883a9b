#pragma once
// Boost.Asio for the tcp backend (private): the one include and the short names its files use.

// Boost 1.74's awaitable.hpp uses std::exchange without <utility>, which C++20 library headers no
// longer pull in for it.
#include <utility>

#include <boost/asio.hpp>

namespace pipemat::comm::detail::tcp {

namespace asio = boost::asio;
// Inside this namespace `tcp` is Asio's protocol class: tcp::socket, tcp::acceptor, ...
using asio::ip::tcp;
using boost::system::error_code;

}  // namespace pipemat::comm::detail::tcp
