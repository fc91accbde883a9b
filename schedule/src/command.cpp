#include "pipemat/schedule/command.h"

#include <fstream>
#include <optional>
#include <sstream>

#include "pipemat/core/error.h"
#include "pipemat/core/files.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"
#include "pipemat/schedule/torch_csv.h"

namespace pipemat::schedule {
namespace {

Schedule import_file(const ScheduleCommandOptions& o, RecomputeMode recompute) {
  // The path of a torch.distributed.pipelining CSV schedule (one row of actions per rank).
  Schedule s = import_torch_csv(read_regular_file(o.import_path, "--import"), o.import_path);
  PIPEMAT_CHECK(o.ranks == 0 || o.ranks == s.ranks_count, ConfigError, "--ranks ", o.ranks,
                " does not match --import ", o.import_path, ", which has ", s.ranks_count,
                " ranks (rows); drop --ranks or fix the file.");
  PIPEMAT_CHECK(o.micro_batches == 0 || o.micro_batches == s.micro_batches, ConfigError,
                "--micro-batches ", o.micro_batches, " does not match --import ", o.import_path,
                ", which uses ", s.micro_batches,
                " micro-batches; drop --micro-batches or fix the file.");
  PIPEMAT_CHECK(o.virtual_stages == 1 || o.virtual_stages == s.virtual_stages, ConfigError,
                "--virtual ", o.virtual_stages, " does not match --import ", o.import_path,
                ", which has ", s.virtual_stages, " stages per rank; drop --virtual.");
  // A CSV without R actions takes the requested placement; one with R actions is pretrigger.
  if (s.recompute == RecomputeMode::kNone) s = insert_recompute(std::move(s), recompute);
  s = lower_communication(s);
  validate_schedule(s);
  return s;
}

}  // namespace

int parse_int_flag(const std::string& flag, const std::string& text) {
  size_t used = 0;
  long value = 0;
  bool ok = !text.empty();
  try {
    value = ok ? std::stol(text, &used) : 0;
  } catch (const std::exception&) {
    ok = false;
  }
  ok = ok && used == text.size() && value >= -1000000000L && value <= 1000000000L;
  PIPEMAT_CHECK(ok, ConfigError, flag, " '", text, "' is not a whole number; e.g. ", flag, " 4.");
  return static_cast<int>(value);
}

const char* to_string(OutputFormat format) {
  switch (format) {
    case OutputFormat::kText:
      return "text";
    case OutputFormat::kCsv:
      return "csv";
    case OutputFormat::kJson:
      return "json";
    case OutputFormat::kSvg:
      return "svg";
  }
  return "?";
}

std::optional<OutputFormat> parse_output_format(const std::string& text) {
  for (OutputFormat format : output_format_values()) {
    if (text == to_string(format)) return format;
  }
  return std::nullopt;
}

const std::vector<OutputFormat>& output_format_values() {
  static const std::vector<OutputFormat> kValues = {OutputFormat::kText, OutputFormat::kCsv,
                                                    OutputFormat::kJson, OutputFormat::kSvg};
  return kValues;
}

std::string render_schedule_command(const ScheduleCommandOptions& o) {
  const RecomputeMode recompute = parse_recompute_mode(o.recompute);
  const CostModel costs = parse_costs(o.costs);
  const std::optional<OutputFormat> format = parse_output_format(o.format);
  PIPEMAT_CHECK(format.has_value(), ConfigError, "--format '", o.format,
                "' is unknown; expected text, csv, json or svg.");
  Schedule schedule;
  if (!o.import_path.empty()) {
    PIPEMAT_CHECK(o.kind.empty(), ConfigError, "--kind ", o.kind, " and --import ", o.import_path,
                  " exclude each other: the imported file already fixes the schedule. Drop one.");
    schedule = import_file(o, recompute);
  } else {
    PIPEMAT_CHECK(!o.kind.empty(), ConfigError,
                  "--kind is required (gpipe, 1f1b, interleaved, zb-h1, zb-h2 or zb-v), or give "
                  "--import FILE.csv.");
    PIPEMAT_CHECK(o.ranks >= 1, ConfigError,
                  "--ranks (number of pipeline ranks) must be >= 1, found ", o.ranks,
                  "; e.g. --ranks 4.");
    PIPEMAT_CHECK(o.micro_batches >= 1, ConfigError, "--micro-batches must be >= 1, found ",
                  o.micro_batches, "; e.g. --micro-batches 8.");
    ScheduleOptions options;
    options.kind = parse_schedule_kind(o.kind);
    options.ranks = o.ranks;
    options.micro_batches = o.micro_batches;
    options.virtual_stages = o.virtual_stages;
    options.recompute = recompute;
    schedule = build_schedule(options);
  }
  const SimulationResult sim = simulate(schedule, costs);
  RenderOptions render;
  render.with_comms = o.with_comms;
  render.costs_label = format_costs(costs, schedule.recompute);
  switch (*format) {
    case OutputFormat::kCsv:
      return render_csv(schedule, render);
    case OutputFormat::kJson:
      return render_json(schedule, sim, render);
    case OutputFormat::kSvg:
      return render_svg(schedule, sim, render);
    case OutputFormat::kText:
      break;
  }
  return render_text(schedule, sim, render);
}

void run_schedule_command(const ScheduleCommandOptions& options, std::ostream& out) {
  const std::string document = render_schedule_command(options);
  if (options.output.empty()) {
    out << document;
    return;
  }
  std::ofstream file(options.output, std::ios::binary | std::ios::trunc);
  PIPEMAT_CHECK(file.good(), ConfigError, "--output ", options.output,
                ": cannot open the file for writing; check that the directory exists and is "
                "writable.");
  file << document;
  file.close();
  PIPEMAT_CHECK(!file.fail(), ConfigError, "--output ", options.output, ": writing failed.");
}

}  // namespace pipemat::schedule
