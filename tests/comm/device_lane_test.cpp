// Device lanes (Note [Device lanes]): the protocol end to end over the transport link, which
// carries the CPU tensors of at least a few elements, and the NCCL link where two GPUs are at hand.

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pipemat/comm/device_lane.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "tensor_wire.h"
#include "test_util.h"

namespace pipemat::comm {
namespace {

using testing::run_threads;
using Tensors = std::vector<at::Tensor>;

// Counts what goes over a link, to show which entries took it.
struct LinkCounts {
  std::atomic<int> sent_tensors{0};
  std::atomic<int64_t> sent_bytes{0};
  std::atomic<int> received_tensors{0};
};

class CountingLink final : public LaneLink {
 public:
  CountingLink(std::unique_ptr<LaneLink> inner, LinkCounts& counts)
      : inner_(std::move(inner)), counts_(counts) {}
  std::string name() const override { return "counting " + inner_->name(); }
  bool carries(const at::Tensor& t) const override { return inner_->carries(t); }
  at::Tensor empty(const TensorMeta& meta) const override { return inner_->empty(meta); }
  Poll send(int peer, Tensors tensors) override {
    counts_.sent_tensors += static_cast<int>(tensors.size());
    for (const auto& t : tensors) counts_.sent_bytes += static_cast<int64_t>(t.nbytes());
    return inner_->send(peer, std::move(tensors));
  }
  Poll recv(int peer, Tensors tensors) override {
    counts_.received_tensors += static_cast<int>(tensors.size());
    return inner_->recv(peer, std::move(tensors));
  }

 private:
  std::unique_ptr<LaneLink> inner_;
  LinkCounts& counts_;
};

// `world` local transports, each with a lane over the transport link (entries of >= 4 elements).
testing::Group lane_group(int world, std::vector<LinkCounts>& counts) {
  testing::Group group = make_local_transports(world);
  counts = std::vector<LinkCounts>(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    Transport& t = *group[static_cast<size_t>(r)];
    auto link =
        std::make_unique<CountingLink>(make_transport_link(t, 4), counts[static_cast<size_t>(r)]);
    t.attach_device_lane(make_device_lane(t, std::move(link)));
  }
  return group;
}

// The CommError a receive ends with, or "no error".
std::string comm_error_of(const TensorListWork& work) {
  try {
    work.wait(std::chrono::seconds(30));
  } catch (const CommError& e) {
    return e.what();
  }
  return "no error";
}

// A list of two carried entries (one requiring grad), an inline scalar and an undefined entry.
Tensors list_of(double base) {
  at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3}) + base;
  a.set_requires_grad(true);
  return {a, at::full({5}, base, at::kLong), at::tensor(base, at::kDouble), at::Tensor()};
}

void expect_list(const Tensors& got, double base) {
  const Tensors want = list_of(base);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i + 1 < want.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(got[i].defined());
    EXPECT_EQ(got[i].scalar_type(), want[i].scalar_type());
    EXPECT_EQ(got[i].sizes(), want[i].sizes());
    EXPECT_TRUE(at::equal(got[i].detach(), want[i].detach()));
    EXPECT_EQ(got[i].requires_grad(), want[i].requires_grad());
  }
  EXPECT_FALSE(got.back().defined());
}

// The receiver takes tag 2 before tag 1 although tag 1 was sent first: the lane reads the control
// messages in the sender's order and files them by tag. Per tag the order is the sender's.
TEST(DeviceLane, ListsArriveByTagInTheSendersOrderPerTag) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  run_threads(2, [&](int rank) {
    Transport& t = *group[static_cast<size_t>(rank)];
    if (rank == 0) {
      std::vector<TensorListWork> sends = {send_tensors(t, 1, 1, list_of(10)),
                                           send_tensors(t, 1, 2, list_of(20)),
                                           send_tensors(t, 1, 1, list_of(30))};
      for (auto& s : sends) s.wait();
    } else {
      expect_list(recv_tensors(t, 0, 2).wait(), 20);
      TensorListWork first = recv_tensors(t, 0, 1);
      TensorListWork second = recv_tensors(t, 0, 1);
      expect_list(second.wait(), 30);
      expect_list(first.wait(), 10);
    }
  });
  // Each list: the 2x3 floats and the 5 longs took the link (24 + 40 bytes), the scalar did not.
  EXPECT_EQ(counts[0].sent_tensors, 6);
  EXPECT_EQ(counts[0].sent_bytes, 3 * (24 + 40));
  EXPECT_EQ(counts[1].received_tensors, 6);
  EXPECT_EQ(counts[1].sent_tensors, 0);
  EXPECT_EQ(lane_name(*group[0]), "counting transport");
}

// Two ranks that send to each other first and receive afterwards (a data-parallel exchange), many
// times, with large entries.
TEST(DeviceLane, BothDirectionsAtOnce) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  run_threads(2, [&](int rank) {
    Transport& t = *group[static_cast<size_t>(rank)];
    const int peer = 1 - rank;
    for (int i = 0; i < 20; ++i) {
      const at::Tensor mine = at::full({256, 256}, double(rank * 100 + i));
      TensorListWork send = send_tensors(t, peer, 7, {mine});
      const Tensors got = recv_tensors(t, peer, 7).wait();
      send.wait();
      ASSERT_EQ(got.size(), 1u);
      EXPECT_TRUE(at::equal(got[0], at::full({256, 256}, double(peer * 100 + i))));
    }
  });
  EXPECT_EQ(counts[0].sent_bytes, 20 * 256 * 256 * 4);
  EXPECT_EQ(counts[1].sent_bytes, 20 * 256 * 256 * 4);
}

// A group's view uses the job transport's lane with job ranks: the data group {1, 3} of four.
TEST(DeviceLane, GroupsUseTheJobsLaneWithJobRanks) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(4, counts);
  run_threads(4, [&](int rank) {
    Transport& t = *group[static_cast<size_t>(rank)];
    if (rank % 2 == 0) return;
    auto pair = make_group(t, {1, 3});
    EXPECT_EQ(pair->device_lane(), t.device_lane());
    EXPECT_EQ(pair->job_rank_of(1), 3);
    const int peer = 1 - pair->rank();
    TensorListWork send = send_tensors(*pair, peer, 3, list_of(rank));
    expect_list(recv_tensors(*pair, peer, 3).wait(), 4 - rank);
    send.wait();
  });
  EXPECT_EQ(counts[1].sent_tensors, 2);
  EXPECT_EQ(counts[3].received_tensors, 2);
  EXPECT_EQ(counts[0].sent_tensors + counts[2].sent_tensors, 0);
}

// A receive that timed out is withdrawn, as a transport's is: the list sent later goes to the
// next receive of its tag.
TEST(DeviceLane, ATimedOutReceiveIsWithdrawn) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  TensorListWork early = recv_tensors(*group[1], 0, 9);
  EXPECT_THROW(early.wait(std::chrono::milliseconds(100)), TimeoutError);
  TensorListWork send = send_tensors(*group[0], 1, 9, list_of(5));
  expect_list(recv_tensors(*group[1], 0, 9).wait(), 5);
  send.wait();
  EXPECT_THROW(early.wait(), TimeoutError);  // the same error again
}

// Note [Liveness of a peer] holds through a lane: its receive asks the transport's control receive
// beneath how long the peer has been silent, so a live peer (its heartbeats arrive) gets up to
// twice the timeout, and the message says it is alive.
TEST(DeviceLane, AWaitGivesALivePeerTwiceTheTimeout) {
  TransportOptions options;
  options.timeout = std::chrono::seconds(2);  // as commTcpTimeout's: beats every 500 ms
  testing::Group group = testing::make_group(TransportKind::kTcp, 2, options);
  group[0]->attach_device_lane(make_device_lane(*group[0], make_transport_link(*group[0], 1)));
  const auto start = Clock::now();
  std::string what = "no timeout";
  try {
    recv_tensors(*group[0], 1, 9).wait();
  } catch (const TimeoutError& e) {
    what = e.what();
  }
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  EXPECT_GE(waited, 4000) << what;
  EXPECT_NE(what.find("from rank 1 with tag 9 on rank 0 (tcp+transport). Rank 1 is alive"),
            std::string::npos)
      << what;
}

// A receive aborted after another receive's poll had given it its list hands the list on: the
// next receive of the tag gets it.
TEST(DeviceLane, AnAbortedReceiveHandsItsListOn) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  TensorListWork first = recv_tensors(*group[1], 0, 3);
  TensorListWork second = recv_tensors(*group[1], 0, 3);
  send_tensors(*group[0], 1, 3, list_of(7)).wait();  // the control message is at rank 1 now
  // `second`'s poll reads it and gives the list to `first`, the earlier receive; `second` waits.
  EXPECT_FALSE(second.is_completed());
  first.abort();
  expect_list(second.wait(std::chrono::seconds(10)), 7);
  EXPECT_THROW(first.wait(), CommError);
}

// A work polled after its transport (and with it the lane) is gone fails; it touches neither.
TEST(DeviceLane, AWorkOutlivingItsTransportFails) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  TensorListWork recv = recv_tensors(*group[1], 0, 2);
  group.clear();
  EXPECT_THROW(recv.wait(std::chrono::milliseconds(100)), CommError);
}

// Entries on the link carry no bytes in the control message to check their size against: a
// header asking for more than kDefaultMaxMessageBytes is refused before anything is allocated.
TEST(DeviceLane, AHostileEntrySizeIsRefusedBeforeAllocating) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  const std::vector<int64_t> shape{int64_t{1} << 40};
  const size_t entry = detail::header_size(1);
  std::vector<uint8_t> message(detail::kListHeaderBytes + entry, 0);
  detail::ListHeader header;
  header.magic = detail::kLaneListMagic;
  header.sender = 0;
  header.count = 1;
  header.reserved = 4;  // the tag
  header.total_bytes = message.size();
  std::memcpy(message.data(), &header, sizeof(header));
  detail::write_header(message.data() + detail::kListHeaderBytes,
                       detail::wire_dtype_code(at::kFloat).value(), shape, 0, uint64_t{4} << 40,
                       detail::kFlagOnLane);
  send_reserved(*group[0], 1, kLaneControlTag, {ConstSpan{message.data(), message.size()}})->wait();
  const std::string what = comm_error_of(recv_tensors(*group[1], 0, 4));
  EXPECT_NE(what.find("its entries on the link hold 4398046511104 bytes, more than the limit of "
                      "17179869184 per list"),
            std::string::npos)
      << what;
}

// A link that cannot take a list (its allocation fails) fails that receive and every later one
// from the peer with a CommError: the link's order is lost.
TEST(DeviceLane, ALinkThatCannotTakeAListFailsThePeer) {
  class FailingLink final : public LaneLink {
   public:
    explicit FailingLink(std::unique_ptr<LaneLink> inner) : inner_(std::move(inner)) {}
    std::string name() const override { return "failing"; }
    bool carries(const at::Tensor& t) const override { return inner_->carries(t); }
    at::Tensor empty(const TensorMeta&) const override {
      throw std::runtime_error("out of device memory");
    }
    Poll send(int peer, Tensors t) override { return inner_->send(peer, std::move(t)); }
    Poll recv(int peer, Tensors t) override { return inner_->recv(peer, std::move(t)); }

   private:
    std::unique_ptr<LaneLink> inner_;
  };
  testing::Group group = make_local_transports(2);
  for (auto& t : group) {
    t->attach_device_lane(
        make_device_lane(*t, std::make_unique<FailingLink>(make_transport_link(*t, 1))));
  }
  TensorListWork send = send_tensors(*group[0], 1, 6, {at::ones({8})});
  const std::string what = comm_error_of(recv_tensors(*group[1], 0, 6));
  EXPECT_NE(what.find("the device lane (local+failing) could not take a list from rank 0 on tag "
                      "6: out of device memory"),
            std::string::npos)
      << what;
  EXPECT_THROW(recv_tensors(*group[1], 0, 7).wait(), CommError);
  send.abort();
}

TEST(DeviceLane, WrongUseIsAConfigError) {
  testing::Group group = make_local_transports(3);
  Transport& t = *group[0];
  auto view = make_group(t, {0, 2});
  try {
    make_device_lane(*view, make_transport_link(t, 1));
    FAIL() << "a lane on a group";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not on a group"), std::string::npos) << e.what();
  }
  t.attach_device_lane(make_device_lane(t, make_transport_link(t, 1)));
  EXPECT_THROW(t.attach_device_lane(make_device_lane(t, make_transport_link(t, 1))), ConfigError);
  EXPECT_THROW(send_tensors(t, 0, 1, {at::ones({4})}), ConfigError);   // itself
  EXPECT_THROW(send_tensors(t, 1, -1, {at::ones({4})}), ConfigError);  // tag
  EXPECT_THROW(recv_tensors(t, 3, 1), ConfigError);                    // rank
  EXPECT_THROW(make_transport_link(t, -1), ConfigError);
}

// A control message that is no lane's list fails the receive naming both ranks; so does every
// later list from that rank.
TEST(DeviceLane, ACorruptControlMessageIsACommError) {
  std::vector<LinkCounts> counts;
  testing::Group group = lane_group(2, counts);
  static const char kJunk[80] = "not a list";
  send_reserved(*group[0], 1, kLaneControlTag, {ConstSpan{kJunk, sizeof(kJunk)}})->wait();
  const std::string what = comm_error_of(recv_tensors(*group[1], 0, 5));
  EXPECT_NE(what.find("rank 0 sent a corrupt device-lane list to rank 1"), std::string::npos)
      << what;
  EXPECT_THROW(recv_tensors(*group[1], 0, 6).wait(), CommError);
}

// A rank without a lane sends plain lists, which a lane's receive never sees: it times out.
TEST(DeviceLane, AListFromARankWithoutALaneTimesOut) {
  testing::Group group = make_local_transports(2);
  group[1]->attach_device_lane(make_device_lane(*group[1], make_transport_link(*group[1], 1)));
  TensorListWork send = send_tensors(*group[0], 1, 4, {at::ones({8})});
  TensorListWork recv = recv_tensors(*group[1], 0, 4);
  EXPECT_THROW(recv.wait(std::chrono::milliseconds(200)), TimeoutError);
  send.abort();
}

TEST(DeviceLane, NcclNeedsAVisibleDevice) {
  if (torch::cuda::device_count() > 0) GTEST_SKIP() << "a CUDA device is visible";
  testing::Group group = make_local_transports(1);
  try {
    make_nccl_link(*group[0], 0);
    FAIL() << "an NCCL link without a GPU";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find(nccl_compiled() ? "visible CUDA devices" : "built without NCCL") !=
                std::string::npos)
        << what;
  }
}

// Two ranks (threads) on two GPUs: lists with device entries go GPU to GPU over NCCL.
TEST(DeviceLane, NcclCarriesDeviceTensorsBetweenTwoGpus) {
  if (!nccl_compiled()) GTEST_SKIP() << "built without NCCL";
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "needs two visible CUDA devices (NCCL refuses two ranks on one GPU)";
  }
  testing::Group group = make_local_transports(2);
  run_threads(2, [&](int rank) {
    Transport& t = *group[static_cast<size_t>(rank)];
    t.attach_device_lane(make_device_lane(t, make_nccl_link(t, rank)));
    const at::Device gpu(at::kCUDA, static_cast<c10::DeviceIndex>(rank));
    const int peer = 1 - rank;
    for (int i = 0; i < 5; ++i) {
      const at::Tensor mine = at::full({1024, 257}, double(rank * 10 + i), at::device(gpu));
      TensorListWork send = send_tensors(t, peer, 1, {mine, at::tensor(i)});
      const Tensors got = recv_tensors(t, peer, 1).wait();
      send.wait();
      ASSERT_EQ(got.size(), 2u);
      EXPECT_EQ(got[0].device(), gpu);
      EXPECT_TRUE(at::equal(got[0].cpu(), at::full({1024, 257}, double(peer * 10 + i))));
      EXPECT_TRUE(got[1].device().is_cpu());
      EXPECT_EQ(got[1].item<int64_t>(), i);
    }
  });
}

}  // namespace
}  // namespace pipemat::comm
