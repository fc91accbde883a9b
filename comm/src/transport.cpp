// Options from the environment, the checked send/recv, barrier and the transport factory.
//
// What lives where in comm/src (the public headers are listed in transport.h):
//   transport.cpp   options from the environment, the checked send/recv, barrier, factory
//   work.cpp        Work and Buffer;  common.h  shared error wording, SpanWork
//   local/ mpi/ tcp/  one backend each (transport.h/.cpp); mpi/ also environment (MPI init
//                   and finalize) and core (the request engine, the progress thread); tcp/
//                   also core (the I/O thread; core_send, core_recv: its send path and read
//                   loop), rendezvous (the handshake), wire (frames, handshake structs, MACs)
//   tensor_wire.*   TensorMeta, the tensor wire format and the checks of received headers
//   tensor.cpp, tensor_list.cpp, tensor_work.h  single tensors, tensor lists, their shared wait
//   bench.cpp, raw_bench.cpp + raw_bench/<backend>.cpp, launcher.cpp

#include "pipemat/comm/transport.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "common.h"
#include "local/transport.h"
#ifdef PIPEMAT_MPI
#include "mpi/transport.h"
#endif
#include "pipemat/core/error.h"
#include "pipemat/core/parse.h"
#include "tcp/transport.h"

namespace pipemat::comm {
namespace {

std::atomic<bool> g_joining{false};

const char* getenv_or_null(const char* name) {
  const char* value = std::getenv(name);
  return (value != nullptr && value[0] != '\0') ? value : nullptr;
}

constexpr int64_t kMaxEnvInt = (int64_t{1} << 24) - 1;

int parse_env_int(const char* name, const char* value) {
  const auto parsed = parse_int_in(value, 0, kMaxEnvInt);
  PIPEMAT_CHECK(parsed.has_value(), ConfigError, "environment variable ", name, "='", value,
                "' is not a non-negative integer; set it like ", name, "=0");
  return static_cast<int>(*parsed);
}

}  // namespace

std::string to_string(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kMpi:
      return "mpi";
    case TransportKind::kTcp:
      return "tcp";
    case TransportKind::kLocal:
      return "local";
  }
  return "?";
}

std::string to_string(LaneKind kind) { return kind == LaneKind::kNccl ? "nccl" : "none"; }

TransportKind parse_transport_kind(const std::string& text) {
  if (text == "auto") return TransportKind::kAuto;
  if (text == "mpi") return TransportKind::kMpi;
  if (text == "tcp") return TransportKind::kTcp;
  if (text == "local") return TransportKind::kLocal;
  PIPEMAT_THROW(ConfigError, "unknown transport '", text,
                "'; expected one of auto, mpi, tcp, local");
}

TransportOptions resolve_options(TransportOptions options) {
  if (options.timeout.count() <= 0) {
    options.timeout = kDefaultTimeout;
    if (const char* value = getenv_or_null("PIPEMAT_COMM_TIMEOUT")) {
      char* end = nullptr;
      double seconds = std::strtod(value, &end);
      PIPEMAT_CHECK(end != value && *end == '\0' && seconds > 0, ConfigError,
                    "PIPEMAT_COMM_TIMEOUT='", value,
                    "' is not a positive number of seconds; set it like PIPEMAT_COMM_TIMEOUT=60");
      options.timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
    }
  }
  if (const char* value = getenv_or_null("PIPEMAT_MPI_PROGRESS_US")) {
    options.mpi_progress_interval =
        std::chrono::microseconds(parse_env_int("PIPEMAT_MPI_PROGRESS_US", value));
  }
  if (options.kind == TransportKind::kAuto) {
    if (const char* value = getenv_or_null("PIPEMAT_TRANSPORT")) {
      options.kind = parse_transport_kind(value);
    }
  }
  if (options.kind == TransportKind::kAuto) {
    if (getenv_or_null("OMPI_COMM_WORLD_SIZE") || getenv_or_null("PMIX_RANK") ||
        getenv_or_null("PMI_RANK")) {
      options.kind = TransportKind::kMpi;
    } else if (!options.master.empty() || getenv_or_null("PIPEMAT_MASTER")) {
      options.kind = TransportKind::kTcp;
    }
  }
  if (options.kind == TransportKind::kTcp) {
    if (options.rank < 0) {
      const char* value = getenv_or_null("PIPEMAT_RANK");
      PIPEMAT_CHECK(value, ConfigError,
                    "tcp transport: the rank is not set; pass --rank or set PIPEMAT_RANK");
      options.rank = parse_env_int("PIPEMAT_RANK", value);
    }
    if (options.world_size < 0) {
      const char* value = getenv_or_null("PIPEMAT_WORLD_SIZE");
      PIPEMAT_CHECK(value, ConfigError,
                    "tcp transport: the world size is not set; pass --world-size or set "
                    "PIPEMAT_WORLD_SIZE");
      options.world_size = parse_env_int("PIPEMAT_WORLD_SIZE", value);
    }
    if (options.master.empty()) {
      const char* value = getenv_or_null("PIPEMAT_MASTER");
      PIPEMAT_CHECK(value, ConfigError,
                    "tcp transport: the master address is not set; pass --master host:port or "
                    "set PIPEMAT_MASTER=host:port (rank 0 listens there)");
      options.master = value;
    }
    if (options.secret.empty()) {
      if (const char* value = getenv_or_null("PIPEMAT_JOB_SECRET")) options.secret = value;
    }
    PIPEMAT_CHECK(options.world_size >= 1, ConfigError, "tcp transport: world size ",
                  options.world_size, " must be at least 1");
    PIPEMAT_CHECK(options.rank < options.world_size, ConfigError, "tcp transport: rank ",
                  options.rank, " is outside the world of ", options.world_size,
                  " ranks (valid: 0..", options.world_size - 1, ")");
  }
  PIPEMAT_CHECK(options.connect_retries >= 1, ConfigError, "connect_retries must be >= 1, got ",
                options.connect_retries);
  PIPEMAT_CHECK(options.handshake_timeout.count() > 0, ConfigError,
                "handshake_timeout must be > 0 ms (how long a rendezvous connection may take "
                "for its hello), got ",
                options.handshake_timeout.count(), " ms");
  PIPEMAT_CHECK(options.max_message_bytes > 0, ConfigError,
                "max_message_bytes must be > 0 (the largest message accepted from a peer), got 0; "
                "leave it at its default of ",
                kDefaultMaxMessageBytes, " bytes or raise it");
  return options;
}

Transport::Transport(TransportKind kind, int rank, int world_size,
                     std::chrono::milliseconds timeout)
    : Transport(kind, rank, world_size, timeout, rank) {}

Transport::Transport(TransportKind kind, int rank, int world_size,
                     std::chrono::milliseconds timeout, int job_rank)
    : kind_(kind), rank_(rank), world_size_(world_size), timeout_(timeout), job_rank_(job_rank) {}

Transport::~Transport() = default;

std::string Transport::describe() const {
  return detail::concat("rank ", rank_, " of ", world_size_, " (", to_string(kind_), ")");
}

WorkInfo Transport::make_info(OpKind op, int peer, int tag, size_t bytes, bool any_size,
                              bool internal) const {
  const char* verb = op == OpKind::kSend ? "send to" : "recv from";
  PIPEMAT_CHECK(peer >= 0 && peer < world_size_, ConfigError, describe(), ": cannot ", verb,
                " rank ", peer, "; valid peers are 0..", world_size_ - 1);
  PIPEMAT_CHECK(peer != rank_, ConfigError, describe(), ": cannot ", verb,
                " itself (peer == rank); pipeline neighbours are distinct ranks");
  // Note [Tags on the wire]: comm's own sends use its reserved tags only.
  PIPEMAT_CHECK(internal ? detail::is_transport_tag(tag) : tag >= 0 && tag <= kMaxUserTag,
                ConfigError, describe(), ": tag ", tag, " for ", verb, " rank ", peer,
                " is outside 0..", kMaxUserTag);
  WorkInfo info;
  info.op = op;
  info.rank = rank_;
  info.peer = peer;
  info.tag = tag;
  info.bytes = bytes;
  info.any_size = any_size;
  info.transport = to_string(kind_);
  return info;
}

WorkPtr Transport::send(int peer, int tag, const void* data, size_t bytes) {
  return send(peer, tag, std::vector<ConstSpan>{ConstSpan{data, bytes}});
}

WorkPtr Transport::send(int peer, int tag, std::vector<ConstSpan> spans,
                        std::shared_ptr<const void> keep_alive) {
  return send_checked(peer, tag, std::move(spans), std::move(keep_alive), false);
}

WorkPtr Transport::send_checked(int peer, int tag, std::vector<ConstSpan> spans,
                                std::shared_ptr<const void> keep_alive, bool internal) {
  size_t total = 0;
  for (const auto& span : spans) {
    PIPEMAT_CHECK(span.data != nullptr || span.size == 0, ConfigError, describe(),
                  ": send to rank ", peer, " with tag ", tag, " got a null pointer for ", span.size,
                  " bytes");
    total += span.size;
  }
  Request request;
  request.info = make_info(OpKind::kSend, peer, tag, total, false, internal);
  request.send_spans = std::move(spans);
  request.keep_alive = std::move(keep_alive);
  return post_send(std::move(request));
}

WorkPtr Transport::recv(int peer, int tag, void* data, size_t bytes) {
  return recv(peer, tag, std::vector<MutableSpan>{MutableSpan{data, bytes}});
}

WorkPtr Transport::recv(int peer, int tag, std::vector<MutableSpan> spans,
                        std::shared_ptr<const void> keep_alive) {
  return recv_checked(peer, tag, std::move(spans), std::move(keep_alive), false);
}

WorkPtr Transport::recv_checked(int peer, int tag, std::vector<MutableSpan> spans,
                                std::shared_ptr<const void> keep_alive, bool internal) {
  size_t total = 0;
  for (const auto& span : spans) {
    PIPEMAT_CHECK(span.data != nullptr || span.size == 0, ConfigError, describe(),
                  ": recv from rank ", peer, " with tag ", tag, " got a null pointer for ",
                  span.size, " bytes");
    total += span.size;
  }
  Request request;
  request.info = make_info(OpKind::kRecv, peer, tag, total, false, internal);
  request.recv_spans = std::move(spans);
  request.keep_alive = std::move(keep_alive);
  return post_recv(std::move(request));
}

WorkPtr Transport::recv_any(int peer, int tag) { return recv_any_checked(peer, tag, false); }

WorkPtr Transport::recv_any_checked(int peer, int tag, bool internal) {
  Request request;
  request.info = make_info(OpKind::kRecv, peer, tag, 0, true, internal);
  return post_recv(std::move(request));
}

int Transport::job_rank_of(int peer) const {
  PIPEMAT_CHECK(peer >= 0 && peer < world_size_, ConfigError, describe(), ": rank ", peer,
                " is outside 0..", world_size_ - 1);
  return peer;
}

WorkPtr send_reserved(Transport& transport, int peer, int tag, std::vector<ConstSpan> spans,
                      std::shared_ptr<const void> keep_alive) {
  PIPEMAT_CHECK(tag >= kLaneControlTag && tag <= kLaneBootstrapTag, ConfigError,
                transport.describe(), ": tag ", tag, " is no reserved lane tag");
  return transport.send_checked(peer, tag, std::move(spans), std::move(keep_alive), true);
}

WorkPtr recv_any_reserved(Transport& transport, int peer, int tag) {
  PIPEMAT_CHECK(tag >= kLaneControlTag && tag <= kLaneBootstrapTag, ConfigError,
                transport.describe(), ": tag ", tag, " is no reserved lane tag");
  return transport.recv_any_checked(peer, tag, true);
}

void Transport::attach_device_lane(std::shared_ptr<DeviceLane> lane) {
  PIPEMAT_CHECK(lane != nullptr, ConfigError, describe(), ": attach_device_lane(nullptr)");
  PIPEMAT_CHECK(lane_ == nullptr, ConfigError, describe(), ": a device lane is attached already");
  lane_ = std::move(lane);
}

void Transport::barrier() { barrier_until(std::nullopt); }

void Transport::barrier(std::chrono::milliseconds timeout) {
  barrier_until(Clock::now() + timeout);
}

void Transport::barrier_until(std::optional<Clock::time_point> deadline) {
  // Gather to rank 0, then release; messages of one byte on a reserved tag. Without a deadline
  // each wait is Work::wait() (Note [Liveness of a peer]).
  auto wait = [&](Work& work) {
    if (!deadline) return work.wait();
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now());
    work.wait(std::max(left, std::chrono::milliseconds(1)));
  };
  static const uint8_t kToken = 1;
  if (world_size_ == 1) return;
  if (rank_ == 0) {
    std::vector<uint8_t> sink(static_cast<size_t>(world_size_));
    std::vector<WorkPtr> arrivals;
    for (int peer = 1; peer < world_size_; ++peer) {
      arrivals.push_back(recv_checked(
          peer, kBarrierTag, {MutableSpan{&sink[static_cast<size_t>(peer)], 1}}, nullptr, true));
    }
    for (auto& work : arrivals) wait(*work);
    std::vector<WorkPtr> releases;
    for (int peer = 1; peer < world_size_; ++peer) {
      releases.push_back(send_checked(peer, kBarrierTag, {ConstSpan{&kToken, 1}}, nullptr, true));
    }
    for (auto& work : releases) wait(*work);
  } else {
    uint8_t sink = 0;
    auto arrival = send_checked(0, kBarrierTag, {ConstSpan{&kToken, 1}}, nullptr, true);
    auto release = recv_checked(0, kBarrierTag, {MutableSpan{&sink, 1}}, nullptr, true);
    wait(*arrival);
    wait(*release);
  }
}

std::unique_ptr<Transport> make_transport(const TransportOptions& options) {
  TransportOptions resolved = resolve_options(options);
  switch (resolved.kind) {
    case TransportKind::kMpi:
#ifdef PIPEMAT_MPI
      g_joining = true;
      return detail::make_mpi_transport(resolved);
#else
      PIPEMAT_THROW(ConfigError,
                    "make_transport: transport mpi: this pipemat was built without MPI "
                    "(-DPIPEMAT_MPI=OFF); use transport tcp (pipemat-run --tcp) or local");
#endif
    case TransportKind::kTcp:
      g_joining = true;
      return detail::make_tcp_transport(resolved);
    case TransportKind::kLocal:
      PIPEMAT_THROW(ConfigError,
                    "make_transport: the local transport connects threads of one process; "
                    "create all ranks at once with make_local_transports(world_size)");
    case TransportKind::kAuto:
      break;
  }
  PIPEMAT_THROW(ConfigError,
                "make_transport: cannot choose a transport: the process was not started by "
                "mpirun and PIPEMAT_MASTER is not set. Run under `mpirun -np N`, or set "
                "PIPEMAT_TRANSPORT=tcp with PIPEMAT_RANK, PIPEMAT_WORLD_SIZE and "
                "PIPEMAT_MASTER=host:port");
}

JobStatus job_status() {
  JobStatus status;
  status.joining = g_joining;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PIPEMAT_RANK"}) {
    const char* value = getenv_or_null(name);
    if (value == nullptr) continue;
    if (const auto rank = parse_int_in(value, 0, kMaxEnvInt)) {
      status.launcher_rank = static_cast<int>(*rank);
    }
    break;
  }
  return status;
}

std::vector<std::unique_ptr<Transport>> make_local_transports(int world_size,
                                                              const TransportOptions& options) {
  PIPEMAT_CHECK(world_size >= 1, ConfigError, "make_local_transports: world size ", world_size,
                " must be at least 1");
  TransportOptions resolved = options;
  resolved.kind = TransportKind::kLocal;
  resolved = resolve_options(resolved);
  return detail::make_local_group(world_size, resolved);
}

}  // namespace pipemat::comm
