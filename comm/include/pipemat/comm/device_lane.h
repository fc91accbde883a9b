#pragma once
// Device lanes (target pipemat_comm_tensor): tensor lists whose device tensors travel between
// devices directly (NCCL), not through host memory. Note [Device lanes].

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pipemat/comm/tensor.h"
#include "pipemat/comm/transport.h"

namespace pipemat::comm {

// Note [Device lanes]
// ~~~~~~~~~~~~~~~~~~~
// A lane attached to a job's transport (Transport::attach_device_lane) takes over its tensor
// lists, send_tensors and recv_tensors, on it and on every group made of it; byte messages and
// single tensors still go over the transport. A list becomes two things:
//   * a control message over the transport, on a tag above kMaxUserTag: a 64-byte lane header
//     (magic "PMD1", the list's tag) and the list's wire format (pipemat/comm/tensor.h), in which
//     each entry the link carries (LaneLink::carries: a tensor on its device) has the flag
//     "on the lane" and no data block;
//   * the carried entries' bytes, over the link (LaneLink: ncclSend/ncclRecv for NCCL).
// A link moves bytes in the order they were posted per pair of ranks and direction, and knows no
// tags (NCCL matches the k-th send to a rank with the k-th receive from it). The lane keeps the
// order: a send posts its control message and its link send under one lock per peer, so control
// messages (which the transport delivers in order per peer and tag) say in what order the link's
// bytes come. The receiver reads them in that order, whatever tags it waits for: it allocates
// each list's carried entries on its device (LaneLink::empty), posts the link's receive, and
// files the list under its tag; recv_tensors(peer, tag) takes the lists of that tag in order, as
// the transport does. Nothing needs a thread: receives read control messages when they are
// polled or waited on (as mpi drives its requests), and a list that nobody receives yet waits
// on its device. A list of host tensors only costs its control message, as before.
//
// Both ranks of a pair must have the lane (every rank of the job attaches one of the same kind)
// and the same link: a list from a rank without one never reaches a receive with one (the receive
// times out naming the peer and the tag). Errors
// name both ranks, the tag and the link: a control message that fails its checks is a CommError,
// as a corrupt list is; a failed control or link transfer fails every list that waits on it.
//
// Groups: a view (tcp, local) and an mpi sub-communicator use the job transport's lane with job
// ranks (Transport::job_rank_of); two groups must keep their tags apart where a pair of ranks
// belongs to both, as Note [Groups of ranks] says for the transport.
//
// Lifetime: attach the lane right after the transport is made, before groups and before any
// list is sent; it lives as long as the transport. Thread-safe like the transport.
class LaneLink {
 public:
  virtual ~LaneLink();

  // "nccl", "host"
  virtual std::string name() const = 0;
  // True when `tensor`'s bytes travel over this link (a tensor on its device).
  virtual bool carries(const at::Tensor& tensor) const = 0;
  // An uninitialized contiguous tensor of `meta` on the link's device, where a received entry
  // lands.
  virtual at::Tensor empty(const TensorMeta& meta) const = 0;

  // nullopt while in flight; then the outcome (an error names what failed).
  using Poll = std::function<std::optional<Status>()>;
  // Posts the bytes of `tensors` (contiguous, carried) to job rank `peer`, after everything
  // posted to it before. The poll says when the tensors may be reused (the link holds them until
  // then).
  virtual Poll send(int peer, std::vector<at::Tensor> tensors) = 0;
  // Posts receives of the next bytes from job rank `peer` into `tensors` (from empty()), after
  // everything posted from it before. The poll says when they hold them and are ready for use.
  virtual Poll recv(int peer, std::vector<at::Tensor> tensors) = 0;
};

// A lane for `transport` (a job's transport, not a group) over `link`; attach it with
// transport.attach_device_lane(lane).
std::shared_ptr<DeviceLane> make_device_lane(Transport& transport, std::unique_ptr<LaneLink> link);

// The lane's link name ("nccl"), or "" for a transport without a lane.
std::string lane_name(const Transport& transport);
// The transport's kind and its lane's link: "tcp", "tcp+nccl" (what errors and the first progress
// line of a run name).
std::string transport_name(const Transport& transport);

// True when `transport` has a lane whose link carries `tensor`: send_tensors moves it as it is,
// with no host copy.
bool lane_carries(const Transport& transport, const at::Tensor& tensor);

// A link over the transport itself (a tag above kMaxUserTag): the lane's protocol end to end
// without a device. It carries the CPU tensors whose element count is at least `min_numel`, so a
// test can send lists that mix carried and inline entries.
std::unique_ptr<LaneLink> make_transport_link(Transport& transport, int64_t min_numel);

// True when this build has the NCCL link.
bool nccl_compiled();
// The NCCL link of this rank's CUDA device `device_index`, bootstrapped over `transport` (the
// job's): every ordered pair of ranks gets its own two-rank communicator (so a pair's two
// directions never wait on each other) and a stream on each side; each sender makes its pairs'
// ids and sends them over the transport. Collective: every rank of the job calls it, and it
// blocks until all communicators are made. ConfigError in a build without NCCL or for a device
// index that is not visible; CommError when NCCL fails (NCCL refuses two ranks on one GPU).
std::unique_ptr<LaneLink> make_nccl_link(Transport& transport, int device_index);

}  // namespace pipemat::comm
