// The tensor layer over every transport x world size: dtypes, shapes, layouts, mismatches.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <utility>

#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "test_util.h"

namespace pipemat::comm {
namespace {

// The dtype codes of the tensor wire format (Note [Wire dtype codes] in comm/src/tensor_wire.h),
// written out: a change to that table changes the bytes ranks exchange and must fail here.
const std::vector<std::pair<at::ScalarType, int32_t>>& wire_codes() {
  static const std::vector<std::pair<at::ScalarType, int32_t>> codes = {
      {at::kByte, 0},        {at::kChar, 1},         {at::kShort, 2},          {at::kInt, 3},
      {at::kLong, 4},        {at::kHalf, 5},         {at::kFloat, 6},          {at::kDouble, 7},
      {at::kComplexHalf, 8}, {at::kComplexFloat, 9}, {at::kComplexDouble, 10}, {at::kBool, 11},
      {at::kBFloat16, 15}};
  return codes;
}
int32_t wire_code(at::ScalarType dtype) {
  for (const auto& [type, code] : wire_codes()) {
    if (type == dtype) return code;
  }
  throw std::logic_error("no wire code for this dtype");
}

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

// ---- lists of tensors ----

// The list of the round-trip test: every kind of entry a stage boundary carries.
std::vector<at::Tensor> list_samples(int rank) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  at::manual_seed(4321 + rank);
  std::vector<at::Tensor> out;
  out.push_back(at::randn({3, 4}).requires_grad_());          // hidden states
  out.push_back(at::arange(5, at::kLong) * (rank + 1));       // token ids
  out.push_back(at::Tensor());                                // an absent optional input
  out.push_back(at::rand({2, 2}) > 0.5);                      // a mask
  out.push_back(at::empty({0, 7}, at::kBFloat16));            // empty
  out.push_back(at::randn({4, 6}).t());                       // non-contiguous
  out.push_back(at::scalar_tensor(2.5 + rank, at::kDouble));  // 0-dim
  return out;
}

void expect_same_list(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& sent,
                      const std::string& where) {
  ASSERT_EQ(got.size(), sent.size()) << where;
  for (size_t i = 0; i < sent.size(); ++i) {
    ASSERT_EQ(got[i].defined(), sent[i].defined()) << where << " entry " << i;
    if (!sent[i].defined()) continue;
    EXPECT_EQ(got[i].scalar_type(), sent[i].scalar_type()) << where << " entry " << i;
    EXPECT_EQ(got[i].sizes(), sent[i].sizes()) << where << " entry " << i;
    EXPECT_TRUE(at::equal(got[i], sent[i])) << where << " entry " << i;
    EXPECT_EQ(got[i].requires_grad(), sent[i].requires_grad()) << where << " entry " << i;
    EXPECT_TRUE(got[i].is_leaf()) << where << " entry " << i;
    EXPECT_TRUE(got[i].is_contiguous()) << where << " entry " << i;
    EXPECT_TRUE(got[i].device().is_cpu()) << where << " entry " << i;
  }
}

TEST_P(TensorTest, TensorListRoundTripsDtypesShapesAndGradFlags) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    const int next = (t.rank() + 1) % t.world_size();
    const int prev = (t.rank() + t.world_size() - 1) % t.world_size();
    TensorListWork recv = recv_tensors(t, prev, 3);
    const std::vector<at::Tensor> mine = list_samples(t.rank());
    TensorListWork send = send_tensors(t, next, 3, mine);
    const std::vector<at::Tensor> got = recv.wait();
    expect_same_list(got, list_samples(prev), "rank " + std::to_string(t.rank()));
    EXPECT_TRUE(got[0].requires_grad());
    EXPECT_FALSE(got[1].requires_grad());
    // No copy: the tensors wrap the transport buffer, data at 64-byte offsets (entry 0's 48
    // bytes are padded to 64, then entry 1's 64-byte header).
    for (const at::Tensor& g : got) {
      if (g.defined()) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(g.data_ptr()) % 64, 0u);
      }
    }
    EXPECT_EQ(static_cast<char*>(got[1].data_ptr()) - static_cast<char*>(got[0].data_ptr()), 128);
    // A received leaf takes part in autograd like any other.
    (got[0] * 2).sum().backward();
    ASSERT_TRUE(got[0].grad().defined());
    EXPECT_TRUE(at::equal(got[0].grad(), at::full({3, 4}, 2.0f)));
    send.wait();
  });
}

TEST_P(TensorTest, TensorListSenderWaitReturnsTheSentList) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      const std::vector<at::Tensor> mine = list_samples(0);
      TensorListWork send = send_tensors(t, 1, 4, mine);
      ASSERT_TRUE(send.valid());
      for (int k = 0; k < 2; ++k) {  // every wait returns the same list
        const std::vector<at::Tensor> sent = send.wait();
        ASSERT_EQ(sent.size(), mine.size());
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_TRUE(sent[i].is_same(mine[i])) << i;  // the caller's tensors, not copies
        }
      }
      EXPECT_TRUE(send.is_completed());
      EXPECT_EQ(send.work()->info().peer, 1);
    } else if (t.rank() == 1) {
      TensorListWork recv = recv_tensors(t, 0, 4);
      const std::vector<at::Tensor> first = recv.wait();
      const std::vector<at::Tensor> again = recv.wait();
      ASSERT_EQ(again.size(), first.size());
      for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(again[i].is_same(first[i])) << i;
    }
  });
  EXPECT_FALSE(TensorListWork().valid());
  EXPECT_THROW(TensorListWork().wait(), ConfigError);
}

TEST_P(TensorTest, TensorListEmptyList) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      EXPECT_TRUE(send_tensors(t, 1, 5, {}).wait().empty());
    } else if (t.rank() == 1) {
      EXPECT_TRUE(recv_tensors(t, 0, 5).wait().empty());
    }
  });
}

TEST_P(TensorTest, TensorListShapesChangeBetweenMessagesOnOneTag) {
  Group group = make();
  testing::run_ranks(group, [&](Transport& t) {
    const std::vector<std::vector<at::Tensor>> messages = {
        {at::full({2, 3}, 1.5f), at::arange(4, at::kLong)},
        {at::full({5, 1, 2}, -2.0f), at::Tensor(), at::scalar_tensor(7, at::kLong),
         at::ones({3}, at::kInt)},
        {at::zeros({1}, at::kShort)},
    };
    if (t.rank() == 0) {
      std::vector<TensorListWork> sends;
      for (const auto& m : messages) sends.push_back(send_tensors(t, 1, 6, m));
      for (auto& s : sends) s.wait();
    } else if (t.rank() == 1) {
      std::vector<TensorListWork> recvs;
      for (size_t k = 0; k < messages.size(); ++k) recvs.push_back(recv_tensors(t, 0, 6));
      for (size_t k = 0; k < messages.size(); ++k) {
        expect_same_list(recvs[k].wait(), messages[k], "message " + std::to_string(k));
      }
    }
  });
}

TEST_P(TensorTest, TensorListSendRejectsWhatItCannotCarry) {
  Group group = make();
  Transport& t = *group[0];
  const std::vector<at::Tensor> too_many(kMaxListTensors + 1, at::zeros({1}));
  try {
    send_tensors(t, 1, 8, too_many);
    ADD_FAILURE() << "a list of " << too_many.size() << " tensors was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("4097 tensors exceed the limit of 4096"),
              std::string::npos)
        << e.what();
  }
  const at::Tensor quantized = at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8);
  try {
    send_tensors(t, 1, 8, {at::ones({1}), quantized});
    ADD_FAILURE() << "a quantized tensor was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "entry 1 has dtype QInt8; tensor messages carry uint8, int8, int16, int32, "
                  "int64, float16, float32, float64, complex32, complex64, complex128, bool, "
                  "bfloat16 (a quantized tensor: send int_repr() and the scale instead)"),
              std::string::npos)
        << e.what();
  }
}

// Builds tensor-list messages byte by byte, following the wire format in tensor.h, so that the
// receive side can be fed anything a broken or hostile peer might send.
class RawList {
 public:
  explicit RawList(int sender) : sender_(sender) {}

  // One entry; `data_bytes` bytes of data follow (default: nbytes), then padding to 64.
  RawList& add(int32_t dtype, const std::vector<int64_t>& shape, uint64_t nbytes,
               uint64_t flags = 0, int64_t data_bytes = -1) {
    const size_t start = entries_.size();
    put(entries_, uint32_t{0x504d5431});
    put(entries_, dtype);
    put(entries_, static_cast<int32_t>(shape.size()));
    put(entries_, static_cast<int32_t>(sender_));
    put(entries_, nbytes);
    put(entries_, flags);
    for (int64_t d : shape) put(entries_, d);
    pad(entries_, start);
    const size_t data_start = entries_.size();
    entries_.resize(entries_.size() + static_cast<size_t>(data_bytes < 0 ? nbytes : data_bytes),
                    0x5a);
    pad(entries_, data_start);
    ++count_;
    return *this;
  }
  RawList& add(const at::Tensor& tensor) {
    const size_t nbytes = tensor.numel() * tensor.element_size();
    add(wire_code(tensor.scalar_type()), tensor.sizes().vec(), nbytes,
        tensor.requires_grad() ? 1 : 0);
    // The data block is the last nbytes before the padding.
    std::memcpy(entries_.data() + entries_.size() - padded(nbytes), tensor.contiguous().data_ptr(),
                nbytes);
    return *this;
  }
  RawList& add_undefined() {
    return add(255, {}, 0, 2);  // the undefined entry's code (Note [Wire dtype codes])
  }

  // The message; count and total size as the entries say unless overridden.
  std::vector<uint8_t> bytes(int64_t count = -1, int64_t total = -1, int sender = -1) const {
    std::vector<uint8_t> out;
    put(out, uint32_t{0x504d4c31});
    put(out, static_cast<int32_t>(sender < 0 ? sender_ : sender));
    put(out, static_cast<uint32_t>(count < 0 ? count_ : count));
    put(out, uint32_t{0});
    put(out, static_cast<uint64_t>(total < 0 ? 64 + entries_.size() : total));
    pad(out, 0);
    out.insert(out.end(), entries_.begin(), entries_.end());
    return out;
  }

 private:
  template <typename T>
  static void put(std::vector<uint8_t>& out, T value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    out.insert(out.end(), p, p + sizeof(value));
  }
  static size_t padded(size_t n) { return (n + 63) / 64 * 64; }
  static void pad(std::vector<uint8_t>& out, size_t start) {
    out.resize(start + padded(out.size() - start), 0);
  }

  int sender_;
  std::vector<uint8_t> entries_;
  uint32_t count_ = 0;
};

void expect_comm_error(const TensorListWork& work, const std::string& text,
                       const std::string& where) {
  for (int k = 0; k < 2; ++k) {  // the second wait rethrows the same error
    try {
      work.wait();
      ADD_FAILURE() << where << ": expected a CommError containing: " << text;
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << where << ": timeout instead of the error: " << e.what();
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << where << ": " << e.what();
    }
  }
}

TEST_P(TensorTest, TensorListHostileBytesAreCommErrorsNamingBothRanks) {
  Group group = make();
  constexpr int kTag = 7;
  const int64_t big = int64_t{1} << 40;
  const int32_t kFloat = 6;  // float32's wire code (Note [Wire dtype codes])
  const int32_t kLong = static_cast<int32_t>(at::kLong);
  // (message, phrase of the receiver's error); rank 0 sends them all on one tag, raw.
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> cases = {
      {{0x31, 0x4c, 0x4d, 0x50, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
       "rank 0 sent a corrupt tensor list on tag 7: the message has 20 bytes, less than the "
       "64-byte list header (received by rank 1"},
      {std::vector<uint8_t>(128, 0x42),
       "rank 0 sent a message with tag 7 to rank 1 that is not a pipemat tensor list (128 bytes, "
       "no list header)"},
      {{'h', 'i'}, "that is not a pipemat tensor list (2 bytes, no list header)"},
      {{}, "that is not a pipemat tensor list (0 bytes, no list header)"},
      {RawList(0).bytes(4097), "the header says 4097 tensors, more than the limit of 4096"},
      {RawList(0).bytes(0xffffffff), "the header says 4294967295 tensors, more than the limit"},
      {RawList(0)
           .add(at::zeros({2}))
           .add(at::Tensor(at::ones({1}, at::kLong)))
           .add(99, {2}, 8)
           .bytes(),
       "rank 0 sent a corrupt tensor list on tag 7: entry 2 has dtype code 99, which is not a "
       "dtype tensor messages carry (received by rank 1"},
      {RawList(0).add(-1, {2}, 8).bytes(),
       "entry 0 has dtype code -1, which is not a dtype tensor messages carry"},
      {RawList(0).add(256 + kFloat, {2}, 8).bytes(),
       "entry 0 has dtype code 262, which is not a dtype tensor messages carry"},
      {RawList(0).add(255, {2}, 8).bytes(),
       "entry 0 has dtype code 255 (undefined) but is not marked as an undefined entry"},
      // LibTorch's ScalarType values of QInt8 and Undefined (in some release) are not wire codes.
      {RawList(0).add(12, {2}, 2).bytes(),
       "entry 0 has dtype code 12, which is not a dtype tensor messages carry"},
      {RawList(0).add(18, {2}, 8).bytes(),
       "entry 0 has dtype code 18, which is not a dtype tensor messages carry"},
      {RawList(0).add(kFloat, std::vector<int64_t>(65, 1), 4).bytes(),
       "entry 0 has 65 dimensions; expected 0 to 64"},
      {RawList(0).add(kFloat, {4, -3}, 0).bytes(),
       "entry 0 has size -3 in dimension 1 (shape float32 [4, -3]); sizes cannot be negative"},
      // 64 list header + 64 entry header + 48 data padded to 64 = 192 bytes, 64 extra.
      {[] {
         auto b = RawList(0).add(at::ones({3, 4})).bytes();
         b.resize(b.size() + 64, 0);
         return b;
       }(),
       "the header says the message has 192 bytes, but 256 bytes arrived"},
      {RawList(0).add(at::ones({3, 4})).bytes(-1, 256),
       "the header says the message has 256 bytes, but 192 bytes arrived"},
      {[] {
         auto b = RawList(0).add(at::ones({3, 4})).bytes(-1, 256);
         b.resize(256, 0);
         return b;
       }(),
       "its 1 entries end at byte 192 but the message has 256 bytes"},
      {RawList(0).add(kFloat, {big, big}, 0).bytes(),
       "entry 0 has shape float32 [1099511627776, 1099511627776], whose number of elements "
       "overflows int64"},
      {RawList(0).add(kFloat, {0, big, big}, 0).bytes(), "whose number of elements overflows"},
      {RawList(0).add(kFloat, {int64_t{1} << 62}, 0).bytes(),
       "entry 0 is float32 [4611686018427387904], whose size in bytes overflows"},
      {RawList(0).add(kFloat, {3, 4}, 10).bytes(),
       "entry 0 is float32 [3, 4] (48 bytes) but its header says 10 bytes"},
      {RawList(0).add(kFloat, {1000}, 4000, 0, 64).bytes(),
       "entry 0 (float32 [1000], 4000 bytes and padding) is cut off: only 64 bytes are left"},
      {RawList(0).add(kLong, {2}, 16, 1).bytes(),
       "entry 0 is int64 [2] and marked requires_grad, which only floating point and complex "
       "tensors can be"},
      {RawList(0).add(kFloat, {2}, 8, 4).bytes(), "entry 0 has unknown flags 0x4"},
      {RawList(0).add(kFloat, {2}, 8, 2).bytes(), "entry 0 is marked undefined but has"},
      {RawList(0).add(at::ones({2})).bytes(3), "entry 1 is cut off"},
      {RawList(0).add(at::ones({2})).bytes(-1, -1, 5), "the header says it was sent by rank 5"},
      {[] {
         auto b = RawList(0).add(at::ones({2})).add(at::ones({2})).bytes();
         b[64 + 128] ^= 0xff;  // the magic of entry 1
         return b;
       }(),
       "entry 1 at byte 192 has no tensor header (magic 0x504d54ce)"},
  };
  testing::run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      std::vector<WorkPtr> sends;
      for (const auto& c : cases) sends.push_back(t.send(1, kTag, c.first.data(), c.first.size()));
      // A single tensor where a list is expected, then a good list: the tag is still usable.
      TensorWork single = send_tensor(t, 1, kTag, at::ones({2}));
      TensorListWork good = send_tensors(t, 1, kTag, {at::ones({2}), at::Tensor()});
      // And the other way round: a list where a single tensor is expected.
      TensorListWork list = send_tensors(t, 1, kTag + 1, {at::ones({2})});
      for (auto& s : sends) s->wait();
      single.wait();
      good.wait();
      list.wait();
    } else if (t.rank() == 1) {
      std::vector<TensorListWork> recvs;
      for (size_t k = 0; k < cases.size(); ++k) recvs.push_back(recv_tensors(t, 0, kTag));
      for (size_t k = 0; k < cases.size(); ++k) {
        expect_comm_error(recvs[k], cases[k].second, "case " + std::to_string(k));
      }
      expect_comm_error(recv_tensors(t, 0, kTag),
                        "rank 0 sent a single tensor (send_tensor) with tag 7 to rank 1, which "
                        "posted a tensor-list receive",
                        "single tensor");
      const std::vector<at::Tensor> good = recv_tensors(t, 0, kTag).wait();
      ASSERT_EQ(good.size(), 2u);
      EXPECT_TRUE(at::equal(good[0], at::ones({2})));
      EXPECT_FALSE(good[1].defined());
      try {
        recv_tensor(t, 0, kTag + 1).wait();
        ADD_FAILURE() << "a list was received as a single tensor";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 0 sent a tensor list (send_tensors) with tag "
                                             "8 to rank 1, which posted a single-tensor receive"),
                  std::string::npos)
            << e.what();
      }
    }
  });
}

// Random damage to a valid message: always a list or a CommError, never a crash or another
// exception (run under ASan/UBSan this also checks the bounds).
TEST_P(TensorTest, TensorListRandomDamageIsACommErrorNeverACrash) {
  Group group = make();
  std::vector<at::Tensor> list = {at::ones({3, 4}).requires_grad_(), at::Tensor(),
                                  at::arange(6, at::kLong).reshape({2, 1, 3}),
                                  at::scalar_tensor(1.0, at::kDouble)};
  RawList raw(0);
  raw.add(list[0]).add_undefined().add(list[2]).add(list[3]);
  const std::vector<uint8_t> valid = raw.bytes();
  std::mt19937 rng(99);
  std::vector<std::vector<uint8_t>> messages;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<uint8_t> m = valid;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) m[rng() % m.size()] = static_cast<uint8_t>(rng());
    if (rng() % 4 == 0) m.resize(rng() % m.size());
    messages.push_back(std::move(m));
  }
  messages.push_back(valid);
  testing::run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      std::vector<WorkPtr> sends;
      for (const auto& m : messages) sends.push_back(t.send(1, 9, m.data(), m.size()));
      for (auto& s : sends) s->wait();
    } else if (t.rank() == 1) {
      int errors = 0;
      for (size_t k = 0; k < messages.size(); ++k) {
        try {
          const std::vector<at::Tensor> got = recv_tensors(t, 0, 9).wait();
          for (const at::Tensor& g : got) {
            if (g.defined()) {
              EXPECT_LE(g.nbytes(), messages[k].size()) << k;
            }
          }
          if (k + 1 == messages.size()) expect_same_list(got, list, "the undamaged message");
        } catch (const CommError& e) {
          ++errors;
          EXPECT_NE(std::string(e.what()).find("rank 0 sent"), std::string::npos) << e.what();
        }
      }
      // The damage is seeded: 207 of the 300 damaged messages fail, on every transport alike;
      // the rest still decode as a list.
      EXPECT_EQ(errors, 207);
    }
  });
}

// A single-tensor message (send_tensor's wire format, tensor.h) with any header fields: the
// 32-byte header and `shape`, zero padded to 64 bytes, then `data_bytes` bytes (default: nbytes).
// The ndim field is shape.size() unless `ndim` is given.
constexpr int32_t kNdimOfShape = std::numeric_limits<int32_t>::min();
std::vector<uint8_t> raw_tensor(int32_t dtype, const std::vector<int64_t>& shape, uint64_t nbytes,
                                int32_t sender = 0, int64_t data_bytes = -1,
                                int32_t ndim = kNdimOfShape) {
  std::vector<uint8_t> out;
  auto put = [&](auto value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    out.insert(out.end(), p, p + sizeof(value));
  };
  put(uint32_t{0x504d5431});
  put(dtype);
  put(ndim == kNdimOfShape ? static_cast<int32_t>(shape.size()) : ndim);
  put(sender);
  put(nbytes);
  put(uint64_t{0});
  for (int64_t d : shape) put(d);
  out.resize((out.size() + 63) / 64 * 64, 0);
  out.resize(out.size() + static_cast<size_t>(data_bytes < 0 ? nbytes : data_bytes), 0x5a);
  return out;
}

void expect_comm_error(const TensorWork& work, const std::string& text, const std::string& where) {
  for (int k = 0; k < 2; ++k) {  // the second wait rethrows the same error
    try {
      work.wait();
      ADD_FAILURE() << where << ": expected a CommError containing: " << text;
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << where << ": timeout instead of the error: " << e.what();
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << where << ": " << e.what();
    }
  }
}

// The single-tensor receives check the header like the list receives do (Note [Tensor header
// checks]): unknown dtype codes (also those that wrap around to a valid 8-bit ScalarType),
// negative or overflowing dims and inconsistent sizes are CommErrors naming both ranks and the
// tag, on the any-shape path and on the expected-shape path, which hands out nothing.
TEST_P(TensorTest, SingleTensorHostileHeadersAreCommErrorsNamingBothRanks) {
  Group group = make();
  constexpr int kAnyTag = 11;
  constexpr int kExpectedTag = 12;
  constexpr int kIntoTag = 13;
  const int64_t big = int64_t{1} << 40;
  const int32_t kFloat = 6;  // float32's wire code (Note [Wire dtype codes])
  const std::string corrupt_any = "rank 0 sent a corrupt tensor message on tag 11: ";
  const std::string corrupt_expected = "rank 0 sent a corrupt tensor message on tag 12: ";
  // (message, phrase of the error of recv_tensor(t, 0, kAnyTag)).
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> any_cases = {
      {raw_tensor(99, {2}, 8),
       corrupt_any +
           "the tensor has dtype code 99, which is not a dtype tensor messages carry (received "
           "by rank 1"},
      {raw_tensor(256 + kFloat, {2}, 8),
       "the tensor has dtype code 262, which is not a dtype tensor messages carry"},
      {raw_tensor(-1, {2}, 8),
       "the tensor has dtype code -1, which is not a dtype tensor messages carry"},
      {raw_tensor(12, {2}, 2),
       "the tensor has dtype code 12, which is not a dtype tensor messages carry"},
      {raw_tensor(47, {2}, 2),
       "the tensor has dtype code 47, which is not a dtype tensor messages carry"},
      {raw_tensor(kFloat, std::vector<int64_t>(65, 1), 4),
       corrupt_any + "the tensor has 65 dimensions; expected 0 to 64"},
      {raw_tensor(kFloat, {}, 4, 0, -1, -7), "the tensor has -7 dimensions; expected 0 to 64"},
      {raw_tensor(kFloat, {4, -3}, 0),
       corrupt_any +
           "the tensor has size -3 in dimension 1 (shape float32 [4, -3]); sizes cannot be "
           "negative (received by rank 1"},
      {raw_tensor(kFloat, {big, big}, 0),
       "the tensor has shape float32 [1099511627776, 1099511627776], whose number of elements "
       "overflows int64"},
      {raw_tensor(kFloat, {0, big, big}, 0), "whose number of elements overflows int64"},
      {raw_tensor(kFloat, {int64_t{1} << 62}, 0),
       "the tensor is float32 [4611686018427387904], whose size in bytes overflows"},
      {raw_tensor(kFloat, {3, 4}, 10, 0, 48),
       "the tensor is float32 [3, 4] (48 bytes) but its header says 10 bytes"},
      {raw_tensor(kFloat, {3, 4}, 48, 0, 16),
       corrupt_any + "header says float32 [3, 4] (48 bytes) but 16 bytes followed"},
      {raw_tensor(kFloat, {2}, 8, 5), "the header says it was sent by rank 5"},
      {[] {
         auto b = raw_tensor(kFloat, std::vector<int64_t>(20, 1), 4);
         b.resize(100);
         return b;
       }(),
       "its header with 20 dimensions needs 192 bytes but the message has only 100"},
  };
  // (message, phrase of the error of recv_tensor(t, 0, kExpectedTag, float32 [2])): exact-size
  // messages (64 + 8 bytes, received in place) and others.
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> expected_cases = {
      {raw_tensor(256 + kFloat, {2}, 8),
       corrupt_expected +
           "the tensor has dtype code 262, which is not a dtype tensor messages carry (received "
           "by rank 1"},
      {raw_tensor(99, {2}, 8),
       "the tensor has dtype code 99, which is not a dtype tensor messages carry"},
      {raw_tensor(kFloat, {-2}, 8, 0, 8),
       corrupt_expected + "the tensor has size -2 in dimension 0 (shape float32 [-2])"},
      {raw_tensor(kFloat, {big, big}, 0), "whose number of elements overflows int64"},
      {raw_tensor(kFloat, {2}, 8, 5), "the header says it was sent by rank 5"},
  };
  testing::run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) {
      std::vector<WorkPtr> sends;
      for (const auto& c : any_cases)
        sends.push_back(t.send(1, kAnyTag, c.first.data(), c.first.size()));
      for (const auto& c : expected_cases) {
        sends.push_back(t.send(1, kExpectedTag, c.first.data(), c.first.size()));
      }
      // A header longer than the receiver's (5 dims vs 1) and the same total size (128 bytes):
      // a legitimate sender, told apart from a corrupt one although it arrives in place.
      TensorWork longer = send_tensor(t, 1, kExpectedTag, at::zeros({1, 1, 1, 1, 0}));
      const std::vector<uint8_t> hostile_into = raw_tensor(256 + kFloat, {2, 2}, 16);
      sends.push_back(t.send(1, kIntoTag, hostile_into.data(), hostile_into.size()));
      // The tags are still usable.
      TensorWork good_any = send_tensor(t, 1, kAnyTag, at::ones({2}));
      TensorWork good_expected = send_tensor(t, 1, kExpectedTag, at::ones({2}));
      for (auto& s : sends) s->wait();
      longer.wait();
      good_any.wait();
      good_expected.wait();
    } else if (t.rank() == 1) {
      std::vector<TensorWork> recvs;
      for (size_t k = 0; k < any_cases.size(); ++k) recvs.push_back(recv_tensor(t, 0, kAnyTag));
      for (size_t k = 0; k < any_cases.size(); ++k) {
        expect_comm_error(recvs[k], any_cases[k].second, "any-shape case " + std::to_string(k));
      }
      for (size_t k = 0; k < expected_cases.size(); ++k) {
        expect_comm_error(recv_tensor(t, 0, kExpectedTag, TensorMeta{at::kFloat, {2}}),
                          expected_cases[k].second, "expected-shape case " + std::to_string(k));
      }
      expect_mismatch(recv_tensor(t, 0, kExpectedTag, TensorMeta{at::kFloat, {16}}),
                      "tensor mismatch on tag 12: rank 0 sent float32 [1, 1, 1, 1, 0], rank 1 "
                      "expected float32 [16]");
      // Non-contiguous `out`: nothing is copied into it before the header passed the checks.
      at::Tensor out = at::zeros({2, 2}).t();
      expect_comm_error(recv_tensor_into(t, 0, kIntoTag, out),
                        "rank 0 sent a corrupt tensor message on tag 13: the tensor has dtype "
                        "code 262, which is not a dtype",
                        "recv_tensor_into");
      EXPECT_TRUE(at::equal(out, at::zeros({2, 2})));
      EXPECT_TRUE(at::equal(recv_tensor(t, 0, kAnyTag).wait(), at::ones({2})));
      EXPECT_TRUE(at::equal(recv_tensor(t, 0, kExpectedTag, TensorMeta{at::kFloat, {2}}).wait(),
                            at::ones({2})));
    }
  });
}

// Every dtype tensor messages carry goes out with its fixed wire code and comes back as itself
// from a header that names it by that code.
TEST(commTensorWire, DtypeCodesAreFixed) {
  Group group = testing::make_group(TransportKind::kLocal, 2);
  testing::run_ranks(group, [&](Transport& t) {
    int tag = 40;
    for (const auto& [dtype, code] : wire_codes()) {
      const at::Tensor sent = at::ones({3}, at::TensorOptions().dtype(dtype));
      const size_t data_bytes = 3 * sent.element_size();
      if (t.rank() == 0) {
        send_tensor(t, 1, tag, sent).wait();
        const std::vector<uint8_t> raw = raw_tensor(code, {3}, data_bytes);
        t.send(1, tag + 1, raw.data(), raw.size())->wait();
      } else {
        std::vector<uint8_t> bytes(64 + data_bytes);
        t.recv(0, tag, bytes.data(), bytes.size())->wait();
        int32_t field = -1;
        std::memcpy(&field, bytes.data() + 4, sizeof(field));
        EXPECT_EQ(field, code) << dtype_name(dtype);
        TensorWork received = recv_tensor(t, 0, tag + 1);
        EXPECT_EQ(received.wait().scalar_type(), dtype) << "wire code " << code;
      }
      tag += 2;
    }
  });
}

TEST(commTensorSend, RejectsQuantizedTensors) {
  Group group = testing::make_group(TransportKind::kLocal, 2);
  const at::Tensor quantized = at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8);
  try {
    send_tensor(*group[0], 1, 3, quantized);
    FAIL() << "a quantized tensor was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("send_tensor to rank 1 with tag 3: the tensor has dtype "
                                         "QInt8; tensor messages carry uint8, int8"),
              std::string::npos)
        << e.what();
  }
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
