// Device lanes: Note [Device lanes] in pipemat/comm/device_lane.h. The lane's protocol (control
// messages in order per peer, lists filed by tag) and the transport link; the NCCL link is in
// nccl/link.cpp.

#include "pipemat/comm/device_lane.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include "device_lane_impl.h"
#include "pipemat/core/error.h"
#include "tensor_wire.h"
#include "tensor_work.h"

namespace pipemat::comm {

using ::pipemat::detail::concat;

LaneLink::~LaneLink() = default;

namespace {

// A lane's send or receive: a Work completed by polling (progress(), as mpi's are driven by
// their waiters), never by a thread of its own.
class LaneWork final : public Work {
 public:
  // `withdraw` (receives) takes back an aborted receive, as a transport withdraws one: a list it
  // had been given goes back, so the next receive of its tag gets it.
  // `silence` is the peer's, from the transport's work beneath (Note [Liveness of a peer]).
  using Silence = std::function<std::optional<Clock::duration>()>;
  LaneWork(WorkInfo info, std::chrono::milliseconds timeout, LaneLink::Poll poll, Silence silence,
           std::function<void()> withdraw = nullptr)
      : Work(std::move(info), timeout),
        poll_(std::move(poll)),
        silence_(std::move(silence)),
        withdraw_(std::move(withdraw)) {}

 protected:
  bool needs_progress() const override { return true; }
  std::optional<Clock::duration> peer_silence() const override { return silence_(); }
  void progress() override {
    if (done()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (done() || !poll_) return;
    if (std::optional<Status> outcome = poll_()) {
      poll_ = nullptr;  // releases what the poll held (the tensors, the link's events)
      finish(*outcome);
    }
  }
  // Under the lock progress() takes, so a receive either completes with its list or gives it
  // back (withdraw), never both. A link's transfer cannot be withdrawn: its tensors stay held by
  // the list until it ends.
  void abort_impl(const Status& reason) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done()) return;
    if (withdraw_) {
      try {
        withdraw_();
      } catch (...) {  // a lock that cannot be had: the receive keeps its place
      }
    }
    poll_ = nullptr;
    finish(reason);
  }

 private:
  std::mutex mutex_;
  LaneLink::Poll poll_;
  const Silence silence_;
  const std::function<void()> withdraw_;
};

// "tcp", "tcp+nccl": transport_name's words, also before a lane is attached.
std::string joined_name(TransportKind kind, const std::string& link) {
  return to_string(kind) + (link.empty() ? "" : "+" + link);
}

Status comm_error(std::string message) {
  return Status{StatusCode::kCommError, std::move(message)};
}

}  // namespace

// The lane of one job transport. Per peer: a lock that keeps a send's control message and its
// link transfer in one order, and the receive side (the posted control receive, the lists that
// arrived and the receives that wait, by tag).
class DeviceLane : public std::enable_shared_from_this<DeviceLane> {
 public:
  struct List {
    std::vector<at::Tensor> tensors;
    LaneLink::Poll ready;  // null: nothing on the link
  };
  // One recv_tensors: the list it gets, in posting order per tag.
  struct Claim {
    std::shared_ptr<List> list;
  };
  struct Incoming {
    std::mutex mutex;
    WorkPtr control;
    std::optional<Status> failed;
    std::map<int, std::deque<std::shared_ptr<List>>> arrived;
    std::map<int, std::deque<std::shared_ptr<Claim>>> waiting;
  };

  DeviceLane(Transport& transport, std::unique_ptr<LaneLink> link)
      : transport_(transport),
        link_(std::move(link)),
        where_(joined_name(transport.kind(), link_->name())),
        outgoing_(static_cast<size_t>(transport.world_size())),
        incoming_(static_cast<size_t>(transport.world_size())) {
    for (int peer = 0; peer < transport.world_size(); ++peer) {
      if (peer == transport.rank()) continue;
      incoming_[static_cast<size_t>(peer)].control =
          recv_any_reserved(transport_, peer, kLaneControlTag);
    }
  }

  const LaneLink& link() const { return *link_; }

  TensorListWork send(Transport& via, int peer, int tag, const std::vector<at::Tensor>& tensors) {
    const int job_peer = checked_job_peer(via, peer, tag, "send to");
    detail::ListMessage message =
        detail::encode_list(tensors, transport_.rank(), job_peer, tag, link_.get());
    uint64_t bytes = message.total;
    for (const at::Tensor& tensor : message.carried) bytes += tensor.nbytes();
    WorkPtr control;
    LaneLink::Poll carried;
    {
      // The link's order is the control messages' order (Note [Device lanes]).
      Outgoing& out = outgoing_[static_cast<size_t>(job_peer)];
      std::lock_guard<std::mutex> lock(out.mutex);
      PIPEMAT_CHECK(out.broken.empty(), CommError, "the device lane (", where_, ") to rank ",
                    job_peer, " is broken: ", out.broken);
      control = send_reserved(transport_, job_peer, kLaneControlTag, std::move(message.spans),
                              std::move(message.owned));
      if (!message.carried.empty()) {
        try {
          carried = link_->send(job_peer, std::move(message.carried));
        } catch (const std::exception& e) {
          // The control message is out and its bytes are not: the peer's link receives would be
          // one transfer behind from now on.
          out.broken = concat("a link send on tag ", tag, " failed: ", e.what());
          throw;
        }
      }
    }
    // The work holds the lane weakly: polled after the transport (and with it the lane and its
    // link) is gone, it fails instead of touching them.
    std::weak_ptr<DeviceLane> lane = weak_from_this();
    LaneLink::Poll poll = [lane, control, carried]() -> std::optional<Status> {
      if (!control->is_completed()) return std::nullopt;
      if (!control->status().ok()) return control->status();
      if (!carried) return Status{};
      const std::shared_ptr<DeviceLane> alive = lane.lock();
      if (!alive) return gone();
      return carried();
    };
    auto state = std::make_shared<TensorListWork::State>();
    state->mode = detail::Mode::kSend;
    state->tensors = tensors;
    state->work =
        std::make_shared<LaneWork>(info(OpKind::kSend, job_peer, tag, bytes), transport_.timeout(),
                                   std::move(poll), [control] { return control->silence(); });
    return TensorListWork(std::move(state));
  }

  TensorListWork recv(Transport& via, int peer, int tag) {
    const int job_peer = checked_job_peer(via, peer, tag, "recv from");
    auto claim = std::make_shared<Claim>();
    Incoming& in = incoming_[static_cast<size_t>(job_peer)];
    {
      std::lock_guard<std::mutex> lock(in.mutex);
      auto& arrived = in.arrived[tag];
      if (!arrived.empty()) {
        claim->list = std::move(arrived.front());
        arrived.pop_front();
      } else {
        in.waiting[tag].push_back(claim);
      }
    }
    // The work holds the lane weakly, as a send's does.
    std::weak_ptr<DeviceLane> lane = weak_from_this();
    LaneLink::Poll poll = [lane, job_peer, claim]() -> std::optional<Status> {
      const std::shared_ptr<DeviceLane> self = lane.lock();
      if (!self) return gone();
      std::shared_ptr<List> list;
      {
        Incoming& from = self->incoming_[static_cast<size_t>(job_peer)];
        std::lock_guard<std::mutex> lock(from.mutex);
        self->pump(job_peer, from);
        list = claim->list;
        if (!list) return from.failed;  // nullopt while the list has not come
      }
      if (!list->ready) return Status{};
      return list->ready();
    };
    auto state = std::make_shared<TensorListWork::State>();
    state->mode = detail::Mode::kRecvAny;
    state->take = [claim] { return claim->list->tensors; };
    WorkInfo work_info = info(OpKind::kRecv, job_peer, tag, 0);
    work_info.any_size = true;
    auto withdraw = [lane, job_peer, tag, claim] {
      const std::shared_ptr<DeviceLane> self = lane.lock();
      if (!self) return;
      Incoming& from = self->incoming_[static_cast<size_t>(job_peer)];
      std::lock_guard<std::mutex> lock(from.mutex);
      auto& waiting = from.waiting[tag];
      waiting.erase(std::remove(waiting.begin(), waiting.end(), claim), waiting.end());
      // A list it had goes to the next receive of the tag, ahead of those that came later.
      if (claim->list) file(from, tag, std::move(claim->list), /*first=*/true);
    };
    auto silence = [lane, job_peer]() -> std::optional<Clock::duration> {
      const std::shared_ptr<DeviceLane> self = lane.lock();
      if (!self) return std::nullopt;
      Incoming& from = self->incoming_[static_cast<size_t>(job_peer)];
      WorkPtr control;
      {
        std::lock_guard<std::mutex> lock(from.mutex);
        control = from.control;
      }
      return control->silence();
    };
    state->work =
        std::make_shared<LaneWork>(std::move(work_info), transport_.timeout(), std::move(poll),
                                   std::move(silence), std::move(withdraw));
    return TensorListWork(std::move(state));
  }

 private:
  // The job rank of `via`'s rank `peer`, checked as the transport checks a peer and a tag.
  int checked_job_peer(const Transport& via, int peer, int tag, const char* verb) const {
    const int job_peer = via.job_rank_of(peer);
    PIPEMAT_CHECK(tag >= 0 && tag <= kMaxUserTag, ConfigError, via.describe(), ": tag ", tag,
                  " for ", verb, " rank ", peer, " is outside 0..", kMaxUserTag);
    PIPEMAT_CHECK(job_peer != transport_.rank(), ConfigError, via.describe(), ": cannot ", verb,
                  " itself (peer == rank)");
    return job_peer;
  }

  WorkInfo info(OpKind op, int job_peer, int tag, uint64_t bytes) const {
    WorkInfo out;
    out.op = op;
    out.rank = transport_.rank();
    out.peer = job_peer;
    out.tag = tag;
    out.bytes = bytes;
    out.transport = where_;
    return out;
  }

  // Reads every control message from `peer` that has arrived, in order: allocates its carried
  // entries, posts their link receive and files the list under its tag. Under in.mutex.
  void pump(int peer, Incoming& in) {
    while (!in.failed && in.control->is_completed()) {
      const Status status = in.control->status();
      if (!status.ok()) {
        in.failed = comm_error(concat("the device lane (", where_, ") lost rank ", peer,
                                      ": its control message failed: ", status.message));
        break;
      }
      const Buffer buffer = in.control->buffer();
      const WorkInfo control_info = in.control->info();
      in.control = recv_any_reserved(transport_, peer, kLaneControlTag);
      int tag = -1;
      std::string why;
      std::shared_ptr<List> list;
      try {
        list = decode(buffer, control_info, tag, why);
      } catch (const std::exception& e) {
        // The link's order is lost with this list's transfer: nothing later from the peer can
        // be trusted.
        in.failed =
            comm_error(concat("the device lane (", where_, ") could not take a list from rank ",
                              peer, " on tag ", tag, ": ", e.what()));
        break;
      }
      if (!list) {
        in.failed = comm_error(concat("rank ", peer, " sent a corrupt device-lane list to rank ",
                                      transport_.rank(), " (", where_, "): ", why,
                                      ". Both ranks must run the same pipemat build with the "
                                      "same lane."));
        break;
      }
      file(in, tag, std::move(list), /*first=*/false);
    }
  }

  // Gives `list` to the earliest receive of `tag` that waits, or keeps it for the next one (at
  // the front of those kept when `first`). Under in.mutex.
  static void file(Incoming& in, int tag, std::shared_ptr<List> list, bool first) {
    auto& waiting = in.waiting[tag];
    if (!waiting.empty()) {
      waiting.front()->list = std::move(list);
      waiting.pop_front();
    } else if (first) {
      in.arrived[tag].push_front(std::move(list));
    } else {
      in.arrived[tag].push_back(std::move(list));
    }
  }

  // The list of one control message, its carried entries' receives posted; null with `why`.
  std::shared_ptr<List> decode(const Buffer& buffer, const WorkInfo& control_info, int& tag,
                               std::string& why) {
    if (buffer.size() < detail::kListHeaderBytes) {
      why = concat("its control message has ", buffer.size(), " bytes, less than a list header");
      return nullptr;
    }
    detail::ListHeader header;
    std::memcpy(&header, buffer.data(), sizeof(header));
    if (header.magic != detail::kLaneListMagic) {
      why = "its control message is not a lane's list";
      return nullptr;
    }
    if (header.reserved > static_cast<uint32_t>(kMaxUserTag)) {
      why = concat("its tag ", header.reserved, " is above ", kMaxUserTag);
      return nullptr;
    }
    tag = static_cast<int>(header.reserved);
    auto list = std::make_shared<List>();
    std::vector<detail::LaneEntry> entries;
    if (!detail::decode_list(buffer, control_info, list->tensors, why, &entries)) return nullptr;
    if (entries.empty()) return list;
    // Carried entries have no bytes in the message to check their size against: a corrupt or
    // hostile header must not make this rank allocate without bound.
    uint64_t carried_bytes = 0;
    for (const detail::LaneEntry& entry : entries) carried_bytes += entry.meta.nbytes();
    if (carried_bytes > kDefaultMaxMessageBytes) {
      why =
          concat("its entries on the link hold ", carried_bytes, " bytes, more than the limit of ",
                 kDefaultMaxMessageBytes, " per list (kDefaultMaxMessageBytes)");
      return nullptr;
    }
    std::vector<at::Tensor> carried;
    carried.reserve(entries.size());
    for (const detail::LaneEntry& entry : entries) {
      at::Tensor tensor = link_->empty(entry.meta);
      carried.push_back(tensor);
      if (entry.requires_grad) tensor.set_requires_grad(true);
      list->tensors[entry.index] = std::move(tensor);
    }
    list->ready = link_->recv(control_info.peer, std::move(carried));
    return list;
  }

  struct Outgoing {
    std::mutex mutex;
    std::string broken;  // set when a link send failed after its control message went out
  };

  static Status gone() {
    return Status{StatusCode::kAborted, "the device lane's transport was destroyed"};
  }

  Transport& transport_;
  std::unique_ptr<LaneLink> link_;
  const std::string where_;
  std::vector<Outgoing> outgoing_;
  std::vector<Incoming> incoming_;
};

std::shared_ptr<DeviceLane> make_device_lane(Transport& transport, std::unique_ptr<LaneLink> link) {
  PIPEMAT_CHECK(link != nullptr, ConfigError, transport.describe(),
                ": make_device_lane needs a link");
  bool job_ranks = transport.rank() == transport.job_rank();
  for (int r = 0; r < transport.world_size(); ++r)
    job_ranks = job_ranks && transport.job_rank_of(r) == r;
  PIPEMAT_CHECK(job_ranks, ConfigError, transport.describe(),
                ": a device lane belongs on the job's transport, not on a group of it");
  return std::make_shared<DeviceLane>(transport, std::move(link));
}

std::string lane_name(const Transport& transport) {
  const DeviceLane* lane = transport.device_lane();
  return lane == nullptr ? std::string() : lane->link().name();
}

bool lane_carries(const Transport& transport, const at::Tensor& tensor) {
  const DeviceLane* lane = transport.device_lane();
  return lane != nullptr && tensor.defined() && lane->link().carries(tensor);
}

std::string transport_name(const Transport& transport) {
  return joined_name(transport.kind(), lane_name(transport));
}

namespace detail {

TensorListWork lane_send(DeviceLane& lane, Transport& transport, int peer, int tag,
                         const std::vector<at::Tensor>& tensors) {
  return lane.send(transport, peer, tag, tensors);
}

TensorListWork lane_recv(DeviceLane& lane, Transport& transport, int peer, int tag) {
  return lane.recv(transport, peer, tag);
}

}  // namespace detail

// ---- the transport link ----

namespace {

// Carries CPU tensors of at least `min_numel` elements over the transport itself, on
// kLaneDataTag: one message per tensor, in posting order per peer (the transport's order per
// peer and tag), which is the order a link keeps.
class TransportLink final : public LaneLink {
 public:
  TransportLink(Transport& transport, int64_t min_numel)
      : transport_(transport), min_numel_(min_numel) {}

  std::string name() const override { return "transport"; }
  bool carries(const at::Tensor& tensor) const override {
    return tensor.device().is_cpu() && tensor.numel() >= min_numel_;
  }
  at::Tensor empty(const TensorMeta& meta) const override {
    return at::empty(meta.shape, at::TensorOptions().dtype(meta.dtype));
  }
  Poll send(int peer, std::vector<at::Tensor> tensors) override {
    std::vector<WorkPtr> works;
    for (const at::Tensor& tensor : tensors) {
      works.push_back(send_reserved(transport_, peer, kLaneDataTag,
                                    {ConstSpan{tensor.data_ptr(), tensor.nbytes()}},
                                    std::make_shared<at::Tensor>(tensor)));
    }
    return all_of(std::move(works));
  }
  Poll recv(int peer, std::vector<at::Tensor> tensors) override {
    // Posted as receives of any size (the only kind a reserved tag has), checked and copied in
    // when they complete: the sizes come from the control message, which the checks trust no
    // more than the link's bytes.
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < tensors.size(); ++i) {
      works.push_back(recv_any_reserved(transport_, peer, kLaneDataTag));
    }
    Poll arrived = all_of(works);
    return [arrived, works, tensors]() -> std::optional<Status> {
      std::optional<Status> outcome = arrived();
      if (!outcome || !outcome->ok()) return outcome;
      for (size_t i = 0; i < tensors.size(); ++i) {
        const Buffer buffer = works[i]->buffer();
        if (buffer.size() != tensors[i].nbytes()) {
          return comm_error(concat("the device lane's link brought ", buffer.size(),
                                   " bytes from rank ", works[i]->info().peer, " for an entry of ",
                                   tensors[i].nbytes(), " bytes"));
        }
        if (buffer.size() > 0) std::memcpy(tensors[i].data_ptr(), buffer.data(), buffer.size());
      }
      return Status{};
    };
  }

 private:
  static Poll all_of(std::vector<WorkPtr> works) {
    return [works = std::move(works)]() -> std::optional<Status> {
      for (const WorkPtr& work : works) {
        if (!work->is_completed()) return std::nullopt;
      }
      for (const WorkPtr& work : works) {
        if (!work->status().ok()) return work->status();
      }
      return Status{};
    };
  }

  Transport& transport_;
  const int64_t min_numel_;
};

}  // namespace

std::unique_ptr<LaneLink> make_transport_link(Transport& transport, int64_t min_numel) {
  PIPEMAT_CHECK(min_numel >= 0, ConfigError, "make_transport_link: min_numel ", min_numel,
                " is negative");
  return std::make_unique<TransportLink>(transport, min_numel);
}

}  // namespace pipemat::comm
