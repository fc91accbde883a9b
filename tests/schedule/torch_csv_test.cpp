// torch.distributed.pipelining CSV import / export.

#include "pipemat/schedule/torch_csv.h"

#include <gtest/gtest.h>

#include <random>

#include "pipemat/core/error.h"
#include "test_util.h"

namespace pipemat::schedule {
namespace {

using testing::options;

void expect_same_schedule(const Schedule& a, const Schedule& b, const std::string& where) {
  EXPECT_EQ(a.actions, b.actions) << where;
  EXPECT_EQ(a.stage_to_rank, b.stage_to_rank) << where;
  EXPECT_EQ(a.ranks_count, b.ranks_count) << where;
  EXPECT_EQ(a.stages_count, b.stages_count) << where;
  EXPECT_EQ(a.micro_batches, b.micro_batches) << where;
  EXPECT_EQ(a.virtual_stages, b.virtual_stages) << where;
  EXPECT_EQ(a.layout, b.layout) << where;
}

TEST(ScheduleTorchCsvTest, RoundTripIsLossless) {
  const struct {
    ScheduleKind kind;
    int p, m, v;
  } cases[] = {{ScheduleKind::kGPipe, 4, 8, 1},        {ScheduleKind::kOneFOneB, 4, 8, 1},
               {ScheduleKind::kInterleaved, 4, 8, 2},  {ScheduleKind::kInterleaved, 3, 6, 4},
               {ScheduleKind::kZeroBubbleH1, 4, 8, 1}, {ScheduleKind::kZeroBubbleH2, 3, 7, 1},
               {ScheduleKind::kZeroBubbleV, 4, 8, 1},  {ScheduleKind::kZeroBubbleV, 3, 2, 1}};
  for (const auto& c : cases) {
    for (RecomputeMode mode : {RecomputeMode::kNone, RecomputeMode::kPretrigger}) {
      const std::string where = std::string(to_string(c.kind)) + " " + to_string(mode);
      const Schedule lowered = build_schedule(options(c.kind, c.p, c.m, c.v, mode));
      // With comms.
      const std::string with = export_torch_csv(lowered);
      const Schedule back = import_torch_csv(with);
      expect_same_schedule(back, lowered, where + " with comms");
      EXPECT_EQ(back.recompute, mode);
      EXPECT_EQ(export_torch_csv(back), with);
      // Compute-only.
      const std::string compute = export_torch_csv(lowered, TorchCsvOptions{false});
      const Schedule back_compute = import_torch_csv(compute);
      expect_same_schedule(back_compute, strip_communication(lowered), where + " compute-only");
      EXPECT_EQ(export_torch_csv(back_compute), compute);
      EXPECT_EQ(lower_communication(back_compute).actions, lowered.actions) << where;
    }
  }
}

TEST(ScheduleTorchCsvTest, ReadsTorchIdleCellsQuotesAndCrLf) {
  const std::string text = "0F0,0F1,,0B0,0B1\r\n,\"1F0\",1B0,1F1,1B1\r\n\r\n";
  const Schedule s = import_torch_csv(text, "two.csv");
  EXPECT_EQ(s.ranks_count, 2);
  EXPECT_EQ(s.stages_count, 2);
  EXPECT_EQ(s.micro_batches, 2);
  EXPECT_EQ(s.kind, ScheduleKind::kImported);
  EXPECT_EQ(format_actions(s.actions[1]), (std::vector<std::string>{"1F0", "1B0", "1F1", "1B1"}));
  EXPECT_EQ(s.layout, StageLayout::kLoop);
}

TEST(ScheduleTorchCsvTest, InfersTheVLayout) {
  const Schedule v = build_schedule(options(ScheduleKind::kZeroBubbleV, 3, 6));
  const Schedule back = import_torch_csv(export_torch_csv(v));
  EXPECT_EQ(back.layout, StageLayout::kV);
  EXPECT_EQ(back.virtual_stages, 2);
}

TEST(ScheduleTorchCsvTest, BadCellNamesRowAndColumn) {
  try {
    import_torch_csv("0F0,0B0\n1F0,1X0\n", "bad.csv");
    FAIL();
  } catch (const ScheduleError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.csv: row 2 (rank 1), column 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unknown action type 'X'"), std::string::npos) << msg;
  }
}

TEST(ScheduleTorchCsvTest, StageOnTwoRanksIsRejectedNamingBoth) {
  try {
    import_torch_csv("0F0,0B0,1F0\n1B0\n", "dup.csv");
    FAIL();
  } catch (const ScheduleError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("stage-to-rank consistency"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 0 and on rank 1"), std::string::npos) << msg;
  }
}

TEST(ScheduleTorchCsvTest, ImportedSchedulesGoThroughTheValidator) {
  try {
    import_torch_csv("0F0,0W0,0I0\n", "order.csv");
    FAIL();
  } catch (const ScheduleError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("order.csv"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rule 'I before W'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("action 0W0"), std::string::npos) << msg;
  }
  EXPECT_THROW(import_torch_csv("\n\n", "empty.csv"), ScheduleError);
  EXPECT_THROW(import_torch_csv("0F0,0B0\n2F0,2B0\n", "gap.csv"), ScheduleError);  // no stage 1
}

}  // namespace
}  // namespace pipemat::schedule

namespace pipemat::schedule {
namespace {

TEST(ScheduleTorchCsvTest, GarbageIsAScheduleErrorNeverACrash) {
  std::mt19937 rng(7);
  const std::string alphabet = "0123456789FBIWRSEND_RCV,\n \"x-";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    const int length = static_cast<int>(rng() % 40);
    for (int k = 0; k < length; ++k) text += alphabet[rng() % alphabet.size()];
    try {
      import_torch_csv(text, "fuzz.csv");
    } catch (const ScheduleError& e) {
      EXPECT_NE(std::string(e.what()).find("fuzz.csv"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace pipemat::schedule
