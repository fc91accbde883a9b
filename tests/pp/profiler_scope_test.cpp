// Note [Profiler scopes] (pp/src/executor.cpp): a run profiled with LibTorch's profiler shows
// every action of the schedule as a "PP:<type>" scope with its stage and micro-batch, once per
// step on its rank, and the step's tail as PP:CLIP and PP:OPTIMIZER.

#include <gtest/gtest.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "pipemat/pp/pipeline.h"
#include "pipemat/schedule/action.h"
#include "user_model.h"
#include "user_pipeline.h"

namespace pipemat::pp {
namespace {

using schedule::ScheduleKind;
using user_model::PipelineCase;

TEST(ProfilerScopes, EveryActionOfTheScheduleIsOneScopeOnItsRankPerStep) {
  PipelineCase c;
  c.kind = ScheduleKind::kZeroBubbleH1;  // F, I, W, R and the four kinds of message
  constexpr int64_t kSteps = 2;
  std::vector<std::string> traces(2);
  std::vector<std::map<std::string, int>> expected(2);
  const auto errors = user_model::run_ranks(2, [&](comm::Transport& t) {
    torch::nn::Sequential model = user_model::make_model(c.blocks, 7, c.dropout);
    const auto options = user_model::pipeline_options(c);
    Pipeline pipe(t, options,
                  split_sequential(model, balance_by_parameters(model, stage_count(options))));
    for (const schedule::Action& a : pipe.schedule().actions[t.rank()]) {
      expected[t.rank()][std::string("PP:") + schedule::action_type_code(a.type)] += kSteps;
    }
    expected[t.rank()]["PP:CLIP"] = kSteps;
    expected[t.rank()]["PP:OPTIMIZER"] = kSteps;
    std::ostringstream out;
    {
      torch::autograd::profiler::RecordProfile profile(out);  // this rank's thread
      for (int64_t s = 0; s < kSteps; ++s) {
        pipe.train_step([](int64_t step, int64_t i) {
          auto [ids, targets] = user_model::data(step, i);
          return MicroBatch{{ids}, {targets}};
        });
      }
    }
    traces[t.rank()] = out.str();
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(errors[r], "");
    const nlohmann::json trace = nlohmann::json::parse(traces[r]);
    ASSERT_TRUE(trace.is_array() || trace.contains("traceEvents")) << traces[r].substr(0, 200);
    const nlohmann::json& events = trace.is_array() ? trace : trace["traceEvents"];
    std::map<std::string, int> got;
    for (const nlohmann::json& e : events) {
      if (!e.contains("name")) continue;
      const std::string name = e["name"].get<std::string>();
      if (name.rfind("PP:", 0) == 0 && (!e.contains("ph") || e["ph"] == "X")) ++got[name];
    }
    EXPECT_EQ(got, expected[r]);
    EXPECT_GT(expected[r]["PP:W"], 0);
    EXPECT_GT(expected[r]["PP:SEND_F"] + expected[r]["PP:RECV_F"], 0);
  }
}

}  // namespace
}  // namespace pipemat::pp
