// Note [Groups of ranks] (pipemat/comm/transport.h): a transport that is some ranks of another.

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"

namespace pipemat::comm {
namespace {

int index_of(const std::vector<int>& ranks, int rank) {
  const auto it = std::find(ranks.begin(), ranks.end(), rank);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

class GroupTransport final : public Transport {
 public:
  GroupTransport(Transport& parent, std::vector<int> world_ranks)
      : Transport(parent.kind(), index_of(world_ranks, parent.rank()),
                  static_cast<int>(world_ranks.size()), parent.timeout(), parent.job_rank()),
        parent_(parent),
        world_ranks_(std::move(world_ranks)) {}

  int job_rank_of(int peer) const override {
    return parent_.job_rank_of(world_ranks_[static_cast<size_t>(Transport::job_rank_of(peer))]);
  }
  // The parent's lane: its ranks are job ranks, which job_rank_of gives.
  DeviceLane* device_lane() const override { return parent_.device_lane(); }

 private:
  // The group's peer as the parent's rank; errors then name the parent's ranks, which are the
  // ones a launcher and a log show.
  Request to_parent(Request request) const {
    request.info.rank = parent_.rank();
    request.info.peer = world_ranks_[static_cast<size_t>(request.info.peer)];
    return request;
  }
  WorkPtr post_send(Request request) override {
    return post_send_on(parent_, to_parent(std::move(request)));
  }
  WorkPtr post_recv(Request request) override {
    return post_recv_on(parent_, to_parent(std::move(request)));
  }

  Transport& parent_;
  const std::vector<int> world_ranks_;
};

}  // namespace

std::unique_ptr<Transport> make_group(Transport& parent, const std::vector<int>& world_ranks) {
  PIPEMAT_CHECK(!world_ranks.empty(), ConfigError, parent.describe(), ": a group needs ranks");
  for (size_t i = 0; i < world_ranks.size(); ++i) {
    const int r = world_ranks[i];
    PIPEMAT_CHECK(r >= 0 && r < parent.world_size(), ConfigError, parent.describe(),
                  ": a group's rank ", r, " is outside 0..", parent.world_size() - 1);
    PIPEMAT_CHECK(index_of(world_ranks, r) == static_cast<int>(i), ConfigError, parent.describe(),
                  ": rank ", r, " is twice in a group");
  }
  PIPEMAT_CHECK(index_of(world_ranks, parent.rank()) >= 0, ConfigError, parent.describe(),
                ": not in the group it makes (", world_ranks.size(), " ranks)");
  if (auto own = parent.make_subgroup(world_ranks)) return own;
  return std::make_unique<GroupTransport>(parent, world_ranks);
}

std::unique_ptr<Transport> Transport::make_subgroup(const std::vector<int>&) { return nullptr; }

}  // namespace pipemat::comm
