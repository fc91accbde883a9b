// Note [Tied weights] through the public API: a model whose first stage looks ids up in an
// embedding and whose last stage multiplies by the same weight, each stage holding a copy.
// Against run_reference bitwise (every step's loss and norm, the final parameters), the copies
// equal after every step, close to a plain LibTorch loop over one shared weight, and the errors.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "pipemat/comm/rank_threads.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/pp/reference.h"

namespace pipemat::pp {
namespace {

constexpr int64_t kVocab = 13, kHidden = 8, kBatch = 2, kSeq = 5;
constexpr double kClip = 0.05;  // active: the norm is above it

at::Tensor initial(int64_t rows, int64_t cols, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({rows, cols}, gen) * 0.3;
}

// Stage s of `stages`: the first looks up its copy of the embedding ("embed.weight"), every stage
// applies a tanh(linear), the last multiplies by its copy. A stage both first and last shares one.
struct TiedStage : torch::nn::Module {
  TiedStage(int s, int stages) : first(s == 0), last(s == stages - 1) {
    lin = register_module("lin", torch::nn::Linear(kHidden, kHidden));
    {
      at::NoGradGuard no_grad;
      lin->weight.copy_(initial(kHidden, kHidden, 100 + static_cast<uint64_t>(s)));
      lin->bias.zero_();
    }
    if (first || last) {
      embed = register_module("embed", std::make_shared<torch::nn::Module>());
      embed->register_parameter("weight", initial(kVocab, kHidden, 7));
    }
  }
  Tensors forward(const Tensors& in) {
    const at::Tensor w = first || last ? embed->named_parameters()["weight"] : at::Tensor();
    at::Tensor x = first ? at::embedding(w, in.at(0)) : in.at(0);
    x = at::tanh(lin(x));
    return {last ? at::linear(x, w) : x};
  }
  bool first, last;
  torch::nn::Linear lin{nullptr};
  std::shared_ptr<torch::nn::Module> embed;
};

StageFactory tied_factory(int stages) {
  return [stages](int s) {
    auto m = std::make_shared<TiedStage>(s, stages);
    PipelineStage stage = make_stage(s, m, [m](const Tensors& in) { return m->forward(in); });
    if (stages > 1 && (s == 0 || s == stages - 1)) stage.tied = {{"embed.weight", "embedding"}};
    return stage;
  };
}

MicroBatch tied_data(int64_t step, int64_t i) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(31 * step + i + 1);
  const at::Tensor seq = at::randint(kVocab, {kBatch, kSeq + 1}, gen);
  return {{seq.narrow(1, 0, kSeq)}, {seq.narrow(1, 1, kSeq).contiguous()}};
}

PipelineOptions tied_options(schedule::ScheduleKind kind, int ranks) {
  PipelineOptions o;
  o.schedule.kind = kind;
  o.schedule.ranks = ranks;
  o.schedule.micro_batches = 4;
  o.schedule.virtual_stages = kind == schedule::ScheduleKind::kInterleaved ? 2 : 1;
  o.loss = [](const Tensors& out, const Tensors& t) {
    return torch::nn::functional::cross_entropy(out.at(0).reshape({-1, kVocab}),
                                                t.at(0).reshape({-1}));
  };
  o.optimizer = [](const std::vector<at::Tensor>& p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.05));
  };
  o.clip_grad_norm = kClip;
  return o;
}

constexpr int64_t kSteps = 4;

struct TiedCase {
  schedule::ScheduleKind kind;
  int ranks;
};

void PrintTo(const TiedCase& t, std::ostream* os) {
  *os << schedule::to_string(t.kind) << " on " << t.ranks << " ranks";
}

class TiedWeights : public ::testing::TestWithParam<TiedCase> {};

TEST_P(TiedWeights, CopiesStayEqualEveryStepAndTheRunEqualsTheReferenceBitwise) {
  const PipelineOptions options = tied_options(GetParam().kind, GetParam().ranks);
  const int stages = stage_count(options);
  const ReferenceRun want = run_reference(options, tied_factory(stages), tied_data, kSteps);
  std::mutex mu;
  std::map<int, std::vector<at::Tensor>> copies;  // step -> every copy seen, any rank
  std::map<std::string, at::Tensor> final_params;
  std::vector<std::vector<double>> losses(static_cast<size_t>(GetParam().ranks)),
      norms(static_cast<size_t>(GetParam().ranks));
  comm::TransportOptions transport_options;
  transport_options.timeout = std::chrono::seconds(30);
  comm::run_local_ranks(GetParam().ranks, transport_options, [&](comm::Transport& t) {
    Pipeline pipe(t, options, tied_factory(stages));
    for (int64_t step = 0; step < kSteps; ++step) {
      const StepMetrics m = pipe.train_step(tied_data);
      std::lock_guard<std::mutex> lock(mu);
      losses[static_cast<size_t>(t.rank())].push_back(m.loss);
      norms[static_cast<size_t>(t.rank())].push_back(m.grad_norm);
      for (int s : pipe.stages()) {
        const auto ps = pipe.stage(s).module->named_parameters();
        if (ps.contains("embed.weight"))
          copies[step].push_back(ps["embed.weight"].detach().clone());
        if (step + 1 == kSteps) {
          for (const auto& p : ps) final_params[std::to_string(s) + "/" + p.key()] = p.value();
        }
      }
    }
  });
  for (int64_t step = 0; step < kSteps; ++step) {
    ASSERT_EQ(copies[step].size(), 2u) << "step " << step;
    EXPECT_TRUE(at::equal(copies[step][0], copies[step][1]))
        << "the copies differ after step " << step;
    for (int r = 0; r < GetParam().ranks; ++r) {
      EXPECT_EQ(losses[static_cast<size_t>(r)][step], want.steps[step].loss) << "rank " << r;
      EXPECT_EQ(norms[static_cast<size_t>(r)][step], want.steps[step].grad_norm) << "rank " << r;
    }
  }
  EXPECT_GT(want.steps[0].grad_norm, kClip);  // clipping is active
  ASSERT_EQ(final_params.size(), want.parameters.size());
  for (const StageTensor& p : want.parameters) {
    const std::string k = std::to_string(p.stage) + "/" + p.name;
    ASSERT_TRUE(final_params.count(k)) << k;
    EXPECT_TRUE(at::equal(final_params[k], p.tensor)) << k;
  }
  // The reference itself against a plain loop over one shared weight: the same model, so the
  // same numbers up to the order of the gradient's sums.
  std::vector<std::shared_ptr<TiedStage>> plain;
  std::vector<at::Tensor> params;
  for (int s = 0; s < stages; ++s) {
    plain.push_back(std::make_shared<TiedStage>(s, stages));
    params.push_back(plain.back()->lin->weight);
    params.push_back(plain.back()->lin->bias);
  }
  const at::Tensor shared = plain.front()->embed->named_parameters()["weight"];
  plain.back()->embed = plain.front()->embed;  // one weight, two uses
  params.insert(params.begin(), shared);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(0.05));
  for (int64_t step = 0; step < kSteps; ++step) {
    for (auto& p : params) p.mutable_grad().reset();
    double loss = 0;
    for (int64_t i = 0; i < 4; ++i) {
      MicroBatch b = tied_data(step, i);
      Tensors x = b.inputs;
      for (auto& m : plain) x = m->forward(x);
      at::Tensor l = options.loss(x, b.targets) / 4.0;
      loss += l.item<double>();
      l.backward();
    }
    const double norm = torch::nn::utils::clip_grad_norm_(params, kClip);
    opt.step();
    EXPECT_NEAR(loss, want.steps[step].loss, 1e-6 * std::abs(loss)) << "step " << step;
    EXPECT_NEAR(norm, want.steps[step].grad_norm, 1e-5 * norm) << "step " << step;
  }
  for (const StageTensor& p : want.parameters) {
    if (p.name == "embed.weight") {
      EXPECT_TRUE(at::allclose(shared, p.tensor, 1e-5, 1e-6));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, TiedWeights,
                         ::testing::Values(TiedCase{schedule::ScheduleKind::kOneFOneB, 2},
                                           TiedCase{schedule::ScheduleKind::kOneFOneB, 3},
                                           TiedCase{schedule::ScheduleKind::kZeroBubbleV, 2},
                                           TiedCase{schedule::ScheduleKind::kInterleaved, 2}),
                         [](const ::testing::TestParamInfo<TiedCase>& test) {
                           std::string n = std::string(schedule::to_string(test.param.kind)) + "_" +
                                           std::to_string(test.param.ranks) + "ranks";
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// What every rank of a 2-rank pipeline reports when `change` alters the last stage.
std::vector<std::string> errors_of(const std::function<void(PipelineStage&)>& change) {
  const PipelineOptions options = tied_options(schedule::ScheduleKind::kOneFOneB, 2);
  std::vector<std::string> errors(2);
  comm::TransportOptions transport_options;
  transport_options.timeout = std::chrono::seconds(30);
  comm::run_local_ranks(2, transport_options, [&](comm::Transport& t) {
    try {
      Pipeline pipe(t, options, [&](int s) {
        PipelineStage stage = tied_factory(2)(s);
        if (s == 1) change(stage);
        return stage;
      });
      pipe.train_step(tied_data);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(t.rank())] = e.what();
    }
  });
  return errors;
}

TEST(TiedWeightsErrors, CopiesThatDifferAreRefusedOnEveryRankAtTheFirstStep) {
  const auto errors = errors_of([](PipelineStage& stage) {
    at::NoGradGuard no_grad;
    stage.module->named_parameters()["embed.weight"][0][0].add_(1e-3);
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("tied weight 'embedding': the copy on stage 1 (rank 1, 'embed.weight') "
                     "differs from the one on stage 0 (rank 0, 'embed.weight')"),
              std::string::npos)
        << e;
  }
}

TEST(TiedWeightsErrors, AKeyOfOneCopyAndANameThatIsNoParameterAreErrors) {
  auto errors = errors_of([](PipelineStage& stage) { stage.tied = {{"embed.weight", "other"}}; });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("tied weight 'embedding': only stage 0 (rank 0, 'embed.weight') declares it"),
              std::string::npos)
        << e;
  }
  errors = errors_of([](PipelineStage& stage) { stage.tied = {{"embed.wieght", "embedding"}}; });
  EXPECT_NE(errors[1].find("stage 1 declares 'embed.wieght' tied (key 'embedding') but its module "
                           "has no parameter of that name"),
            std::string::npos)
      << errors[1];
}

}  // namespace
}  // namespace pipemat::pp
