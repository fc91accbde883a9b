// The receive side of the tcp backend's I/O core: posted receives, the read loop that matches
// each frame header to a receive (or keeps the payload as unexpected), and a receive's errors.

#include "tcp/core.h"

#include <cstring>
#include <exception>

#include "common.h"
#include "tcp/decode.h"

namespace pipemat::comm::detail::tcp {
namespace {

void scatter(const Buffer& from, const std::vector<MutableSpan>& to) {
  size_t offset = 0;
  for (const auto& span : to) {
    if (span.size) std::memcpy(span.data, from.data() + offset, span.size);
    offset += span.size;
  }
}

// Finishes a receive whose bytes are in `buffer` (size `size`).
void complete_from_buffer(const std::shared_ptr<TcpWork>& work, Buffer buffer, size_t size) {
  const WorkInfo& info = work->info();
  if (info.any_size) {
    work->set_received(size, std::move(buffer));
    work->finish(Status{});
  } else if (size != info.bytes) {
    work->set_received(size, std::move(buffer));
    work->finish(Status{StatusCode::kSizeMismatch, size_mismatch_message(info, size)});
  } else {
    scatter(buffer, work->recv_spans);
    work->set_received(size);
    work->finish(Status{});
  }
}

}  // namespace

// The error of a receive from a peer whose connection failed.
std::string recv_failure_message(const Peer& peer, const WorkInfo& info, const std::string& what) {
  if (peer.refused) return concat(info.describe(), " failed: ", what);
  return peer_failure_message(info, what);
}

void TcpCore::post_recv(std::shared_ptr<TcpWork> work) {
  asio::post(io, [self = shared_from_this(), work = std::move(work)] {
    try {
      self->do_recv(work);
    } catch (const std::exception& e) {
      work->finish(
          Status{StatusCode::kCommError, concat(work->info().describe(), " failed: ", e.what())});
    }
  });
}

std::string TcpCore::frame_what(const Peer& peer) const {
  return concat("receiving a frame of ", peer.in_header.size, " bytes with tag ",
                peer.in_header.tag, " from rank ", peer.rank);
}

void TcpCore::do_recv(const std::shared_ptr<TcpWork>& work) {
  const WorkInfo& info = work->info();
  Peer& peer = *peers[static_cast<size_t>(info.peer)];
  auto unexpected = peer.unexpected.find(info.tag);
  if (unexpected != peer.unexpected.end() && !unexpected->second.empty()) {
    Buffer buffer = std::move(unexpected->second.front());
    unexpected->second.pop_front();
    complete_from_buffer(work, buffer, buffer.size());
    return;
  }
  if (peer.payload_in_flight && !peer.reading && peer.in_header.tag == info.tag) {
    // The next message for this tag is arriving right now into a Buffer: it is ours.
    peer.reading = work;
    return;
  }
  if (peer.broken || peer.eof) {
    work->finish(
        Status{StatusCode::kCommError, recv_failure_message(peer, info, peer.broken_reason)});
    return;
  }
  peer.posted[info.tag].push_back(work);
}

void TcpCore::read_header(Peer& peer) {
  asio::async_read(peer.socket, asio::buffer(&peer.in_header, sizeof(FrameHeader)),
                   [self = shared_from_this(), p = &peer](const error_code& ec, size_t) {
                     self->guard_peer(
                         *p, [&] { return self->frame_what(*p); },
                         [&] { self->on_header(*p, ec); });
                   });
}

void TcpCore::on_header(Peer& peer, const error_code& ec) {
  if (ec) return on_read_error(peer, ec);
  clocks.heard(peer.rank);
  const int tag = peer.in_header.tag;
  switch (frame_kind(peer.in_header, max_message_bytes_)) {
    case FrameKind::kBeat:
      return read_header(peer);  // Note [Liveness of a peer]: it only says the peer is there
    case FrameKind::kBadMagic:
      refuse_peer(peer, concat("corrupt stream from rank ", peer.rank,
                               " (bad frame header); is another program connected to this port?"));
      return;
    case FrameKind::kBadTag:  // Note [Tags on the wire]
      refuse_peer(
          peer, concat("corrupt stream from rank ", peer.rank, ": a frame of ", peer.in_header.size,
                       " bytes with tag ", tag, ", a tag no pipemat rank sends (user tags are 0..",
                       kMaxUserTag, "); rank ", rank_, " closed the connection to rank ", peer.rank,
                       ". Is another program connected to this port?"));
      return;
    case FrameKind::kTooLarge:
      refuse_peer(peer,
                  concat("rank ", peer.rank, " sent a frame of ", peer.in_header.size,
                         " bytes with tag ", tag, " to rank ", rank_, ", more than the limit of ",
                         max_message_bytes_, " bytes (TransportOptions::max_message_bytes); rank ",
                         rank_, " closed the connection to rank ", peer.rank,
                         ". Either the stream is corrupt or a program other than pipemat is "
                         "connected; if the message is genuine, raise max_message_bytes on the "
                         "receiving rank"));
      return;
    case FrameKind::kMessage:
      break;
  }
  const size_t size = static_cast<size_t>(peer.in_header.size);
  std::vector<asio::mutable_buffer> buffers;
  auto& queue = peer.posted[tag];
  peer.reading = nullptr;
  peer.reading_buffer = Buffer();
  if (!queue.empty()) {
    peer.reading = std::move(queue.front());
    queue.pop_front();
    const WorkInfo& info = peer.reading->info();
    if (info.any_size || info.bytes != size) {
      peer.reading_buffer = Buffer::allocate_for_tag(size, tag);
      buffers.emplace_back(peer.reading_buffer.data(), size);
    } else {
      for (const auto& span : peer.reading->recv_spans) {
        if (span.size) buffers.emplace_back(span.data, span.size);
      }
    }
  } else {
    peer.reading_buffer = Buffer::allocate_for_tag(size, tag);
    buffers.emplace_back(peer.reading_buffer.data(), size);
  }
  if (size == 0) return on_payload(peer, error_code());
  peer.payload_in_flight = true;
  asio::async_read(peer.socket, buffers,
                   [self = shared_from_this(), p = &peer](const error_code& payload_ec, size_t) {
                     self->guard_peer(
                         *p, [&] { return self->frame_what(*p); },
                         [&] { self->on_payload(*p, payload_ec); });
                   });
}

void TcpCore::on_payload(Peer& peer, const error_code& ec) {
  peer.payload_in_flight = false;
  if (ec) return on_read_error(peer, ec);
  clocks.heard(peer.rank);
  const size_t size = peer.in_header.size;
  auto work = std::move(peer.reading);
  Buffer buffer = std::move(peer.reading_buffer);
  peer.reading = nullptr;
  peer.reading_buffer = Buffer();
  if (work) {
    if (buffer.data() != nullptr) {
      complete_from_buffer(work, buffer, size);
    } else {
      work->set_received(size);
      work->finish(Status{});
    }
  } else {
    peer.unexpected[peer.in_header.tag].push_back(std::move(buffer));
  }
  read_header(peer);
}

void TcpCore::on_read_error(Peer& peer, const error_code& ec) {
  if (peer.broken) return;
  if (ec == asio::error::eof && peer.direct_send_reset) {
    // The connection was reset and a direct send took the error (Peer::direct_send_reset).
    const error_code reset = asio::error::connection_reset;
    fail_peer(peer, StatusCode::kCommError,
              concat("the connection to rank ", peer.rank, " failed (", reset.message(), ")"),
              closing_);
    return;
  }
  if (ec == asio::error::eof) {
    peer.eof = true;
    fail_peer(peer, StatusCode::kCommError,
              concat("rank ", peer.rank,
                     " closed the connection (its transport was destroyed or its process "
                     "exited)"),
              closing_);
    return;
  }
  fail_peer(peer, StatusCode::kCommError,
            concat("the connection to rank ", peer.rank, " failed (", ec.message(), ")"), closing_);
}

}  // namespace pipemat::comm::detail::tcp
