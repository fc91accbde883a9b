// torch.distributed.pipelining CSV import / export.

#include "pipemat/schedule/torch_csv.h"

#include <gtest/gtest.h>

#include <random>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
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

// torch's FSDP cells as torch writes them (_Action(stage, UNSHARD/RESHARD/REDUCE_GRAD, None)):
// UNSHARD before the first compute of a stage, REDUCE_GRAD after its last backward, RESHARD
// last.
std::string with_fsdp_cells(const std::string& csv) {
  std::string out;
  int rank = 0;
  for (const std::string& row : split(csv, '\n')) {
    if (row.empty()) continue;
    const std::string stage = std::to_string(rank++);
    out += stage + "UNSHARD," + row + "," + stage + "REDUCE_GRAD," + stage + "RESHARD\n";
  }
  return out;
}

TEST(ScheduleTorchCsvTest, FsdpCellsAreNoOpsReportedOnce) {
  const std::string plain = "0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n";
  const std::string fsdp =
      "0UNSHARD,0F0,0F1,,0B0,0B1,0REDUCE_GRAD,0RESHARD\n"
      "1UNSHARD,,1F0,1B0,1F1,1B1,1REDUCE_GRAD,1RESHARD\n";
  ASSERT_EQ(with_fsdp_cells(plain), fsdp);
  const TorchCsvImport got = import_torch_csv_report(fsdp, "fsdp.csv");
  expect_same_schedule(got.schedule, import_torch_csv(plain), "hand-written 1F1B");
  EXPECT_EQ(got.unshard, 2);
  EXPECT_EQ(got.reshard, 2);
  EXPECT_EQ(got.reduce_grad, 2);
  EXPECT_EQ(got.note,
            "ignored 2 UNSHARD, 2 RESHARD and 2 REDUCE_GRAD cells of fsdp.csv: pipemat does not "
            "shard, and all-reduces a stage's gradients after its "
            "last backward by itself (parallel.data), so they are no-ops");
  // The plain entry point drops them the same way.
  expect_same_schedule(import_torch_csv(fsdp), import_torch_csv(plain), "import_torch_csv");

  // A generated 2-rank 1F1B with comms (SEND_*/RECV_*), exported the way torch writes it.
  const Schedule lowered = build_schedule(options(ScheduleKind::kOneFOneB, 2, 4));
  const TorchCsvImport generated =
      import_torch_csv_report(with_fsdp_cells(export_torch_csv(lowered)));
  expect_same_schedule(generated.schedule, lowered, "generated 1F1B with comms");
  EXPECT_EQ(export_torch_csv(generated.schedule), export_torch_csv(lowered));
  EXPECT_EQ(generated.note,
            "ignored 2 UNSHARD, 2 RESHARD and 2 REDUCE_GRAD cells of <csv>: pipemat does not "
            "shard, and all-reduces a stage's gradients after its "
            "last backward by itself (parallel.data), so they are no-ops");
}

TEST(ScheduleTorchCsvTest, FsdpNoteCountsOnlyWhatIsThere) {
  const TorchCsvImport none = import_torch_csv_report("0F0,0B0\n", "none.csv");
  EXPECT_EQ(none.unshard + none.reshard + none.reduce_grad, 0);
  EXPECT_EQ(none.note, "");

  const TorchCsvImport one = import_torch_csv_report("0F0,0B0,0REDUCE_GRAD\n", "one.csv");
  EXPECT_EQ(one.reduce_grad, 1);
  EXPECT_EQ(one.note,
            "ignored 1 REDUCE_GRAD cell of one.csv: pipemat does not shard, and all-reduces a "
            "stage's gradients after its last backward by itself (parallel.data), so it is a "
            "no-op");

  // torch's parser also takes a micro-batch on these cells (`(\d+)(UNSHARD|...)(\d*)`); spaces
  // and quotes as in any cell.
  const TorchCsvImport two =
      import_torch_csv_report(" 0UNSHARD3 ,0F0,0B0,\"0UNSHARD\",0RESHARD0\n", "two.csv");
  EXPECT_EQ(two.unshard, 2);
  EXPECT_EQ(two.reshard, 1);
  EXPECT_EQ(two.reduce_grad, 0);
  EXPECT_EQ(format_actions(two.schedule.actions[0]), (std::vector<std::string>{"0F0", "0B0"}));
  EXPECT_EQ(two.note,
            "ignored 2 UNSHARD and 1 RESHARD cells of two.csv: pipemat does not shard, and "
            "all-reduces a stage's "
            "gradients after its last backward by itself (parallel.data), so they are no-ops");
}

TEST(ScheduleTorchCsvTest, MalformedFsdpCellsNameRowAndColumn) {
  const struct {
    std::string cell;
    std::string phrase;
  } cases[] = {
      {"1UNSHARDx", "unexpected text 'x' after UNSHARD"},
      {"1RESHARD0B", "unexpected text 'B' after RESHARD"},
      {"1REDUCE_GRAD2 3", "unexpected text ' 3' after REDUCE_GRAD"},
      {"1UNSHARD12345678901", "a number is larger than 1000000000"},
      {"12345678901RESHARD", "a number is larger than 1000000000"},
      {"1UNSHARD_X", "unknown action type 'UNSHARD_X'"},
      {"1unshard", "unknown action type ''"},
      {"1SHARD", "unknown action type 'SHARD'"},
      {"1OVERLAP_F_B", "unknown action type 'OVERLAP_F_B'"},
      {"UNSHARD", "it does not start with a stage number"},
  };
  for (const auto& c : cases) {
    try {
      import_torch_csv_report("0F0,0B0\n1F0," + c.cell + ",1B0\n", "bad.csv");
      ADD_FAILURE() << c.cell << " was accepted";
    } catch (const ScheduleError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("bad.csv: row 2 (rank 1), column 2: cannot parse action"),
                std::string::npos)
          << c.cell << ": " << msg;
      EXPECT_NE(msg.find(c.phrase), std::string::npos) << c.cell << ": " << msg;
    }
  }
}

}  // namespace
}  // namespace pipemat::schedule

namespace pipemat::schedule {
namespace {

TEST(ScheduleTorchCsvTest, FsdpLikeGarbageIsAScheduleErrorNeverACrash) {
  std::mt19937 rng(11);
  const std::vector<std::string> tokens = {"0",           "1",  "99999999999", "UNSHARD", "RESHARD",
                                           "REDUCE_GRAD", "F",  "B",           "x",       "_",
                                           ",",           "\n", " ",           "\""};
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    const int length = static_cast<int>(rng() % 16);
    for (int k = 0; k < length; ++k) text += tokens[rng() % tokens.size()];
    try {
      import_torch_csv_report(text, "fuzz.csv");
    } catch (const ScheduleError& e) {
      EXPECT_NE(std::string(e.what()).find("fuzz.csv"), std::string::npos) << e.what();
    }
  }
}

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
