#include "pipemat/schedule/torch_csv.h"

#include <algorithm>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::schedule {

std::string export_torch_csv(const Schedule& schedule, const TorchCsvOptions& options) {
  std::string out;
  for (int r = 0; r < schedule.ranks_count; ++r) {
    std::vector<std::string> cells;
    for (const Action& a : schedule.actions[r]) {
      if (options.with_comms || is_compute(a.type)) cells.push_back(format_action(a));
    }
    out += join(cells, ",") + "\n";
  }
  return out;
}

Schedule import_torch_csv(const std::string& text, const std::string& source) {
  std::vector<std::string> lines = split(text, '\n');
  for (auto& line : lines) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
  }
  while (!lines.empty() && lines.back().find_first_not_of(" \t,") == std::string::npos) {
    lines.pop_back();
  }
  PIPEMAT_CHECK(!lines.empty(), ScheduleError, source,
                ": the CSV has no rows; expected one row of action strings per rank "
                "(e.g. `0F0,0F1,0B0,0B1`).");
  Schedule s;
  s.kind = ScheduleKind::kImported;
  s.ranks_count = static_cast<int>(lines.size());
  s.actions.resize(lines.size());
  int max_stage = -1, max_mb = -1;
  bool has_r = false;
  for (size_t row = 0; row < lines.size(); ++row) {
    const std::vector<std::string> cells = split(lines[row], ',');
    for (size_t col = 0; col < cells.size(); ++col) {
      std::string cell = cells[col];
      cell.erase(std::remove(cell.begin(), cell.end(), '"'), cell.end());
      if (cell.find_first_not_of(" \t") == std::string::npos) continue;  // idle slot
      Action a;
      try {
        a = parse_action(cell);
      } catch (const ScheduleError& e) {
        PIPEMAT_THROW(ScheduleError, source, ": row ", row + 1, " (rank ", row, "), column ",
                      col + 1, ": ", e.what());
      }
      s.actions[row].push_back(a);
      max_stage = std::max(max_stage, a.stage);
      max_mb = std::max(max_mb, a.micro_batch);
      has_r = has_r || a.type == ActionType::kRecompute;
    }
  }
  PIPEMAT_CHECK(max_stage >= 0, ScheduleError, source, ": the CSV holds no actions.");
  PIPEMAT_CHECK(static_cast<long long>(max_stage + 1) * (max_mb + 1) <= kMaxStageMicroBatches,
                ScheduleError, source, ": stage ", max_stage, " and micro-batch ", max_mb,
                " make more than the ", kMaxStageMicroBatches,
                " (stage, micro-batch) pairs pipemat handles; check the numbers in the file.");
  s.stages_count = max_stage + 1;
  s.micro_batches = max_mb + 1;
  s.stage_to_rank.assign(s.stages_count, -1);
  for (int r = 0; r < s.ranks_count; ++r) {
    for (const Action& a : s.actions[r]) {
      int& owner = s.stage_to_rank[a.stage];
      PIPEMAT_CHECK(owner == -1 || owner == r, ScheduleError, source,
                    ": rule 'stage-to-rank consistency' broken: stage ", a.stage,
                    " appears on rank ", owner, " and on rank ", r, " (action ", format_action(a),
                    "). A stage lives on exactly one rank.");
      owner = r;
    }
  }
  for (int st = 0; st < s.stages_count; ++st) {
    PIPEMAT_CHECK(s.stage_to_rank[st] != -1, ScheduleError, source, ": stage ", st,
                  " has no actions on any rank, but stages 0..", max_stage,
                  " are used; every stage needs its F and backward for each micro-batch.");
  }
  s.virtual_stages = std::max(1, s.stages_count / s.ranks_count);
  if (s.stage_to_rank == loop_stage_to_rank(s.ranks_count, s.stages_count)) {
    s.layout = StageLayout::kLoop;
  } else if (s.stages_count == 2 * s.ranks_count &&
             s.stage_to_rank == v_stage_to_rank(s.ranks_count)) {
    s.layout = StageLayout::kV;
  } else {
    s.layout = StageLayout::kCustom;
  }
  s.recompute = has_r ? RecomputeMode::kPretrigger : RecomputeMode::kNone;
  try {
    validate_schedule(s);
  } catch (const ScheduleError& e) {
    PIPEMAT_THROW(ScheduleError, source, ": ", e.what());
  }
  return s;
}

}  // namespace pipemat::schedule
