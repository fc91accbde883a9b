#pragma once
// The user model of user_model.h trained through the public pp API on one rank, recording what
// the plain loop records, for comparison.

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/comm/rank_threads.h"
#include "pipemat/comm/transport.h"

#include "pipemat/pp/pipeline.h"
#include "user_model.h"

namespace user_model {

// Runs `body(transport)` on `ranks` threads over local transports; returns each rank's error
// message ("" for none).
inline std::vector<std::string> run_ranks(
    int ranks, const std::function<void(pipemat::comm::Transport&)>& body) {
  pipemat::comm::TransportOptions options;
  options.timeout = std::chrono::seconds(30);
  std::vector<std::string> errors(ranks);
  pipemat::comm::run_local_ranks(ranks, options, [&](pipemat::comm::Transport& transport) {
    try {
      body(transport);
    } catch (const std::exception& e) {
      errors[transport.rank()] = e.what();
    }
  });
  return errors;
}

struct PipelineCase {
  pipemat::schedule::ScheduleKind kind = pipemat::schedule::ScheduleKind::kOneFOneB;
  int ranks = 2;
  int micro_batches = 4;
  int blocks = 6;
  bool remat = true;  // blocks are checkpoint units, their QKV projection a SAVE region
  pipemat::schedule::RecomputeMode recompute = pipemat::schedule::RecomputeMode::kPretrigger;
  int64_t steps = 3;
  std::optional<pipemat::schedule::Schedule> actions;  // an imported action list instead
  double dropout = 0;                                  // in every block
  std::optional<uint64_t> seed;                        // PipelineOptions::seed
};

inline pipemat::pp::PipelineOptions pipeline_options(const PipelineCase& c) {
  pipemat::pp::PipelineOptions o;
  o.schedule.kind = c.kind;
  o.schedule.ranks = c.ranks;
  o.schedule.micro_batches = c.micro_batches;
  o.schedule.virtual_stages = c.kind == pipemat::schedule::ScheduleKind::kInterleaved ? 2 : 1;
  o.schedule.recompute = c.remat ? c.recompute : pipemat::schedule::RecomputeMode::kNone;
  if (c.remat) {
    o.remat.checkpoint = {"block*"};
    o.remat.exclude = {{"block*.attn_in.1", true}};
  }
  o.loss = [](const Tensors& out, const Tensors& targets) {
    return loss_of(out.at(0), targets.at(0));
  };
  o.optimizer = make_adamw;
  o.lr_schedule = set_lr;
  o.clip_grad_norm = kClip;
  o.actions = c.actions;
  o.seed = c.seed;
  return o;
}

// What one rank saw: the loss and gradient norm of every step (every rank has them), and the
// parameters of its own stages after every step, by their name in the whole model.
struct RankRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<int64_t> peak_bytes;  // StepMetrics::peak_bytes (with the tracking allocator)
  // Per step, the last step's compute actions' (start_bytes, peak_bytes) of the timeline.
  std::vector<std::pair<int64_t, int64_t>> action_bytes;
  std::vector<std::map<std::string, at::Tensor>> params;
};

inline RankRun run_rank(pipemat::comm::Transport& transport, const PipelineCase& c) {
  torch::nn::Sequential model = make_model(c.blocks, 7, c.dropout);
  const auto options = pipeline_options(c);
  const auto bounds = pipemat::pp::balance_by_parameters(model, pipemat::pp::stage_count(options));
  pipemat::pp::Pipeline pipe(transport, options, pipemat::pp::split_sequential(model, bounds));
  RankRun run;
  for (int64_t step = 0; step < c.steps; ++step) {
    auto m = pipe.train_step([](int64_t s, int64_t i) {
      auto [ids, targets] = data(s, i);
      return pipemat::pp::MicroBatch{{ids}, {targets}};
    });
    run.losses.push_back(m.loss);
    run.grad_norms.push_back(m.grad_norm);
    run.peak_bytes.push_back(m.peak_bytes);
    run.action_bytes.clear();
    for (const auto& t : m.timeline) {
      if (pipemat::schedule::is_compute(t.action.type)) {
        run.action_bytes.emplace_back(t.start_bytes, t.peak_bytes);
      }
    }
    std::map<std::string, at::Tensor> ps;
    for (int s : pipe.stages()) {
      for (const auto& p : pipe.stage(s).module->named_parameters()) {
        ps[p.key()] = p.value().detach().clone();
      }
    }
    run.params.push_back(std::move(ps));
  }
  return run;
}

// Compares a rank's run with the plain loop bitwise; returns one line per difference.
inline std::vector<std::string> differences(const RankRun& got, const PlainRun& want, int rank) {
  std::vector<std::string> out;
  auto where = [&](int64_t step) {
    return "rank " + std::to_string(rank) + " step " + std::to_string(step) + ": ";
  };
  if (got.losses.size() != want.losses.size()) {
    out.push_back(where(0) + "ran " + std::to_string(got.losses.size()) + " steps, expected " +
                  std::to_string(want.losses.size()));
    return out;
  }
  for (size_t s = 0; s < want.losses.size(); ++s) {
    if (got.losses[s] != want.losses[s]) {
      out.push_back(where(s) + "loss " + std::to_string(got.losses[s]) + " vs plain " +
                    std::to_string(want.losses[s]));
    }
    if (got.grad_norms[s] != want.grad_norms[s]) {
      out.push_back(where(s) + "grad norm " + std::to_string(got.grad_norms[s]) + " vs plain " +
                    std::to_string(want.grad_norms[s]));
    }
    if (got.params[s].empty()) out.push_back(where(s) + "no parameters");
    for (const auto& [name, value] : got.params[s]) {
      auto it = want.params[s].find(name);
      if (it == want.params[s].end()) {
        out.push_back(where(s) + "parameter " + name + " is not in the plain model");
      } else if (!at::equal(value, it->second)) {
        out.push_back(where(s) + "parameter " + name + " differs by " +
                      std::to_string((value - it->second).abs().max().item<double>()));
      }
    }
  }
  return out;
}

}  // namespace user_model
