// pp::run_reference (Note [Single-process reference]) against a 2-rank pipeline of the user
// model of user_model.h: every step's loss, gradient norm and gradients, and the final
// parameters, bitwise; and against the plain LibTorch loop of user_model.h.

#include "pipemat/pp/reference.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "pipemat/comm/transport.h"
#include "pipemat/remat/rng.h"
#include "user_pipeline.h"

namespace pipemat::pp {
namespace {

using user_model::PipelineCase;

MicroBatch user_data(int64_t step, int64_t i) {
  auto [ids, targets] = user_model::data(step, i);
  return MicroBatch{{ids}, {targets}};
}

// What one pipeline rank saw, keyed "stage/name" for its own stages.
struct Seen {
  std::vector<double> losses, grad_norms;
  std::vector<std::map<std::string, at::Tensor>> grads;  // per step
  std::map<std::string, at::Tensor> params;              // after the last step
};

std::string key(int stage, const std::string& name) { return std::to_string(stage) + "/" + name; }

Seen run_pipeline_rank(comm::Transport& transport, const PipelineCase& c) {
  torch::nn::Sequential model = user_model::make_model(c.blocks, 7, c.dropout);
  const PipelineOptions options = user_model::pipeline_options(c);
  Pipeline pipe(transport, options,
                split_sequential(model, balance_by_parameters(model, stage_count(options))));
  Seen seen;
  for (int64_t step = 0; step < c.steps; ++step) {
    const StepMetrics m = pipe.train_step(user_data);
    seen.losses.push_back(m.loss);
    seen.grad_norms.push_back(m.grad_norm);
    std::map<std::string, at::Tensor> grads;
    for (int s : pipe.stages()) {
      for (const auto& p : pipe.stage(s).module->named_parameters()) {
        grads[key(s, p.key())] =
            p.value().grad().defined() ? p.value().grad().clone() : at::Tensor();
      }
    }
    seen.grads.push_back(std::move(grads));
  }
  for (int s : pipe.stages()) {
    for (const auto& p : pipe.stage(s).module->named_parameters()) {
      seen.params[key(s, p.key())] = p.value().detach().clone();
    }
  }
  return seen;
}

ReferenceRun reference_of(const PipelineCase& c) {
  torch::nn::Sequential model = user_model::make_model(c.blocks, 7, c.dropout);
  const PipelineOptions options = user_model::pipeline_options(c);
  return run_reference(options,
                       split_sequential(model, balance_by_parameters(model, stage_count(options))),
                       user_data, c.steps);
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || at::equal(a, b));
}

void expect_pipeline_equals_reference(const PipelineCase& c) {
  const ReferenceRun want = reference_of(c);
  ASSERT_EQ(want.steps.size(), static_cast<size_t>(c.steps));
  std::vector<Seen> ranks(static_cast<size_t>(c.ranks));
  const auto errors = user_model::run_ranks(
      c.ranks, [&](comm::Transport& t) { ranks[t.rank()] = run_pipeline_rank(t, c); });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  size_t grads_seen = 0, params_seen = 0;
  for (int r = 0; r < c.ranks; ++r) {
    const Seen& got = ranks[static_cast<size_t>(r)];
    for (int64_t t = 0; t < c.steps; ++t) {
      const ReferenceStep& w = want.steps[static_cast<size_t>(t)];
      EXPECT_EQ(got.losses[t], w.loss) << "rank " << r << " step " << t;
      EXPECT_EQ(got.grad_norms[t], w.grad_norm) << "rank " << r << " step " << t;
      for (const StageTensor& g : w.gradients) {
        auto it = got.grads[t].find(key(g.stage, g.name));
        if (it == got.grads[t].end()) continue;  // another rank's stage
        ++grads_seen;
        EXPECT_TRUE(same(it->second, g.tensor))
            << "rank " << r << " step " << t << " gradient of stage " << g.stage << " " << g.name;
      }
    }
    for (const StageTensor& p : want.parameters) {
      auto it = got.params.find(key(p.stage, p.name));
      if (it == got.params.end()) continue;
      ++params_seen;
      EXPECT_TRUE(at::equal(it->second, p.tensor))
          << "rank " << r << " parameter of stage " << p.stage << " " << p.name;
    }
  }
  // Every parameter of the reference was held by one rank of the pipeline.
  EXPECT_EQ(params_seen, want.parameters.size());
  EXPECT_EQ(grads_seen, want.parameters.size() * static_cast<size_t>(c.steps));
}

TEST(Reference, TwoRankOneFOneBPipelineOfTheUserModelEqualsTheReferenceBitwise) {
  PipelineCase c;  // 1F1B, 2 ranks, 4 micro-batches, selective remat pre-triggered, clipping
  expect_pipeline_equals_reference(c);
}

TEST(Reference, SeededDropoutOnZeroBubbleVEqualsTheReferenceBitwise) {
  PipelineCase c;
  c.kind = schedule::ScheduleKind::kZeroBubbleV;  // 4 stages on 2 ranks, split backward
  c.dropout = 0.1;
  c.seed = 11;
  expect_pipeline_equals_reference(c);
}

// Note [Data x pipeline]: 2 replicas of a 2-rank 1F1B pipeline (4 ranks as threads) against the
// reference given a data group of 2 (it only reads its size).
TEST(Reference, TwoReplicasOfATwoRankPipelineEqualTheReferenceBitwise) {
  constexpr int kReplicas = 2;
  PipelineCase c;
  auto groups = comm::make_local_transports(kReplicas);
  ReferenceRun want;
  {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    PipelineOptions options = user_model::pipeline_options(c);
    options.data_group = groups[0].get();
    want = run_reference(
        options, split_sequential(model, balance_by_parameters(model, stage_count(options))),
        user_data, c.steps);
  }
  std::vector<Seen> ranks(static_cast<size_t>(kReplicas * c.ranks));
  const auto errors = user_model::run_ranks(kReplicas * c.ranks, [&](comm::Transport& job) {
    const int w = job.rank(), replica = w % kReplicas, prank = w / kReplicas;
    std::vector<int> data_ranks, pipe_ranks;
    for (int d = 0; d < kReplicas; ++d) data_ranks.push_back(prank * kReplicas + d);
    for (int r = 0; r < c.ranks; ++r) pipe_ranks.push_back(r * kReplicas + replica);
    auto data = comm::make_group(job, data_ranks);
    auto pipeline = comm::make_group(job, pipe_ranks);
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
    PipelineOptions options = user_model::pipeline_options(c);
    options.data_group = data.get();
    Pipeline pipe(*pipeline, options,
                  split_sequential(model, balance_by_parameters(model, stage_count(options))));
    Seen& seen = ranks[static_cast<size_t>(w)];
    for (int64_t step = 0; step < c.steps; ++step) {
      const StepMetrics m = pipe.train_step(user_data);
      seen.losses.push_back(m.loss);
      seen.grad_norms.push_back(m.grad_norm);
    }
    for (int s : pipe.stages()) {
      for (const auto& p : pipe.stage(s).module->named_parameters()) {
        seen.params[key(s, p.key())] = p.value().detach().clone();
      }
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (size_t w = 0; w < ranks.size(); ++w) {
    for (int64_t t = 0; t < c.steps; ++t) {
      EXPECT_EQ(ranks[w].losses[t], want.steps[t].loss) << "rank " << w << " step " << t;
      EXPECT_EQ(ranks[w].grad_norms[t], want.steps[t].grad_norm) << "rank " << w << " step " << t;
    }
    size_t seen_params = 0;
    for (const StageTensor& p : want.parameters) {
      auto it = ranks[w].params.find(key(p.stage, p.name));
      if (it == ranks[w].params.end()) continue;
      ++seen_params;
      EXPECT_TRUE(at::equal(it->second, p.tensor)) << "rank " << w << " " << p.name;
    }
    EXPECT_GT(seen_params, 0u) << "rank " << w;
  }
}

TEST(Reference, EqualsThePlainLibTorchLoop) {
  PipelineCase c;
  const ReferenceRun got = reference_of(c);
  const user_model::PlainRun want = user_model::plain_training(c.blocks, c.micro_batches, c.steps);
  for (int64_t t = 0; t < c.steps; ++t) {
    EXPECT_EQ(got.steps[t].loss, want.losses[t]) << "step " << t;
    EXPECT_EQ(got.steps[t].grad_norm, want.grad_norms[t]) << "step " << t;
  }
  ASSERT_FALSE(got.parameters.empty());
  for (const StageTensor& p : got.parameters) {
    EXPECT_TRUE(at::equal(p.tensor, want.params.back().at(p.name))) << p.name;
  }
}

// Note [Random streams of a step], layout invariance: the user model's blocks (dropout 0.2) each
// drawn inside a remat::LayerStream keyed by the block, on stages with
// PipelineStage::layer_streams.
struct KeyedBlockImpl : torch::nn::Module {
  KeyedBlockImpl(user_model::Block b, int64_t key_) : key(key_) {
    block = register_module("block", std::move(b));
  }
  Tensors forward(const Tensors& in) {
    remat::LayerStream stream(key);
    return block->forward(in);
  }
  user_model::Block block{nullptr};
  int64_t key;
};
TORCH_MODULE(KeyedBlock);

// make_model's 6 blocks with dropout, each keyed (`keyed`) or as it is.
torch::nn::Sequential dropout_model(bool keyed) {
  torch::nn::Sequential plain = user_model::make_model(6, 7, 0.2);
  if (!keyed) return plain;
  torch::nn::Sequential model;
  model->push_back("embed", user_model::Embed(plain->ptr<user_model::EmbedImpl>(0)));
  for (size_t b = 0; b < 6; ++b) {
    model->push_back("block" + std::to_string(b),
                     KeyedBlock(user_model::Block(plain->ptr<user_model::BlockImpl>(b + 1)),
                                static_cast<int64_t>(b)));
  }
  model->push_back("head", user_model::Head(plain->ptr<user_model::HeadImpl>(7)));
  return model;
}

PipelineOptions dropout_options(schedule::ScheduleKind kind, int ranks) {
  PipelineCase c;
  c.kind = kind;
  c.ranks = ranks;
  c.dropout = 0.2;
  c.seed = 11;
  PipelineOptions o = user_model::pipeline_options(c);
  o.remat.exclude = {{"block*.block.attn_in.1", true}};
  return o;
}

StageFactory keyed_split(torch::nn::Sequential model, std::vector<int64_t> bounds, bool keyed) {
  return [split = split_sequential(std::move(model), std::move(bounds)), keyed](int s) {
    PipelineStage stage = split(s);
    stage.layer_streams = keyed;
    return stage;
  };
}

// What a run trained: losses, gradient norms and the final parameters by name.
struct Trained {
  std::vector<double> losses, grad_norms;
  std::map<std::string, at::Tensor> params;
};

Trained reference_split(std::vector<int64_t> bounds, bool keyed) {
  const PipelineOptions options =
      dropout_options(schedule::ScheduleKind::kOneFOneB, static_cast<int>(bounds.size()) - 1);
  const ReferenceRun run =
      run_reference(options, keyed_split(dropout_model(keyed), bounds, keyed), user_data, 3);
  Trained t;
  for (const ReferenceStep& s : run.steps) {
    t.losses.push_back(s.loss);
    t.grad_norms.push_back(s.grad_norm);
  }
  for (const StageTensor& p : run.parameters) t.params[p.name] = p.tensor;
  return t;
}

void expect_same_training(const Trained& got, const Trained& want) {
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_EQ(got.grad_norms, want.grad_norms);
  for (double norm : want.grad_norms) EXPECT_GT(norm, user_model::kClip) << "clipping acted";
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [name, value] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    EXPECT_TRUE(at::equal(got.params.at(name), value)) << name;
  }
}

// The reference on 1, 2 (two splits) and 3 stages and a ZB-V pipeline of 4 stages on 2 ranks
// (selective remat, pre-triggered replays) train alike, bitwise; without layer streams two
// splits draw other masks.
TEST(Reference, LayerStreamsTrainTheUserModelAlikeOnEverySplit) {
  const Trained one = reference_split({0, 8}, true);
  for (const std::vector<int64_t>& bounds :
       std::vector<std::vector<int64_t>>{{0, 2, 8}, {0, 5, 8}, {0, 3, 6, 8}}) {
    SCOPED_TRACE(::testing::PrintToString(bounds));
    expect_same_training(reference_split(bounds, true), one);
  }
  std::vector<Trained> ranks(2);
  const auto errors = user_model::run_ranks(2, [&](comm::Transport& t) {
    Pipeline pipe(t, dropout_options(schedule::ScheduleKind::kZeroBubbleV, 2),
                  keyed_split(dropout_model(true), {0, 2, 4, 6, 8}, true));
    Trained& got = ranks[static_cast<size_t>(t.rank())];
    for (int64_t step = 0; step < 3; ++step) {
      const StepMetrics m = pipe.train_step(user_data);
      got.losses.push_back(m.loss);
      got.grad_norms.push_back(m.grad_norm);
    }
    for (int s : pipe.stages()) {
      for (const auto& p : pipe.stage(s).module->named_parameters()) {
        got.params[p.key()] = p.value().detach().clone();
      }
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  ranks[0].params.insert(ranks[1].params.begin(), ranks[1].params.end());
  expect_same_training(ranks[0], one);
  EXPECT_NE(reference_split({0, 2, 8}, false).losses, reference_split({0, 5, 8}, false).losses)
      << "streams keyed by stage: another split, other masks";
}

TEST(Reference, AFactoryThatReturnsAnotherStageIsAConfigError) {
  PipelineCase c;
  torch::nn::Sequential model = user_model::make_model(c.blocks, 7);
  const PipelineOptions options = user_model::pipeline_options(c);
  const StageFactory split = split_sequential(model, balance_by_parameters(model, 2));
  EXPECT_THROW(run_reference(
                   options, [&](int) { return split(0); }, user_data, 1),
               ConfigError);
}

}  // namespace
}  // namespace pipemat::pp
