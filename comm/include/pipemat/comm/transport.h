#pragma once
// The byte transport of pipemat: asynchronous point-to-point messages between ranks.
//
// One abstract Transport, three backends (docs/comm.md):
//   mpi    Open MPI; the default under mpirun. Duplicated communicator, MPI_ERRORS_RETURN.
//   tcp    Boost.Asio sockets; ranks rendezvous at a master host:port. No MPI needed.
//   local  ranks are threads of one process (tests); make_local_transports(n).
//
// Messages are matched by (peer, tag) and are delivered in posting order per (peer, tag): the
// k-th send to rank d with tag t lands in the k-th receive rank d posts for (this rank, t).
// Sizes must match exactly (or use recv_any). The tensor layer on top is pipemat/comm/tensor.h.
//
// Threading: every member of Transport is thread-safe; ops may be posted from several threads.
// Blocking: send/recv never block (they return a Work); only Work::wait, barrier and the
// constructors (rendezvous) block, each bounded by a timeout.
// Errors: CommError for failures (naming this rank, the peer, the tag and the operation),
// TimeoutError (a CommError) for deadlines, ConfigError for invalid arguments/options.
// See docs/comm.md.
//
// The public headers of comm (two targets: pipemat_comm moves bytes and knows no torch;
// pipemat_comm_tensor is the tensor layer and the p2p bench on top):
//   transport.h     Transport, TransportOptions, make_transport (this file)
//   work.h          Work, Buffer, spans, Status (Note [Work contract])
//   tensor.h        send_tensor / recv_tensor*, tensor lists, TensorMeta   (comm_tensor)
//   bench.h         `pipemat bench p2p` as a library                      (comm_tensor)
//   raw_bench.h     the raw ping-pong baseline per medium
//   launcher.h      spawning N local processes as the ranks of a tcp job

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/comm/work.h"

namespace pipemat::comm {

class DeviceLane;  // pipemat/comm/device_lane.h (Note [Device lanes])

enum class TransportKind {
  kAuto,  // mpi when started by mpirun, tcp when PIPEMAT_MASTER is set, else ConfigError
  kMpi,
  kTcp,
  kLocal,
};

std::string to_string(TransportKind kind);

// The device lane a training run attaches to its transport (Note [Device lanes]): none, or NCCL
// between the ranks' GPUs. make_transport makes none: a lane needs the rank's device.
enum class LaneKind {
  kNone,
  kNccl,
};
std::string to_string(LaneKind kind);  // "none", "nccl"
// "auto", "mpi", "tcp", "local"; throws ConfigError naming the accepted values.
TransportKind parse_transport_kind(const std::string& text);

// The timeout used when TransportOptions::timeout is zero and PIPEMAT_COMM_TIMEOUT is not set.
inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(300)};

// Default of TransportOptions::max_message_bytes: 16 GiB, far above any activation or gradient
// of one micro-batch a CPU pipeline stage moves, yet small enough that a corrupt size field is
// refused instead of being allocated (or, near 2^64, wrapping the allocation size).
inline constexpr size_t kDefaultMaxMessageBytes = size_t{16} << 30;

// Largest tag users may pass; tags above are reserved for the transports (barrier, ...).
inline constexpr int kMaxUserTag = (1 << 30) - 1;

struct TransportOptions {
  TransportKind kind = TransportKind::kAuto;

  // Default deadline of Work::wait() and barrier(), and the rendezvous deadline of tcp.
  // Zero: PIPEMAT_COMM_TIMEOUT (seconds, may be fractional) or kDefaultTimeout.
  std::chrono::milliseconds timeout{0};

  // The device lane that pipemat train attaches (training.device must be CUDA for nccl);
  // make_transport ignores it.
  LaneKind lane = LaneKind::kNone;

  // tcp: this rank, the number of ranks and rank 0's "host:port". -1 / empty: taken from
  // PIPEMAT_RANK, PIPEMAT_WORLD_SIZE, PIPEMAT_MASTER.
  int rank = -1;
  int world_size = -1;
  std::string master;
  // tcp: connection attempts to the master and to peers before giving up, and the pause between.
  int connect_retries = 40;
  std::chrono::milliseconds connect_retry_interval{250};
  // tcp: the per-job secret every rank must share (docs/comm.md, "tcp"). Empty: taken from
  // PIPEMAT_JOB_SECRET; still empty: no authentication (any local process that reaches the
  // master port may join as a rank; for hand-started ranks). With a secret, every rendezvous
  // connection is a challenge-response (HMAC-SHA256 over fresh nonces): the secret itself never
  // goes over the wire, and a rank with a different secret is refused (CommError on both sides).
  std::string secret;
  // tcp: what identifies the job, compared at the rendezvous with or without a secret (its
  // SHA-256 travels, Note [Rendezvous handshake]): a rank whose `job` differs is refused, both
  // sides naming both digests. `pipemat train` sets its effective config's digest (the world size
  // is compared on its own), so ranks of two jobs on one master port, or started with two
  // configs, never train together. Empty is
  // a value like any other (every rank that leaves it empty matches).
  std::string job;
  // tcp: how long an accepted rendezvous connection may take to complete its hello (capped at
  // `timeout`). A connection that is silent, sends garbage or fails authentication is closed and
  // reported on stderr; the rendezvous goes on without it.
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(5)};
  // tcp: how long the destructor waits for queued sends to drain and for peers to close.
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(10)};
  // tcp: the largest message accepted from a peer (default kDefaultMaxMessageBytes). A frame
  // announcing more is refused before anything is allocated: the connection to that peer is
  // closed and its pending and later receives fail with CommError naming the peer, the size and
  // this limit. Guards against corrupt streams and hostile peers; raise it for larger messages.
  size_t max_message_bytes = kDefaultMaxMessageBytes;

  // tcp and mpi: how often a rank sends each peer a heartbeat (Note [Liveness of a peer] in
  // pipemat/comm/work.h). Zero: a quarter of `timeout`, between 20 ms and 1 s; at most a day. The
  // beats go from the I/O thread (tcp) or the progress thread (mpi; none without one). An
  // interval near the timeout makes live peers look silent: keep it well below.
  std::chrono::milliseconds heartbeat_interval{0};

  // mpi: how often the progress thread drives pending operations; it sleeps while nothing is
  // pending. Zero: no progress thread (operations move only inside
  // is_completed() / wait() calls). PIPEMAT_MPI_PROGRESS_US overrides it.
  std::chrono::microseconds mpi_progress_interval{100};

  // local: sends up to this size are copied and complete at once; larger sends complete when
  // the receiver matches them (like MPI's eager/rendezvous protocols).
  size_t local_eager_limit = size_t{64} * 1024;
};

// Resolves zero/unset fields from the environment: timeout from PIPEMAT_COMM_TIMEOUT, and
// (for tcp and auto) rank/world_size/master/secret from PIPEMAT_RANK/PIPEMAT_WORLD_SIZE/
// PIPEMAT_MASTER/PIPEMAT_JOB_SECRET, kind from PIPEMAT_TRANSPORT when kAuto. Throws ConfigError for
// malformed values.
TransportOptions resolve_options(TransportOptions options);

// A contiguous piece of a message (gather on send, scatter on recv).
struct ConstSpan {
  const void* data = nullptr;
  size_t size = 0;
};
struct MutableSpan {
  void* data = nullptr;
  size_t size = 0;
};

class Transport {
 public:
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  // Clean shutdown: finishes queued sends (bounded), fails pending receives with kAborted,
  // releases sockets / the MPI communicator. Never throws.
  virtual ~Transport();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // This rank in the job's transport beneath any group (Note [Groups of ranks]): what message
  // headers carry and errors name. rank() for a transport that is no group.
  int job_rank() const { return job_rank_; }
  TransportKind kind() const { return kind_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // "rank 0 of 2 (tcp)"
  std::string describe() const;

  // Sends `bytes` bytes to `peer` with `tag` (0..kMaxUserTag). Non-blocking; the caller keeps
  // `data` alive and unchanged until the Work completes. Throws ConfigError for a bad peer/tag.
  WorkPtr send(int peer, int tag, const void* data, size_t bytes);
  // Gathers the spans into one message. `keep_alive` is held by the Work (see Work::hold).
  WorkPtr send(int peer, int tag, std::vector<ConstSpan> spans,
               std::shared_ptr<const void> keep_alive = nullptr);

  // Receives the next message from `peer` with `tag` into `data`. The message must have exactly
  // `bytes` bytes; otherwise the Work fails with kSizeMismatch (CommError naming both sizes) and
  // the message is available in Work::buffer().
  WorkPtr recv(int peer, int tag, void* data, size_t bytes);
  // Scatters the message over the spans (same exact-size rule for their total).
  WorkPtr recv(int peer, int tag, std::vector<MutableSpan> spans,
               std::shared_ptr<const void> keep_alive = nullptr);
  // Receives a message of any size into transport-allocated memory: Work::buffer().
  WorkPtr recv_any(int peer, int tag);

  // Blocks until every rank reached the barrier; TimeoutError naming the missing rank. barrier()
  // bounds each of its waits as Work::wait() does (Note [Liveness of a peer]), barrier(timeout)
  // the whole barrier by `timeout`.
  void barrier();
  void barrier(std::chrono::milliseconds timeout);

  // The job rank of this transport's rank `peer`: `peer` itself unless this is a group's view
  // (Note [Groups of ranks]). ConfigError for a rank outside the world.
  virtual int job_rank_of(int peer) const;

  // The device lane that carries device tensors of tensor lists for this transport (Note
  // [Device lanes] in pipemat/comm/device_lane.h), or null: the one attached to this transport,
  // or to the transport a group's view is of.
  virtual DeviceLane* device_lane() const { return lane_.get(); }
  // Attaches `lane` (made for this transport by make_device_lane); kept until the transport is
  // destroyed. ConfigError when one is attached already.
  void attach_device_lane(std::shared_ptr<DeviceLane> lane);

 protected:
  struct Request {
    WorkInfo info;
    std::vector<ConstSpan> send_spans;    // send
    std::vector<MutableSpan> recv_spans;  // recv (empty with info.any_size)
    std::shared_ptr<const void> keep_alive;
  };

  Transport(TransportKind kind, int rank, int world_size, std::chrono::milliseconds timeout);
  Transport(TransportKind kind, int rank, int world_size, std::chrono::milliseconds timeout,
            int job_rank);

  // The backend's two entry points (Gloo style: the minimal pure virtuals). Arguments are
  // validated; the returned Work must already hold request.keep_alive.
  virtual WorkPtr post_send(Request request) = 0;
  virtual WorkPtr post_recv(Request request) = 0;

  // For a transport layered on another one (a group's view, make_group): posts a validated
  // request on `other`, whose ranks request.info.rank and .peer must already be.
  static WorkPtr post_send_on(Transport& other, Request request) {
    return other.post_send(std::move(request));
  }
  static WorkPtr post_recv_on(Transport& other, Request request) {
    return other.post_recv(std::move(request));
  }

  // make_group's backend hook (Note [Groups of ranks]): a transport of its own for the ranks
  // `world_ranks` of this one (validated, this rank among them), or null for a view on this
  // transport. mpi returns a sub-communicator.
  virtual std::unique_ptr<Transport> make_subgroup(const std::vector<int>& world_ranks);
  friend std::unique_ptr<Transport> make_group(Transport& parent,
                                               const std::vector<int>& world_ranks);

 private:
  WorkInfo make_info(OpKind op, int peer, int tag, size_t bytes, bool any_size,
                     bool internal) const;
  WorkPtr send_checked(int peer, int tag, std::vector<ConstSpan> spans,
                       std::shared_ptr<const void> keep_alive, bool internal);
  WorkPtr recv_checked(int peer, int tag, std::vector<MutableSpan> spans,
                       std::shared_ptr<const void> keep_alive, bool internal);
  WorkPtr recv_any_checked(int peer, int tag, bool internal);
  // barrier() (no deadline) and barrier(timeout).
  void barrier_until(std::optional<Clock::time_point> deadline);

  // Device lanes post their control messages on tags above kMaxUserTag (Note [Device lanes]).
  friend WorkPtr send_reserved(Transport& transport, int peer, int tag,
                               std::vector<ConstSpan> spans,
                               std::shared_ptr<const void> keep_alive);
  friend WorkPtr recv_any_reserved(Transport& transport, int peer, int tag);

  const TransportKind kind_;
  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  const int job_rank_;
  std::shared_ptr<DeviceLane> lane_;
};

// The tags above kMaxUserTag, each reserved for one use inside comm.
inline constexpr int kBarrierTag = kMaxUserTag + 1;        // Transport::barrier
inline constexpr int kHeartbeatTag = kMaxUserTag + 2;      // mpi (Note [Liveness of a peer])
inline constexpr int kLaneControlTag = kMaxUserTag + 3;    // Note [Device lanes]: control messages
inline constexpr int kLaneDataTag = kMaxUserTag + 4;       // the transport link's bytes
inline constexpr int kLaneBootstrapTag = kMaxUserTag + 5;  // the NCCL link's ids
// A send and a receive on the device lanes' tags (`tag` must be one of them).
WorkPtr send_reserved(Transport& transport, int peer, int tag, std::vector<ConstSpan> spans,
                      std::shared_ptr<const void> keep_alive = nullptr);
WorkPtr recv_any_reserved(Transport& transport, int peer, int tag);

// Creates this process's transport (mpi or tcp; kAuto resolved as documented). Blocks for the
// tcp rendezvous. Throws ConfigError (bad options, kLocal) or CommError (rendezvous failed).
std::unique_ptr<Transport> make_transport(const TransportOptions& options = {});

// Where this process stands in a multi-process job, so that a failure is reported once.
struct JobStatus {
  // The rank a launcher gave this process (mpirun's or pipemat-run's environment), or -1.
  int launcher_rank = -1;
  // make_transport was called for mpi or tcp here: from then on a failure may be this rank's
  // own (a rendezvous, a peer, a stage); before it, it comes from input every rank shares.
  bool joining = false;
};
JobStatus job_status();

// Ends the whole job after a fatal error: when MPI is initialized (and not finalized) in this
// process, MPI_Abort(MPI_COMM_WORLD, exit_code), which makes mpirun end every rank, also a
// stopped or stuck one; otherwise nothing (tcp and local peers see this process go away).
// Call it once, after reporting the error. Does not return under MPI.
void abort_job(int exit_code) noexcept;

// Note [Groups of ranks]
// A group is a view of some ranks of a transport as a transport of their own: its rank r is
// world_ranks[r] of `parent`. A message's Work and errors name the job's ranks (job_rank(), the
// ranks a launcher and its logs show), not the group's. The parent must outlive the group; a group
// is thread-safe as its parent is. ConfigError when `parent`'s rank is not in `world_ranks`, or a
// rank is repeated or outside the parent's world.
//   * mpi (MPI initialized at MPI_THREAD_MULTIPLE, as pipemat does it): an MPI sub-communicator
//     of the parent's (MPI_Comm_create_group), with its own request engine. Creating it is
//     collective over the group's ranks and blocks until all of them call make_group for it:
//     every rank makes the groups it belongs to in the same order (as the training driver
//     does: its pipeline, then its data group). Its traffic never meets another group's.
//   * tcp, local, and mpi initialized by the program at a lower thread level (whose MPI calls
//     one transport's mutex must serialize): a view that posts on the parent's connections with
//     the tags it is given (barrier included); nothing collective. Two views may share a rank,
//     and the traffic of one never reaches the other as long as no pair of ranks belongs to both
//     (a data x pipeline layout: a replica's pipeline and a stage's data group meet in one rank
//     only) or they use different tags.
std::unique_ptr<Transport> make_group(Transport& parent, const std::vector<int>& world_ranks);

// Creates `world_size` connected in-process transports; transports[r] is rank r. Each may be
// used (and destroyed) by its own thread. Destroying one is seen by the others as that peer
// shutting down: their pending and later receives from it fail with CommError.
std::vector<std::unique_ptr<Transport>> make_local_transports(int world_size,
                                                              const TransportOptions& options = {});

}  // namespace pipemat::comm
