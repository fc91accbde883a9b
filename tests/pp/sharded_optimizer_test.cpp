// Note [Sharded optimizer]: D replicas of a P-rank pipeline (D x P ranks as threads) with
// PipelineOptions::shard_optimizer equal the same replicas unsharded bitwise on every rank of
// every replica: losses, gradient norms (clipping active) and every parameter after every step;
// and each rank's optimizer state is exactly that of the elements it owns.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "pipemat/comm/rank_threads.h"
#include "pipemat/comm/transport.h"
#include "pipemat/pp/pipeline.h"
#include "user_pipeline.h"

namespace pipemat::pp {
namespace {

using schedule::ScheduleKind;

// What job rank w saw: per step the loss, norm, its parameters and its optimizer state's bytes.
struct ShardRun {
  std::vector<double> losses, norms;
  std::vector<std::vector<at::Tensor>> params;     // per step, in stage then parameter order
  std::vector<std::vector<int64_t>> stage_numels;  // per stage of the rank, its parameters'
  std::vector<int64_t> state_bytes;                // per step: StepMetrics::optimizer_state_bytes
  std::vector<int64_t> param_bytes, grad_bytes;    // ... parameter_bytes, gradient_bytes
  std::vector<int64_t> owned_by_optimizer;         // elements the optimizer got
};

enum class Opt { kAdamW, kSgd };

constexpr double kGridClip = 0.2;  // below every step's norm at D = 2 and 3: clipping is active

std::unique_ptr<torch::optim::Optimizer> make(Opt opt, const std::vector<at::Tensor>& p) {
  if (opt == Opt::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
  }
  return user_model::make_adamw(p);
}

// The options of the small cases: a one-rank pipeline replicated over `data`, AdamW, the mean
// square of the output as the loss.
PipelineOptions replica_options(comm::Transport& data, bool shard) {
  PipelineOptions o;
  o.schedule.ranks = 1;
  o.schedule.micro_batches = 2;
  o.loss = [](const Tensors& out, const Tensors&) { return out.at(0).pow(2).mean(); };
  o.optimizer = [](const std::vector<at::Tensor>& p) { return make(Opt::kAdamW, p); };
  o.data_group = &data;
  o.shard_optimizer = shard;
  return o;
}

// Rank w of the job is pipeline rank w / D of replica w % D (Note [Data x pipeline]).
std::vector<ShardRun> run_grid(ScheduleKind kind, int replicas, int ranks, bool shard, Opt opt,
                               int64_t bucket_bytes = int64_t{25} << 20) {
  const int world = replicas * ranks;
  std::vector<ShardRun> runs(static_cast<size_t>(world));
  const auto errors = user_model::run_ranks(world, [&](comm::Transport& job) {
    const int w = job.rank(), replica = w % replicas, prank = w / replicas;
    std::vector<int> data_ranks, pipe_ranks;
    for (int d = 0; d < replicas; ++d) data_ranks.push_back(prank * replicas + d);
    for (int r = 0; r < ranks; ++r) pipe_ranks.push_back(r * replicas + replica);
    auto data = comm::make_group(job, data_ranks);
    auto pipeline = comm::make_group(job, pipe_ranks);
    user_model::PipelineCase c;
    c.kind = kind;
    c.ranks = ranks;
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    PipelineOptions o = user_model::pipeline_options(c);
    o.data_group = data.get();
    o.shard_optimizer = shard;
    o.gradient_bucket_bytes = bucket_bytes;
    o.clip_grad_norm = kGridClip;
    ShardRun& run = runs[static_cast<size_t>(w)];
    o.optimizer = [opt, &run](const std::vector<at::Tensor>& p) {
      for (const auto& t : p) run.owned_by_optimizer.push_back(t.numel());
      return make(opt, p);
    };
    if (opt == Opt::kSgd) o.lr_schedule = nullptr;
    const auto bounds = balance_by_parameters(model, stage_count(o));
    Pipeline pipe(*pipeline, o, split_sequential(model, bounds));
    for (int s : pipe.stages()) {
      std::vector<int64_t>& n = run.stage_numels.emplace_back();
      for (const auto& p : pipe.stage(s).module->parameters()) n.push_back(p.numel());
    }
    for (int64_t step = 0; step < c.steps; ++step) {
      const StepMetrics m = pipe.train_step([](int64_t s, int64_t i) {
        auto [ids, targets] = user_model::data(s, i);
        return MicroBatch{{ids}, {targets}};
      });
      run.losses.push_back(m.loss);
      run.norms.push_back(m.grad_norm);
      run.state_bytes.push_back(m.optimizer_state_bytes);
      run.param_bytes.push_back(m.parameter_bytes);
      run.grad_bytes.push_back(m.gradient_bytes);
      std::vector<at::Tensor> ps;
      for (const auto& p : pipe.parameters()) ps.push_back(p.detach().clone());
      run.params.push_back(std::move(ps));
    }
  });
  for (int w = 0; w < world; ++w) EXPECT_EQ(errors[static_cast<size_t>(w)], "") << "rank " << w;
  return runs;
}

// Bytes of state per element: AdamW's two moments, SGD's momentum buffer (float32).
int64_t state_bytes_per_element(Opt opt) { return opt == Opt::kAdamW ? 8 : 4; }

void expect_sharded_equals_unsharded(ScheduleKind kind, int replicas, int ranks, Opt opt,
                                     int64_t bucket_bytes = int64_t{25} << 20) {
  const auto plain = run_grid(kind, replicas, ranks, false, opt, bucket_bytes);
  const auto sharded = run_grid(kind, replicas, ranks, true, opt, bucket_bytes);
  ASSERT_EQ(plain.size(), sharded.size());
  for (size_t w = 0; w < plain.size(); ++w) {
    const ShardRun &a = plain[w], &b = sharded[w];
    ASSERT_EQ(a.params.size(), b.params.size()) << "rank " << w;
    for (size_t s = 0; s < a.params.size(); ++s) {
      EXPECT_EQ(a.losses[s], b.losses[s]) << "rank " << w << " step " << s;
      EXPECT_EQ(a.norms[s], b.norms[s]) << "rank " << w << " step " << s;
      EXPECT_GT(b.norms[s], kGridClip) << "clipping is active";
      ASSERT_EQ(a.params[s].size(), b.params[s].size());
      for (size_t i = 0; i < a.params[s].size(); ++i) {
        EXPECT_TRUE(at::equal(a.params[s][i], b.params[s][i]))
            << "rank " << w << " step " << s << " parameter " << i;
      }
    }
    // Unsharded: the state of every element; sharded: of the owned ones, exactly. With one
    // bucket per stage (the default bucket size) the owned ones are shard_slices' of each stage.
    int64_t all = 0, owned = 0;
    for (const std::vector<int64_t>& n : b.stage_numels) {
      for (int64_t k : n) all += k;
      const ShardSlice slice = shard_slices(n, replicas)[w % static_cast<size_t>(replicas)];
      owned += slice.end - slice.begin;
    }
    const int64_t per = state_bytes_per_element(opt);
    EXPECT_EQ(a.state_bytes.back(), per * all) << "rank " << w;
    int64_t got = 0;
    for (int64_t n : b.owned_by_optimizer) got += n;
    EXPECT_EQ(b.state_bytes.back(), per * got) << "rank " << w;
    // float32 parameters, whole on every replica; gradients whole unsharded, sliced sharded.
    EXPECT_EQ(a.param_bytes.back(), 4 * all) << "rank " << w;
    EXPECT_EQ(b.param_bytes.back(), 4 * all) << "rank " << w;
    EXPECT_EQ(a.grad_bytes.back(), 4 * all) << "rank " << w;
    EXPECT_EQ(b.grad_bytes.back(), 4 * got) << "rank " << w;
    if (bucket_bytes >= (int64_t{1} << 20)) {
      EXPECT_EQ(got, owned) << "the factory gets the owned elements of rank " << w;
    }
  }
  // The replicas of one pipeline rank hold its whole state between them, each about 1/D.
  for (int r = 0; r < ranks; ++r) {
    int64_t sum = 0;
    for (int d = 0; d < replicas; ++d)
      sum += sharded[static_cast<size_t>(r * replicas + d)].state_bytes.back();
    EXPECT_EQ(sum, plain[static_cast<size_t>(r * replicas)].state_bytes.back())
        << "pipeline rank " << r;
  }
}

TEST(ShardedOptimizer, SlicesAreTheDthOfTheBucketsElementsInPieces) {
  using S = std::vector<ShardSlice>;
  // Two parameters each side of the middle.
  EXPECT_EQ(shard_slices({10, 10, 10, 10}, 2),
            (S{{0, 20, {{0, 0, 10}, {1, 0, 10}}}, {20, 40, {{2, 0, 10}, {3, 0, 10}}}}));
  // The middle parameter cut at element 5.
  EXPECT_EQ(shard_slices({10, 10, 10}, 2),
            (S{{0, 15, {{0, 0, 10}, {1, 0, 5}}}, {15, 30, {{1, 5, 10}, {2, 0, 10}}}}));
  // Uneven: 31 elements over 3 replicas are 10, 10 and 11.
  EXPECT_EQ(shard_slices({31}, 3),
            (S{{0, 10, {{0, 0, 10}}}, {10, 20, {{0, 10, 20}}}, {20, 31, {{0, 20, 31}}}}));
  // A bucket smaller than the replicas: replica 0 owns nothing.
  EXPECT_EQ(shard_slices({2}, 3), (S{{0, 0, {}}, {0, 1, {{0, 0, 1}}}, {1, 2, {{0, 1, 2}}}}));
  // Parameters without elements go with the slice their position is in.
  EXPECT_EQ(shard_slices({0, 4, 0}, 2),
            (S{{0, 2, {{0, 0, 0}, {1, 0, 2}}}, {2, 4, {{1, 2, 4}, {2, 0, 0}}}}));
  EXPECT_EQ(shard_slices({}, 2), (S{{0, 0, {}}, {0, 0, {}}}));
  EXPECT_EQ(shard_slices({5, 5}, 1), (S{{0, 10, {{0, 0, 5}, {1, 0, 5}}}}));
  EXPECT_THROW(shard_slices({5}, 0), ConfigError);
}

TEST(ShardedOptimizer, TwoByTwoEqualsUnshardedBitwiseUnderEveryScheduleKind) {
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
        ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
    SCOPED_TRACE(schedule::to_string(kind));
    expect_sharded_equals_unsharded(kind, 2, 2, Opt::kAdamW);
  }
}

TEST(ShardedOptimizer, ThreeByTwoEqualsUnshardedBitwiseUnderEveryScheduleKind) {
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
        ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleH2, ScheduleKind::kZeroBubbleV}) {
    SCOPED_TRACE(schedule::to_string(kind));
    expect_sharded_equals_unsharded(kind, 3, 2, Opt::kAdamW);
  }
}

TEST(ShardedOptimizer, ThreeByTwoWithSgdAndOneParameterBucketsEqualsUnshardedBitwise) {
  expect_sharded_equals_unsharded(ScheduleKind::kOneFOneB, 3, 2, Opt::kSgd);
  // 64-byte buckets: one message per parameter, most buckets owned by one replica only; under
  // ZB-H1 the weight tail posts them one by one.
  expect_sharded_equals_unsharded(ScheduleKind::kZeroBubbleH1, 3, 2, Opt::kAdamW, 64);
}

// A bucket of 2 elements over 3 replicas: replica 0 owns none and gets an optimizer over an
// empty list, replicas 1 and 2 one element each of the one weight, whose gradient norm replica
// 1 takes from both pieces (clipping is active); every replica leaves every step with the
// unsharded weight.
TEST(ShardedOptimizer, ABucketSmallerThanTheReplicasLeavesOneOwningNothing) {
  auto run = [](bool shard) {
    std::vector<std::vector<at::Tensor>> params(3);
    std::vector<int64_t> bytes(3);
    std::vector<double> norms(3);
    const auto errors = user_model::run_ranks(3, [&](comm::Transport& job) {
      const int r = job.rank();
      auto data = comm::make_group(job, {0, 1, 2});
      auto pipeline = comm::make_group(job, {r});
      PipelineOptions o = replica_options(*data, shard);
      o.clip_grad_norm = 0.01;
      // The same weights on every replica thread and in both runs: the seed and the draws of
      // one thread at a time (the default generator is the process's).
      auto linear = [] {
        static std::mutex init;
        std::lock_guard<std::mutex> lock(init);
        at::manual_seed(3);
        return torch::nn::Linear(torch::nn::LinearOptions(2, 1).bias(false));
      }();
      Pipeline p(*pipeline, o, [&](int s) {
        return make_stage(s, linear.ptr(), [linear](const Tensors& in) mutable {
          return Tensors{linear->forward(in[0])};
        });
      });
      for (int64_t step = 0; step < 3; ++step) {
        const StepMetrics m = p.train_step([r](int64_t s, int64_t i) {
          return MicroBatch{{at::full({2, 2}, static_cast<double>(1 + s + i + r))}, {}};
        });
        bytes[static_cast<size_t>(r)] = m.optimizer_state_bytes;
        norms[static_cast<size_t>(r)] = m.grad_norm;
      }
      params[static_cast<size_t>(r)] = {linear->weight.detach().clone()};
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
    return std::make_tuple(params, bytes, norms);
  };
  const auto [plain, plain_bytes, plain_norms] = run(false);
  const auto [sharded, sharded_bytes, sharded_norms] = run(true);
  EXPECT_EQ(sharded_bytes, (std::vector<int64_t>{0, 8, 8}));  // 1 element x 2 moments x 4
  EXPECT_EQ(plain_bytes, (std::vector<int64_t>{16, 16, 16}));
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(at::equal(sharded[r][0], plain[r][0])) << "replica " << r;
    EXPECT_EQ(sharded_norms[r], plain_norms[r]) << "replica " << r;
    EXPECT_GT(plain_norms[r], 0.01) << "clipping is active";
  }
}

// A job transport that, once armed, stops its rank at its first send with `tag`: throwing (the
// rank dies: its thread ends and its transport closes) or sleeping past the peers' timeout (the
// rank stalls), then throwing.
class Tripwire final : public comm::Transport {
 public:
  Tripwire(comm::Transport& inner, int tag, bool stall)
      : Transport(inner.kind(), inner.rank(), inner.world_size(), inner.timeout(),
                  inner.job_rank()),
        inner_(inner),
        tag_(tag),
        stall_(stall) {}
  int job_rank_of(int peer) const override { return inner_.job_rank_of(peer); }
  std::atomic<bool> armed{false}, fired{false};

 private:
  comm::WorkPtr post_send(Request request) override {
    if (armed && request.info.tag == tag_) {
      fired = true;
      if (stall_) std::this_thread::sleep_for(3 * timeout());
      throw std::runtime_error("tripwire: this rank stops here");
    }
    return post_send_on(inner_, std::move(request));
  }
  comm::WorkPtr post_recv(Request request) override {
    return post_recv_on(inner_, std::move(request));
  }
  comm::Transport& inner_;
  const int tag_;
  const bool stall_;
};

// Replica 1 of 2 dies or stalls exactly where it sends its slice of the gradients (the
// reduce-scatter) or its updated slice (the gather) in step 1: replica 0, waiting for that slice,
// ends within the transport timeout with an error naming rank 1.
TEST(ShardedOptimizer, AReplicaLostInTheReduceScatterOrTheGatherEndsItsPeerNamingIt) {
  // The data group's message tags (Pipeline::Impl::DataTag in pp/src/pipeline_impl.h): the
  // tripwire's `fired` says the stop happened at that message.
  constexpr int kGradientsTag = 1, kGatherTag = 4;
  for (const int tag : {kGradientsTag, kGatherTag}) {
    for (const bool stall : {false, true}) {
      SCOPED_TRACE(std::string(tag == kGradientsTag ? "reduce-scatter" : "gather") +
                   (stall ? ", stalled" : ", killed"));
      comm::TransportOptions to;
      to.timeout = std::chrono::milliseconds(1500);
      std::vector<std::string> errors(2);
      std::vector<double> seconds(2);
      std::atomic<bool> fired{false};
      comm::run_local_ranks(2, to, [&](comm::Transport& job) {
        const int r = job.rank();
        const auto t0 = std::chrono::steady_clock::now();
        Tripwire wire(job, tag, stall);
        try {
          auto data = comm::make_group(r == 1 ? static_cast<comm::Transport&>(wire) : job, {0, 1});
          auto pipeline = comm::make_group(job, {r});
          const PipelineOptions o = replica_options(*data, true);
          torch::nn::Linear linear(torch::nn::LinearOptions(4, 4).bias(false));
          Pipeline p(*pipeline, o, [&](int s) {
            return make_stage(s, linear.ptr(), [linear](const Tensors& in) mutable {
              return Tensors{linear->forward(in[0])};
            });
          });
          for (int64_t step = 0; step < 3; ++step) {
            wire.armed = step == 1;
            p.train_step([](int64_t s, int64_t i) {
              return MicroBatch{{at::full({2, 4}, static_cast<double>(1 + s + i))}, {}};
            });
          }
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
        }
        if (wire.fired) fired = true;
        seconds[static_cast<size_t>(r)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
      EXPECT_TRUE(fired) << "replica 1 sent no message with tag " << tag << " in step 1";
      EXPECT_EQ(errors[1], "tripwire: this rank stops here");
      EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
      if (stall) {
        EXPECT_NE(errors[0].find("timed out after 1500 ms"), std::string::npos) << errors[0];
      }
      // Within the timeout (killed: at once), not after the stalled rank's 4.5 s.
      EXPECT_LT(seconds[0], 4.0) << errors[0];
    }
  }
}

// A sharded optimizer steps slices: one that is not elementwise is refused at construction.
TEST(ShardedOptimizer, ANonElementwiseOptimizerIsAConfigError) {
  const auto errors = user_model::run_ranks(2, [&](comm::Transport& job) {
    auto data = comm::make_group(job, {0, 1});
    auto pipeline = comm::make_group(job, {job.rank()});
    PipelineOptions o = replica_options(*data, true);
    o.optimizer = [](const std::vector<at::Tensor>& p) {
      return std::make_unique<torch::optim::LBFGS>(p);
    };
    torch::nn::Linear linear(2, 2);
    Pipeline p(*pipeline, o, [&](int s) {
      return make_stage(s, linear.ptr(), [linear](const Tensors& in) mutable {
        return Tensors{linear->forward(in[0])};
      });
    });
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("shard_optimizer on rank 0: PipelineOptions::optimizer made an optimizer "
                     "other than torch's SGD, Adam, AdamW, RMSprop or Adagrad"),
              std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace pipemat::pp
