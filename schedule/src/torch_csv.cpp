#include "pipemat/schedule/torch_csv.h"

#include <algorithm>
#include <cctype>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"

namespace pipemat::schedule {
namespace {

// torch's FSDP / data-parallel actions (torch.distributed.pipelining _ComputationType UNSHARD,
// RESHARD, REDUCE_GRAD). torch creates them with microbatch_index None, so `_Action.__repr__`
// writes `0UNSHARD`; `_Action.from_str` reads `(\d+)(...)(\d*)` and so would also take
// `0UNSHARD3`.
enum class FsdpCell { kNone, kUnshard, kReshard, kReduceGrad };

// The run of decimal digits at text[pos...] (advancing pos); "" when there is none.
std::string read_digits(const std::string& text, size_t& pos) {
  const size_t start = pos;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  return text.substr(start, pos - start);
}

// The bound of parse_action: numbers up to 1e9.
bool in_range(const std::string& digits) {
  const size_t first = std::min(digits.find_first_not_of('0'), digits.size());
  return digits.size() - first < 10 || digits.substr(first) == "1000000000";
}

// kNone when `raw` is not `<stage>UNSHARD|RESHARD|REDUCE_GRAD...` (parse_action then decides);
// ScheduleError when it is one of these words with a bad number or text after it.
FsdpCell classify_fsdp_cell(const std::string& raw) {
  const size_t begin = raw.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return FsdpCell::kNone;
  const size_t end = raw.find_last_not_of(" \t\r\n");
  const std::string text = raw.substr(begin, end - begin + 1);
  size_t pos = 0;
  const std::string stage = read_digits(text, pos);
  if (stage.empty()) return FsdpCell::kNone;
  const size_t word_begin = pos;
  while (pos < text.size() &&
         (std::isupper(static_cast<unsigned char>(text[pos])) || text[pos] == '_')) {
    ++pos;
  }
  const std::string word = text.substr(word_begin, pos - word_begin);
  FsdpCell kind = FsdpCell::kNone;
  if (word == "UNSHARD") kind = FsdpCell::kUnshard;
  if (word == "RESHARD") kind = FsdpCell::kReshard;
  if (word == "REDUCE_GRAD") kind = FsdpCell::kReduceGrad;
  if (kind == FsdpCell::kNone) return kind;
  const char* expected =
      ". torch writes these FSDP cells as <stage>UNSHARD, <stage>RESHARD or <stage>REDUCE_GRAD "
      "(e.g. 0UNSHARD), optionally followed by a micro-batch number";
  const std::string micro_batch = read_digits(text, pos);
  PIPEMAT_CHECK(pos == text.size(), ScheduleError, "cannot parse action '", text,
                "': unexpected text '", text.substr(pos), "' after ", word, expected);
  PIPEMAT_CHECK(in_range(stage) && in_range(micro_batch), ScheduleError, "cannot parse action '",
                text, "': a number is larger than 1000000000", expected);
  return kind;
}

// "4 UNSHARD", "4 UNSHARD and 2 REDUCE_GRAD", "4 UNSHARD, 4 RESHARD and 2 REDUCE_GRAD".
std::string fsdp_note(const TorchCsvImport& import, const std::string& source) {
  std::vector<std::string> parts;
  if (import.unshard > 0) parts.push_back(std::to_string(import.unshard) + " UNSHARD");
  if (import.reshard > 0) parts.push_back(std::to_string(import.reshard) + " RESHARD");
  if (import.reduce_grad > 0) parts.push_back(std::to_string(import.reduce_grad) + " REDUCE_GRAD");
  if (parts.empty()) return "";
  std::string list = parts.back();
  if (parts.size() > 1) {
    parts.pop_back();
    list = join(parts, ", ") + " and " + list;
  }
  const bool one = import.unshard + import.reshard + import.reduce_grad == 1;
  return "ignored " + list + (one ? " cell" : " cells") + " of " + source +
         ": pipemat does not shard, and all-reduces a stage's gradients after its last "
         "backward by itself (parallel.data), so " +
         (one ? "it is a no-op" : "they are no-ops");
}

}  // namespace

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
  return import_torch_csv_report(text, source).schedule;
}

namespace {

// The rows of the CSV without line-end '\r' and without trailing empty rows; at least one.
std::vector<std::string> csv_rows(const std::string& text, const std::string& source) {
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
  return lines;
}

// The largest stage and micro-batch the cells name, and whether any is an R.
struct CsvExtent {
  int max_stage = -1, max_mb = -1;
  bool has_r = false;
};

// Parses the cells of every row into the actions of its rank, counting the FSDP cells it skips.
CsvExtent read_cells(const std::vector<std::string>& lines, const std::string& source,
                     TorchCsvImport& import) {
  CsvExtent extent;
  for (size_t row = 0; row < lines.size(); ++row) {
    const std::vector<std::string> cells = split(lines[row], ',');
    for (size_t col = 0; col < cells.size(); ++col) {
      std::string cell = cells[col];
      cell.erase(std::remove(cell.begin(), cell.end(), '"'), cell.end());
      if (cell.find_first_not_of(" \t") == std::string::npos) continue;  // idle slot
      Action a;
      try {
        const FsdpCell fsdp = classify_fsdp_cell(cell);
        if (fsdp == FsdpCell::kUnshard) ++import.unshard;
        if (fsdp == FsdpCell::kReshard) ++import.reshard;
        if (fsdp == FsdpCell::kReduceGrad) ++import.reduce_grad;
        if (fsdp != FsdpCell::kNone) continue;  // a no-op here (see torch_csv.h)
        a = parse_action(cell);
      } catch (const ScheduleError& e) {
        PIPEMAT_THROW(ScheduleError, source, ": row ", row + 1, " (rank ", row, "), column ",
                      col + 1, ": ", e.what());
      }
      import.schedule.actions[row].push_back(a);
      extent.max_stage = std::max(extent.max_stage, a.stage);
      extent.max_mb = std::max(extent.max_mb, a.micro_batch);
      extent.has_r = extent.has_r || a.type == ActionType::kRecompute;
    }
  }
  return extent;
}

// The counts and the stage-to-rank map the actions imply; every stage on exactly one rank.
void assign_stage_owners(Schedule& s, const CsvExtent& extent, const std::string& source) {
  const int max_stage = extent.max_stage, max_mb = extent.max_mb;
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
}

StageLayout detect_layout(const Schedule& s) {
  if (s.stage_to_rank == loop_stage_to_rank(s.ranks_count, s.stages_count)) {
    return StageLayout::kLoop;
  }
  if (s.stages_count == 2 * s.ranks_count && s.stage_to_rank == v_stage_to_rank(s.ranks_count)) {
    return StageLayout::kV;
  }
  return StageLayout::kCustom;
}

}  // namespace

TorchCsvImport import_torch_csv_report(const std::string& text, const std::string& source) {
  TorchCsvImport import;
  const std::vector<std::string> lines = csv_rows(text, source);
  Schedule& s = import.schedule;
  s.kind = ScheduleKind::kImported;
  s.ranks_count = static_cast<int>(lines.size());
  s.actions.resize(lines.size());
  const CsvExtent extent = read_cells(lines, source, import);
  assign_stage_owners(s, extent, source);
  s.virtual_stages = std::max(1, s.stages_count / s.ranks_count);
  s.layout = detect_layout(s);
  s.recompute = extent.has_r ? RecomputeMode::kPretrigger : RecomputeMode::kNone;
  try {
    validate_schedule(s);
  } catch (const ScheduleError& e) {
    PIPEMAT_THROW(ScheduleError, source, ": ", e.what());
  }
  import.note = fsdp_note(import, source);
  return import;
}

}  // namespace pipemat::schedule
