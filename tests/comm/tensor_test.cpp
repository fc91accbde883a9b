// The tensor layer over every transport x world size: dtypes, shapes, layouts, mismatches.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <mutex>

#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "test_util.h"

namespace pipemat::comm {
namespace {

using testing::Group;

using Param = testing::TransportParam;
using testing::param_name;

class TensorTest : public ::testing::TestWithParam<Param> {
 protected:
  Group make() {
    TransportOptions options;
    options.timeout = std::chrono::seconds(30);
    return testing::make_group(GetParam().kind, GetParam().world_size, options);
  }
};

// Deterministic content that depends on the sender and the index.
std::vector<at::Tensor> samples(int rank) {
  // The global generator is shared by the rank threads: seed and draw under one lock.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  at::manual_seed(1234 + rank);
  std::vector<at::Tensor> out;
  out.push_back(at::randn({3, 4}));
  out.push_back(at::randn({2, 3, 5}, at::kDouble));
  out.push_back(at::arange(7, at::kLong) * (rank + 1));
  out.push_back(at::randn({4, 4}).to(at::kBFloat16));
  out.push_back(at::rand({5}) > 0.5);
  out.push_back(at::empty({0}, at::kByte));
  out.push_back(at::scalar_tensor(3.5 + rank));
  out.push_back(at::randint(0, 100, {6, 2}, at::kInt));
  return out;
}

TEST_P(TensorTest, RoundTripsDtypesAndShapesThroughEveryReceiveFlavour) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    const int next = (t.rank() + 1) % t.world_size();
    const int prev = (t.rank() + t.world_size() - 1) % t.world_size();
    auto mine = samples(t.rank());
    auto theirs = samples(prev);
    // Post the receives first (each flavour on its own tag), then send.
    std::vector<TensorWork> any, expected, into, into_strided;
    std::vector<at::Tensor> prealloc, strided;
    for (size_t i = 0; i < theirs.size(); ++i) {
      const int tag = static_cast<int>(i) * 4;
      any.push_back(recv_tensor(t, prev, tag));
      expected.push_back(recv_tensor(t, prev, tag + 1, TensorMeta::of(theirs[i])));
      prealloc.push_back(at::empty_like(theirs[i]));
      into.push_back(recv_tensor_into(t, prev, tag + 2, prealloc.back()));
      if (theirs[i].dim() == 2) {
        // A non-contiguous destination: the transpose of a fresh buffer.
        strided.push_back(
            at::zeros({theirs[i].size(1), theirs[i].size(0)}, theirs[i].options()).t());
        into_strided.push_back(recv_tensor_into(t, prev, tag + 3, strided.back()));
      }
    }
    std::vector<TensorWork> sends;
    for (size_t i = 0; i < mine.size(); ++i) {
      const int tag = static_cast<int>(i) * 4;
      for (int k = 0; k < 3; ++k) sends.push_back(send_tensor(t, next, tag + k, mine[i]));
      if (mine[i].dim() == 2) sends.push_back(send_tensor(t, next, tag + 3, mine[i]));
    }
    for (auto& s : sends) s.wait();
    size_t strided_index = 0;
    for (size_t i = 0; i < theirs.size(); ++i) {
      at::Tensor a = any[i].wait();
      at::Tensor e = expected[i].wait();
      at::Tensor p = into[i].wait();
      for (const at::Tensor& got : {a, e, p}) {
        EXPECT_EQ(got.scalar_type(), theirs[i].scalar_type()) << i;
        EXPECT_EQ(got.sizes(), theirs[i].sizes()) << i;
        EXPECT_TRUE(at::equal(got, theirs[i])) << "rank " << t.rank() << " sample " << i;
      }
      EXPECT_EQ(p.data_ptr(), prealloc[i].data_ptr());  // received in place
      if (theirs[i].dim() == 2) {
        at::Tensor s = into_strided[strided_index].wait();
        EXPECT_EQ(s.data_ptr(), strided[strided_index].data_ptr());
        EXPECT_TRUE(at::equal(strided[strided_index], theirs[i]));
        ++strided_index;
      }
    }
  });
}

TEST_P(TensorTest, SendsNonContiguousInputs) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    const int next = (t.rank() + 1) % t.world_size();
    const int prev = (t.rank() + t.world_size() - 1) % t.world_size();
    auto base = [](int r) { return at::arange(60, at::kFloat).reshape({6, 10}) + 100 * r; };
    at::Tensor b = base(t.rank());
    std::vector<at::Tensor> views = {b.t(), b.slice(1, 1, 9, 3), b.select(1, 4),
                                     b.unsqueeze(0).expand({3, 6, 10})};
    std::vector<TensorWork> recvs;
    for (size_t i = 0; i < views.size(); ++i) {
      recvs.push_back(recv_tensor(t, prev, static_cast<int>(i)));
    }
    std::vector<TensorWork> sends;
    for (size_t i = 0; i < views.size(); ++i) {
      ASSERT_FALSE(views[i].is_contiguous());
      sends.push_back(send_tensor(t, next, static_cast<int>(i), views[i]));
    }
    at::Tensor p = base(prev);
    std::vector<at::Tensor> expect = {p.t(), p.slice(1, 1, 9, 3), p.select(1, 4),
                                      p.unsqueeze(0).expand({3, 6, 10})};
    for (size_t i = 0; i < views.size(); ++i) {
      at::Tensor got = recvs[i].wait();
      EXPECT_TRUE(got.is_contiguous());
      EXPECT_TRUE(at::equal(got, expect[i])) << i;
    }
    for (auto& s : sends) EXPECT_TRUE(s.wait().is_same(views[&s - &sends[0]]));
  });
}

TEST_P(TensorTest, ManyOutstandingTensorsKeepOrderPerTag) {
  Group group = make();
  constexpr int kCount = 64;
  testing::run_ranks(group, [&](Transport& t) {
    const int next = (t.rank() + 1) % t.world_size();
    const int prev = (t.rank() + t.world_size() - 1) % t.world_size();
    std::vector<TensorWork> recvs, sends;
    for (int i = 0; i < kCount; ++i) {
      recvs.push_back(recv_tensor(t, prev, i % 2, TensorMeta{at::kFloat, {16, 64}}));
    }
    for (int i = 0; i < kCount; ++i) {
      sends.push_back(send_tensor(t, next, i % 2, at::full({16, 64}, float(i * 10 + prev + 1))));
    }
    // Sent values are i*10 + (sender rank) + 1 with the *receiver's* prev computed by the
    // sender as its own rank; fix up: the sender used its `prev`, so recompute what it sent.
    const int sender_prev = (prev + t.world_size() - 1) % t.world_size();
    for (int i = 0; i < kCount; ++i) {
      at::Tensor got = recvs[static_cast<size_t>(i)].wait();
      EXPECT_EQ(got[0][0].item<float>(), float(i * 10 + sender_prev + 1)) << i;
    }
    for (auto& s : sends) s.wait();
  });
}

void expect_mismatch(const TensorWork& work, const std::string& text) {
  try {
    work.wait();
    ADD_FAILURE() << "expected a tensor mismatch containing: " << text;
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "timeout instead of mismatch: " << e.what();
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST_P(TensorTest, MismatchesNameBothSidesAndBothRanks) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      at::Tensor x = at::ones({4, 8});
      for (int tag = 5; tag <= 8; ++tag) send_tensor(t, 1, tag, x).wait();
    } else if (t.rank() == 1) {
      // Different size: the bytes cannot even be received in place.
      expect_mismatch(recv_tensor(t, 0, 5, TensorMeta{at::kFloat, {4, 16}}),
                      "tensor mismatch on tag 5: rank 0 sent float32 [4, 8], rank 1 expected "
                      "float32 [4, 16]");
      // Same byte count, different shape.
      expect_mismatch(recv_tensor_into(t, 0, 6, at::empty({8, 4})),
                      "rank 0 sent float32 [4, 8], rank 1 expected float32 [8, 4]");
      // Same byte count, different dtype.
      expect_mismatch(recv_tensor(t, 0, 7, TensorMeta{at::kInt, {4, 8}}),
                      "rank 0 sent float32 [4, 8], rank 1 expected int32 [4, 8]");
      // Different rank count.
      expect_mismatch(recv_tensor(t, 0, 8, TensorMeta{at::kFloat, {32}}),
                      "rank 0 sent float32 [4, 8], rank 1 expected float32 [32]");
    }
  });
}

TEST(commTensorMeta, FormatsLikeTorch) {
  EXPECT_EQ((TensorMeta{at::kFloat, {4, 8}}).to_string(), "float32 [4, 8]");
  EXPECT_EQ((TensorMeta{at::kBFloat16, {}}).to_string(), "bfloat16 []");
  EXPECT_EQ(TensorMeta::of(at::zeros({2, 3}, at::kLong)).to_string(), "int64 [2, 3]");
  EXPECT_EQ((TensorMeta{at::kDouble, {2, 3}}).nbytes(), 48u);
}

INSTANTIATE_TEST_SUITE_P(
    comm, TensorTest,
    ::testing::Values(Param{TransportKind::kLocal, 2}, Param{TransportKind::kLocal, 3},
                      Param{TransportKind::kLocal, 4}, Param{TransportKind::kTcp, 2},
                      Param{TransportKind::kTcp, 3}, Param{TransportKind::kTcp, 4}),
    param_name);

}  // namespace
}  // namespace pipemat::comm
