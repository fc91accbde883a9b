// output.trace (Note [Step trace]): the Chrome trace-event JSON of a run, read back with
// nlohmann::json and held against the run's own schedule: every action once per step on its
// rank, no two events overlapping on one track, sends and receives paired with equal bytes,
// the compute and communication tracks tiling each rank's measured step, the simulated
// timeline beside it, the data group's exchange and the checkpoint.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/pp/trace.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/train/train.h"

namespace pipemat::train {
namespace {

namespace fs = std::filesystem;

struct TraceCase {
  std::string kind;
  int ranks;
  int data = 1;
};

std::string trace_case_name(const ::testing::TestParamInfo<TraceCase>& info) {
  std::string n = info.param.kind + "_" + std::to_string(info.param.ranks) + "ranks_D" +
                  std::to_string(info.param.data);
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

TrainConfig trace_config(const TraceCase& p, const fs::path& dir) {
  TrainConfig c;
  c.model.kind = models::parse_model_kind("transformer").value();
  c.model.layers = 8;
  c.model.hidden = 16;
  c.model.tokens = 8;
  c.model.heads = 2;
  c.schedule.kind = schedule::parse_schedule_kind(p.kind);
  c.schedule.ranks = p.ranks;
  c.schedule.micro_batches = 4;
  c.schedule.virtual_stages = p.kind == "interleaved" ? 2 : 1;
  c.schedule.recompute = schedule::RecomputeMode::kPretrigger;
  c.remat.policy = models::parse_remat_policy("full").value();
  c.parallel.data = p.data;
  c.parallel.shard_optimizer = p.data > 1;
  c.training.steps = 3;
  c.training.lr = 0.05;
  c.training.clip_grad_norm = 1.0;
  c.output.progress = false;
  c.output.trace = (dir / "trace.json").string();
  return c;
}

nlohmann::json read_trace(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

struct Ev {
  std::string name;
  int pid, tid;
  double ts, dur;
  int64_t step;
  int stage, mb;
  int64_t bytes;
};

std::vector<Ev> complete_events(const nlohmann::json& trace) {
  std::vector<Ev> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const auto& a = e.at("args");
    out.push_back({e.at("name").get<std::string>(), e.at("pid").get<int>(), e.at("tid").get<int>(),
                   e.at("ts").get<double>(), e.at("dur").get<double>(), a.at("step").get<int64_t>(),
                   a.value("stage", -1), a.value("micro_batch", -1),
                   a.value("bytes", int64_t{-1})});
  }
  return out;
}

// Times are written with 3 decimals of a microsecond.
constexpr double kRounding = 0.001;

class TraceGrid : public ::testing::TestWithParam<TraceCase> {};

TEST_P(TraceGrid, EveryActionOncePerStepTracksTileTheStepAndMessagesPair) {
  const TraceCase& p = GetParam();
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("pipemat-trace-" + trace_case_name({p, 0}));
  fs::remove_all(dir);
  const TrainConfig c = trace_config(p, dir);
  const TrainResult result = train_in_process(c, nullptr);
  const schedule::Schedule plan = schedule::build_schedule(c.schedule);
  const nlohmann::json trace = read_trace(c.output.trace);
  ASSERT_TRUE(trace.contains("traceEvents"));
  const std::vector<Ev> events = complete_events(trace);
  const int ranks = plan.ranks_count;
  const int64_t steps = c.training.steps;
  // Every rank of the job: pipeline rank r of replica d is process r x D + d.
  const int D = p.data, job_ranks = ranks * D;

  // Process and track names: one process per rank of the job and one for the simulation.
  std::map<int, std::string> process_names;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "process_name") {
      process_names[e.at("pid").get<int>()] = e.at("args").at("name").get<std::string>();
    }
  }
  ASSERT_EQ(process_names.size(), static_cast<size_t>(job_ranks + 1));
  for (int j = 0; j < job_ranks; ++j) {
    EXPECT_EQ(process_names[j], "rank " + std::to_string(j) +
                                    (D > 1 ? " (replica " + std::to_string(j % D) +
                                                 ", pipeline rank " + std::to_string(j / D) + ")"
                                           : ""));
  }
  EXPECT_NE(process_names[job_ranks].find("simulated"), std::string::npos);

  for (int64_t step = 0; step < steps; ++step) {
    for (int j = 0; j < job_ranks; ++j) {
      const int r = j / D;
      // Every action of the rank's list once: compute on track 0, sends and receives on 1.
      std::multiset<std::string> want, got;
      for (const schedule::Action& a : plan.actions[r]) {
        want.insert(schedule::format_action(a) + (schedule::is_compute(a.type) ? "@0" : "@1"));
      }
      for (const Ev& e : events) {
        if (e.pid != j || e.step != step || e.tid > 1) continue;
        if (e.stage < 0 || e.name == "LOSS") continue;  // the step's other parts
        got.insert(e.name + "@" + std::to_string(e.tid));
      }
      EXPECT_EQ(got, want) << "rank " << j << " step " << step;
      // The last stage's F and its loss, once per micro-batch.
      int losses = 0;
      for (const Ev& e : events) losses += e.pid == j && e.step == step && e.name == "LOSS";
      const bool holds_last = plan.rank_of(plan.stages_count - 1) == r;
      EXPECT_EQ(losses, holds_last ? plan.micro_batches : 0) << "rank " << j;
      // The compute and communication tracks tile the step: their durations sum to it.
      double tiles = 0, step_dur = -1;
      int tile_events = 0, step_events = 0, optimizer = 0, clip = 0;
      for (const Ev& e : events) {
        if (e.pid != j || e.step != step) continue;
        if (e.tid <= 1 && e.name != "CHECKPOINT") tiles += e.dur, ++tile_events;
        if (e.tid == 3) step_dur = e.dur, ++step_events;
        optimizer += e.name == "OPTIMIZER";
        clip += e.name == "CLIP";
      }
      EXPECT_EQ(step_events, 1);
      EXPECT_EQ(optimizer, 1);
      EXPECT_EQ(clip, 1);
      EXPECT_GT(step_dur, 0);
      EXPECT_NEAR(tiles, step_dur, kRounding * (tile_events + 1))
          << "rank " << j << " step " << step;
      // The data group's reduce: one exchange of the rank's gradient bytes, and the gather.
      int exchanges = 0, gathers = 0;
      for (const Ev& e : events) {
        if (e.pid != j || e.step != step) continue;
        if (e.name == "GRADIENT_EXCHANGE") {
          ++exchanges;
          EXPECT_EQ(e.tid, 2);
          EXPECT_GT(e.bytes, 0);
        }
        gathers += e.name == "GATHER";
      }
      EXPECT_EQ(exchanges, p.data > 1 ? 1 : 0) << "rank " << j;
      EXPECT_EQ(gathers, p.data > 1 ? 1 : 0) << "rank " << j;
    }
    // The simulated process: every compute action of each rank once.
    for (int r = 0; r < ranks; ++r) {
      std::multiset<std::string> want, got;
      for (const schedule::Action& a : plan.compute_actions(r)) {
        want.insert(schedule::format_action(a));
      }
      for (const Ev& e : events) {
        if (e.pid == job_ranks && e.tid == r && e.step == step) got.insert(e.name);
      }
      EXPECT_EQ(got, want) << "simulated rank " << r;
    }
  }

  // No two events overlap on one track.
  std::map<std::pair<int, int>, std::vector<const Ev*>> tracks;
  for (const Ev& e : events) tracks[{e.pid, e.tid}].push_back(&e);
  for (auto& [track, list] : tracks) {
    std::sort(list.begin(), list.end(), [](const Ev* a, const Ev* b) {
      return std::tie(a->ts, a->dur) < std::tie(b->ts, b->dur);
    });
    for (size_t i = 1; i < list.size(); ++i) {
      EXPECT_GE(list[i]->ts, list[i - 1]->ts + list[i - 1]->dur - 2 * kRounding)
          << list[i - 1]->name << " and " << list[i]->name << " overlap on pid " << track.first
          << " tid " << track.second;
    }
  }

  // Sends and receives pair up by (replica, step, stage, micro-batch) with the same bytes:
  // SEND_F(s, i) with RECV_F(s + 1, i) on the next stage's rank, SEND_B(s, i) with RECV_B(s - 1,
  // i).
  std::map<std::tuple<int, int64_t, std::string, int, int>, std::pair<int, int64_t>> sends, recvs;
  for (const Ev& e : events) {
    if (e.pid >= job_ranks || e.tid != 1) continue;
    const auto key = [&](const char* kind, int stage) {
      return std::make_tuple(e.pid % D, e.step, std::string(kind), stage, e.mb);
    };
    const std::string code = e.name.substr(std::to_string(e.stage).size());
    const std::string type = code.substr(0, code.size() - std::to_string(e.mb).size());
    if (type == "SEND_F") sends[key("F", e.stage + 1)] = {e.pid, e.bytes};
    if (type == "SEND_B") sends[key("B", e.stage - 1)] = {e.pid, e.bytes};
    if (type == "RECV_F") recvs[key("F", e.stage)] = {e.pid, e.bytes};
    if (type == "RECV_B") recvs[key("B", e.stage)] = {e.pid, e.bytes};
  }
  EXPECT_EQ(sends.size(), recvs.size());
  EXPECT_FALSE(sends.empty());
  std::set<int> replicas_sending;
  for (const auto& [key, sent] : sends) replicas_sending.insert(std::get<0>(key));
  EXPECT_EQ(replicas_sending.size(), static_cast<size_t>(D));
  for (const auto& [key, sent] : sends) {
    auto it = recvs.find(key);
    ASSERT_NE(it, recvs.end()) << "a send with no receive: step " << std::get<1>(key);
    EXPECT_EQ(it->second.second, sent.second) << "bytes of one message";
    EXPECT_GT(sent.second, 0);
    EXPECT_EQ(it->second.first, plan.rank_of(std::get<3>(key)) * D + std::get<0>(key));
  }
  EXPECT_EQ(result.steps.size(), static_cast<size_t>(steps));
  // What making and writing each step's events took, for the run's summary.
  ASSERT_EQ(result.totals.trace_ms.size(), static_cast<size_t>(steps));
  for (double ms : result.totals.trace_ms) {
    EXPECT_GT(ms, 0);
    EXPECT_LT(ms, 1000);
  }
  fs::remove_all(dir);
}

std::vector<TraceCase> trace_cases() {
  std::vector<TraceCase> cases;
  for (const char* kind : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"}) {
    cases.push_back({kind, 2});
  }
  cases.push_back({"1f1b", 4});
  cases.push_back({"zb-v", 4});
  cases.push_back({"1f1b", 2, 2});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Trace, TraceGrid, ::testing::ValuesIn(trace_cases()), trace_case_name);

// The checkpoint is an event of the last stage's rank after its step; without output.trace no
// file is written; a path that cannot be a file is refused naming output.trace.
TEST(Trace, TheCheckpointIsAnEventAndAnUnwritablePathIsRefused) {
  const fs::path dir = fs::path(::testing::TempDir()) / "pipemat-trace-checkpoint";
  fs::remove_all(dir);
  TrainConfig c = trace_config({"1f1b", 2}, dir);
  c.checkpoint.dir = (dir / "ck").string();
  c.checkpoint.every = 2;
  train_in_process(c, nullptr);
  const std::vector<Ev> events = complete_events(read_trace(c.output.trace));
  std::vector<int64_t> at;
  for (const Ev& e : events) {
    if (e.name != "CHECKPOINT") continue;
    at.push_back(e.step);
    EXPECT_EQ(e.pid, 1);
    EXPECT_EQ(e.tid, 1);
    EXPECT_GT(e.dur, 0);
  }
  EXPECT_EQ(at, (std::vector<int64_t>{1, 2})) << "every 2 steps and after the last";

  // With 2 replicas the checkpoint is written by replica 0's last stage's rank: job rank 2.
  TrainConfig replicas = trace_config({"1f1b", 2, 2}, dir / "replicas");
  replicas.checkpoint.dir = (dir / "replicas" / "ck").string();
  replicas.checkpoint.every = 2;
  train_in_process(replicas, nullptr);
  int checkpoints = 0;
  for (const Ev& e : complete_events(read_trace(replicas.output.trace))) {
    if (e.name != "CHECKPOINT") continue;
    ++checkpoints;
    EXPECT_EQ(e.pid, 2);
  }
  EXPECT_EQ(checkpoints, 2);

  TrainConfig off = trace_config({"1f1b", 2}, dir / "off");
  off.output.trace.clear();
  EXPECT_TRUE(train_in_process(off, nullptr).totals.trace_ms.empty());
  EXPECT_FALSE(fs::exists(dir / "off"));

  TrainConfig bad = trace_config({"1f1b", 2}, dir);
  bad.output.trace = dir.string();  // a directory
  try {
    train_in_process(bad, nullptr);
    ADD_FAILURE() << "a directory as output.trace was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("output.trace"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// ChromeTrace with replicas: a step without every replica's timelines, and no replica at all, are
// errors that say what is missing.
TEST(Trace, AStepWithoutEveryReplicasTimelinesIsAnError) {
  schedule::ScheduleOptions o;
  o.kind = schedule::ScheduleKind::kOneFOneB;
  o.ranks = 2;
  o.micro_batches = 4;
  pp::StepMetrics m;
  m.step = 3;
  m.rank_timelines.assign(2, {});
  m.rank_spans.assign(2, {});
  m.rank_step_ms.assign(2, 1.0);
  m.rank_clock_start_us.assign(2, 0.0);
  pp::ChromeTrace one(schedule::build_schedule(o), 1);
  EXPECT_NE(one.step(m).find("\"step 3\""), std::string::npos);
  pp::ChromeTrace two(schedule::build_schedule(o), 2);
  try {
    two.step(m);
    ADD_FAILURE() << "a step of one replica was traced as two";
  } catch (const PipelineError& e) {
    EXPECT_STREQ(e.what(),
                 "trace: step 3 holds the timelines of 1 replicas, not of 2 (replica 0's last "
                 "stage's rank has them, with PipelineOptions::trace_replicas)");
  }
  m.replica_timelines.push_back({m.rank_timelines, m.rank_spans, {1.0}, {0.0}});
  EXPECT_THROW(two.step(m), PipelineError) << "replica 1 holds one rank's step time of 2";
  m.replica_timelines.back().step_ms.push_back(2.0);
  m.replica_timelines.back().clock_start_us.push_back(0.0);
  const std::string text = two.step(m);
  EXPECT_NE(text.find("\"pid\":3,\"tid\":3"), std::string::npos)
      << "replica 1's rank 1: job rank 3";
  EXPECT_THROW(pp::ChromeTrace(schedule::build_schedule(o), 0), PipelineError);
}

}  // namespace
}  // namespace pipemat::train
