#pragma once
// The library side of `pipemat schedule`: options as the CLI spells them -> schedule -> simulate
// -> render. The CLI maps flags onto ScheduleCommandOptions and calls run_schedule_command;
// tests call render_schedule_command directly.
//
// Errors: ConfigError for flag values (naming the flag), ScheduleError for schedules that
// cannot run (invalid imports, deadlocks). Thread safety: no shared state.

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace pipemat::schedule {

// The document a command renders. to_string gives the `--format` spelling; parse_output_format
// the value of a spelling, or nullopt for any other text (the command names the flag in its
// error); output_format_values() every value in the order help texts list them.
enum class OutputFormat { kText, kCsv, kJson, kSvg };  // text | csv (torch CSV) | json | svg
const char* to_string(OutputFormat format);
std::optional<OutputFormat> parse_output_format(const std::string& text);
const std::vector<OutputFormat>& output_format_values();

struct ScheduleCommandOptions {
  std::string kind;        // gpipe|1f1b|interleaved|zb-h1|zb-h2|zb-v; unused with import_path
  int ranks = 0;           // pipeline ranks P (required without import_path)
  int micro_batches = 0;   // M (required without import_path)
  int virtual_stages = 1;  // V, chunks per rank (interleaved)
  std::string recompute = "none";  // none|lazy|pretrigger
  std::string costs;               // "F=1,I=1,W=1,B=2,R=1,comm=0", any subset
  std::string import_path;         // torch CSV to read instead of generating
  std::string format = "text";     // an OutputFormat spelling: text|csv|json|svg
  std::string output;       // file to write; empty = the stream given to run_schedule_command
  bool with_comms = false;  // list SEND/RECV actions in text, csv and json
};

// The integer value of a flag ("--ranks", "8"). ConfigError naming the flag and the text when it
// is not a whole number (the CLI takes integers as text so that a typo is a pipemat error with
// exit code 1, like every other bad value).
int parse_int_flag(const std::string& flag, const std::string& text);

// Builds (or imports), validates, lowers, simulates and renders; returns the document.
std::string render_schedule_command(const ScheduleCommandOptions& options);

// render_schedule_command, then writes the document to options.output (ConfigError when the
// file cannot be written) or to `out`.
void run_schedule_command(const ScheduleCommandOptions& options, std::ostream& out);

}  // namespace pipemat::schedule
