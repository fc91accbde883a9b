#pragma once
// torch.distributed.pipelining CSV schedules: one row per rank, one action string per cell
// (`0F0,0F1,0B0,...`). Empty cells are torch's idle slots (None) and are skipped on import.
// Both torch forms are read and written: compute-only (F, B, I, W) and with comms (SEND_F,
// RECV_F, SEND_B, RECV_B); pipemat's R actions are kept as well.
//
// torch's FSDP / data-parallel cells `<stage>UNSHARD`, `<stage>RESHARD` and `<stage>REDUCE_GRAD`
// (torch writes them without a micro-batch; its parser also accepts one, e.g. `0UNSHARD3`, and so
// does this one) are accepted on import and dropped: pipemat has no sharding or data
// parallelism, so they are no-ops. import_torch_csv_report counts them and says so once.
//
// Thread safety: pure functions.

#include <cstdint>
#include <string>

#include "pipemat/schedule/schedule.h"

namespace pipemat::schedule {

struct TorchCsvOptions {
  bool with_comms = true;  // write SEND_*/RECV_* actions when the schedule has them
};

// One line per rank, cells joined by ',', ending with '\n'.
std::string export_torch_csv(const Schedule& schedule, const TorchCsvOptions& options = {});

// Reads the CSV text. Ranks = rows, stages = largest stage + 1, micro-batches = largest
// micro-batch + 1; the stage-to-rank map comes from which row holds each stage (kLoop or kV
// when it matches one, else kCustom); recompute is kPretrigger when R actions are present.
// The result goes through validate_schedule. ScheduleError naming row and column for a cell
// that does not parse, a stage held by two rows (naming both) or a schedule the validator
// rejects. `source` names the input in messages (e.g. the file path).
// FSDP cells are dropped as by import_torch_csv_report.
Schedule import_torch_csv(const std::string& text, const std::string& source = "<csv>");

// The result of import_torch_csv_report: the schedule and what was dropped on the way.
struct TorchCsvImport {
  Schedule schedule;
  int64_t unshard = 0;  // cells accepted as no-ops
  int64_t reshard = 0;
  int64_t reduce_grad = 0;
  // "" when there were none, else one sentence such as "ignored 4 UNSHARD, 4 RESHARD and 2
  // REDUCE_GRAD cells of <source>: pipemat has no sharding or data parallelism, so they are
  // no-ops". Meant to be shown to the user once (the import itself prints nothing).
  std::string note;
};

// Like import_torch_csv (same errors), and also reports the UNSHARD / RESHARD / REDUCE_GRAD cells
// it dropped. The schedule equals the one imported from the same CSV without those cells.
// A cell that starts like one of them but does not match `<stage><WORD>[<micro_batch>]` exactly
// (e.g. `0UNSHARDx`) is a ScheduleError naming row and column.
TorchCsvImport import_torch_csv_report(const std::string& text,
                                       const std::string& source = "<csv>");

}  // namespace pipemat::schedule
