#pragma once
// torch.distributed.pipelining CSV schedules: one row per rank, one action string per cell
// (`0F0,0F1,0B0,...`). Empty cells are torch's idle slots (None) and are skipped on import.
// Both torch forms are read and written: compute-only (F, B, I, W) and with comms (SEND_F,
// RECV_F, SEND_B, RECV_B); pipemat's R actions are kept as well.
//
// Thread safety: pure functions.

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
Schedule import_torch_csv(const std::string& text, const std::string& source = "<csv>");

}  // namespace pipemat::schedule
