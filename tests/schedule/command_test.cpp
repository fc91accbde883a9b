// The library entry of `pipemat schedule`: formats, JSON shape, errors, import.

#include "pipemat/schedule/command.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/schedule/render.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/simulate.h"

namespace pipemat::schedule {
namespace {

ScheduleCommandOptions cli(const std::string& kind, int p, int m, const std::string& format) {
  ScheduleCommandOptions o;
  o.kind = kind;
  o.ranks = p;
  o.micro_batches = m;
  o.format = format;
  return o;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "pipemat_schedule_" + std::to_string(::getpid()) + "_" + name;
}

TEST(ScheduleCommandTest, JsonHasTheDocumentedKeys) {
  ScheduleCommandOptions o = cli("interleaved", 4, 8, "json");
  o.virtual_stages = 2;
  const auto j = nlohmann::json::parse(render_schedule_command(o));
  for (const char* key : {"kind", "stages", "ranks_count", "micro_batches", "virtual", "makespan",
                          "bubble_ratio", "ranks"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["kind"], "interleaved");
  EXPECT_EQ(j["stages"], 8);  // model stages: 4 ranks x 2 chunks
  EXPECT_EQ(j["ranks_count"], 4);
  EXPECT_EQ(j["micro_batches"], 8);
  EXPECT_EQ(j["virtual"], 2);
  ASSERT_EQ(j["ranks"].size(), 4u);
  double busy = 0;
  for (int r = 0; r < 4; ++r) {
    const auto& rank = j["ranks"][r];
    for (const char* key : {"rank", "actions", "busy", "peak_activations"}) {
      EXPECT_TRUE(rank.contains(key)) << key;
    }
    EXPECT_EQ(rank["rank"], r);
    EXPECT_EQ(rank["actions"].size(), 2u * 2 * 8);  // 2 chunks x M x (F, B)
    busy += rank["busy"].get<double>();
  }
  EXPECT_EQ(j["ranks"][0]["actions"][0], "0F0");
  EXPECT_EQ(j["ranks"][0]["peak_activations"], 11);
  const double makespan = j["makespan"].get<double>();
  EXPECT_NEAR(j["bubble_ratio"].get<double>(), 1 - busy / (4 * makespan), 1e-6);
  EXPECT_NEAR(j["bubble_ratio"].get<double>(), 3.0 / 19.0, 1e-6);
}

TEST(ScheduleCommandTest, JsonWithCommsListsTheLoweredActions) {
  ScheduleCommandOptions o = cli("1f1b", 2, 2, "json");
  o.with_comms = true;
  const auto j = nlohmann::json::parse(render_schedule_command(o));
  EXPECT_EQ(j["ranks"][1]["actions"][0], "1RECV_F0");
  EXPECT_EQ(j["kind"], "1f1b");
  EXPECT_EQ(j["virtual"], 1);
}

TEST(ScheduleCommandTest, ZeroBubbleVReportsTwoChunksPerRank) {
  const auto j = nlohmann::json::parse(render_schedule_command(cli("zb-v", 4, 8, "json")));
  EXPECT_EQ(j["virtual"], 2);
  EXPECT_EQ(j["stages"], 8);
  EXPECT_EQ(j["ranks_count"], 4);
  EXPECT_EQ(j["makespan"], 51);
}

TEST(ScheduleCommandTest, TextCsvAndSvg) {
  const std::string text = render_schedule_command(cli("1f1b", 4, 8, "text"));
  EXPECT_NE(text.find("makespan 33, bubble_ratio 0.272727"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 3   .........F0 B0    F1"), std::string::npos) << text;
  EXPECT_NE(text.find("peak_activations 4"), std::string::npos);

  const std::string csv = render_schedule_command(cli("gpipe", 3, 2, "csv"));
  EXPECT_EQ(csv, "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n2F0,2F1,2B0,2B1\n");

  const std::string svg = render_schedule_command(cli("zb-h1", 4, 8, "svg"));
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  size_t blocks = 0;
  for (size_t pos = svg.find("<title>"); pos != std::string::npos;
       pos = svg.find("<title>", pos + 1)) {
    ++blocks;
  }
  EXPECT_EQ(blocks, 4u * 8 * 3);  // one block per compute action
}

// RenderOptions::rank_spans: a bar per rank with a span, named in its title and the legend.
TEST(ScheduleCommandTest, SvgDrawsRankSpans) {
  ScheduleOptions so;
  so.kind = ScheduleKind::kOneFOneB;
  so.ranks = 3;
  so.micro_batches = 3;
  const Schedule s = generate_schedule(so);
  const SimulationResult sim = simulate(s);
  RenderOptions o;
  const std::string plain = render_svg(s, sim, o);
  o.rank_spans = {{2.5, 4}, {0, 0}, {1, 7.25}};
  o.span_label = "all-reduce";
  const std::string svg = render_svg(s, sim, o);
  EXPECT_NE(svg.find("<title>all-reduce [2.5, 4)</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>all-reduce [1, 7.25)</title>"), std::string::npos) << svg;
  const auto count = [](const std::string& text, const std::string& part) {
    size_t n = 0;
    for (size_t pos = text.find(part); pos != std::string::npos; pos = text.find(part, pos + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(count(svg, "<title>all-reduce"), 2u);   // rank 1's is empty
  EXPECT_EQ(count(svg, ">all-reduce</text>"), 1u);  // the legend
  EXPECT_EQ(plain.find("all-reduce"), std::string::npos);
  // A span that ends after the schedule's makespan (15 here) widens the drawn time to hold it.
  const auto width = [](const std::string& text) {
    const size_t at = text.find("width=\"") + 7;
    return std::stoi(text.substr(at, text.find('"', at) - at));
  };
  EXPECT_EQ(width(svg), width(plain));
  o.rank_spans = {{14, 20}};
  EXPECT_GT(width(render_svg(s, sim, o)), width(plain));
}

TEST(ScheduleCommandTest, ImportAndOutputFile) {
  const std::string csv_path = temp_path("in.csv");
  {
    std::ofstream f(csv_path);
    f << "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n";
  }
  ScheduleCommandOptions o;
  o.import_path = csv_path;
  o.format = "json";
  o.output = temp_path("out.json");
  std::ostringstream unused;
  run_schedule_command(o, unused);
  EXPECT_TRUE(unused.str().empty());
  std::ifstream in(o.output);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["kind"], "imported");
  EXPECT_EQ(j["ranks_count"], 2);
  EXPECT_EQ(j["micro_batches"], 2);
  // Recompute applies to compute-only imports.
  o.output.clear();
  o.recompute = "pretrigger";
  o.format = "csv";
  EXPECT_EQ(render_schedule_command(o), "0F0,0F1,0R0,0B0,0R1,0B1\n1F0,1R0,1B0,1F1,1R1,1B1\n");
  std::remove(csv_path.c_str());
  std::remove(temp_path("out.json").c_str());
}

TEST(ScheduleCommandTest, OutputFormatSpellings) {
  const std::vector<std::pair<std::string, OutputFormat>> formats = {{"text", OutputFormat::kText},
                                                                     {"csv", OutputFormat::kCsv},
                                                                     {"json", OutputFormat::kJson},
                                                                     {"svg", OutputFormat::kSvg}};
  ASSERT_EQ(output_format_values().size(), formats.size());
  for (size_t i = 0; i < formats.size(); ++i) {
    const auto& [text, format] = formats[i];
    EXPECT_EQ(output_format_values()[i], format) << text;
    EXPECT_EQ(std::string(to_string(format)), text);
    EXPECT_TRUE(parse_output_format(text) == std::optional<OutputFormat>(format)) << text;
  }
  EXPECT_FALSE(parse_output_format("yaml").has_value());
  EXPECT_FALSE(parse_output_format("Text").has_value());
}

TEST(ScheduleCommandTest, BadInputIsAConfigOrScheduleErrorNamingTheFlag) {
  auto error = [](const ScheduleCommandOptions& o) -> std::string {
    try {
      render_schedule_command(o);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error(cli("zb", 4, 8, "text")).find("--kind 'zb'"), std::string::npos);
  EXPECT_NE(error(cli("", 4, 8, "text")).find("--kind is required"), std::string::npos);
  EXPECT_NE(error(cli("1f1b", 0, 8, "text")).find("--ranks"), std::string::npos);
  EXPECT_NE(error(cli("1f1b", 4, 0, "text")).find("--micro-batches"), std::string::npos);
  EXPECT_NE(error(cli("1f1b", 4, 8, "yaml")).find("--format 'yaml'"), std::string::npos);
  ScheduleCommandOptions costs = cli("1f1b", 4, 8, "text");
  costs.costs = "F=1,Q=2";
  EXPECT_NE(error(costs).find("--costs key 'Q'"), std::string::npos);
  ScheduleCommandOptions recompute = cli("1f1b", 4, 8, "text");
  recompute.recompute = "always";
  EXPECT_NE(error(recompute).find("--recompute 'always'"), std::string::npos);
  ScheduleCommandOptions missing;
  missing.import_path = temp_path("does_not_exist.csv");
  EXPECT_NE(error(missing).find("cannot open"), std::string::npos);
  ScheduleCommandOptions out = cli("1f1b", 2, 2, "text");
  out.output = "/nonexistent-dir/x.txt";
  std::ostringstream unused;
  EXPECT_THROW(run_schedule_command(out, unused), ConfigError);
}

}  // namespace
}  // namespace pipemat::schedule

namespace pipemat::schedule {
namespace {

TEST(ScheduleCommandTest, ImportChecksConflictingFlagsAndAppliesRecompute) {
  const std::string csv_path = temp_path("comms.csv");
  {
    std::ofstream f(csv_path);
    f << "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n";
  }
  ScheduleCommandOptions o;
  o.import_path = csv_path;
  o.format = "csv";
  o.with_comms = true;
  o.recompute = "pretrigger";
  EXPECT_EQ(render_schedule_command(o),
            "0F0,0SEND_F0,0RECV_B0,0R0,0B0\n1RECV_F0,1F0,1R0,1B0,1SEND_B0\n");
  o.kind = "1f1b";
  EXPECT_THROW(render_schedule_command(o), ConfigError);
  o.kind.clear();
  o.ranks = 3;
  EXPECT_THROW(render_schedule_command(o), ConfigError);
  o.ranks = 0;
  o.virtual_stages = 2;
  EXPECT_THROW(render_schedule_command(o), ConfigError);
  std::remove(csv_path.c_str());
}

TEST(ScheduleCommandTest, HugeSizesAreRefusedNotAllocated) {
  EXPECT_THROW(render_schedule_command(cli("1f1b", 1024, 65536, "json")), ConfigError);
  ScheduleCommandOptions o;
  o.import_path = temp_path("huge.csv");
  {
    std::ofstream f(o.import_path);
    f << "999999999F0\n";
  }
  EXPECT_THROW(render_schedule_command(o), ScheduleError);
  std::remove(o.import_path.c_str());
}

TEST(ScheduleCommandTest, HugeSvgIsRefused) {
  EXPECT_THROW(render_schedule_command(cli("1f1b", 64, 1024, "svg")), ConfigError);
  EXPECT_NO_THROW(render_schedule_command(cli("1f1b", 8, 64, "svg")));
}

TEST(ScheduleCommandTest, UnevenCostsKeepTheTextTimelineNarrow) {
  ScheduleCommandOptions o = cli("1f1b", 4, 16, "text");
  o.costs = "F=0.01,B=5";
  const std::string text = render_schedule_command(o);
  for (const std::string& line : split(text, '\n')) {
    if (line.rfind("rank ", 0) == 0 && line.find("actions:") == std::string::npos) {
      EXPECT_LE(line.size(), 620u);
    }
  }
}

TEST(ScheduleCommandTest, ParseIntFlag) {
  EXPECT_EQ(parse_int_flag("--ranks", "8"), 8);
  EXPECT_EQ(parse_int_flag("--ranks", "0"), 0);
  for (const char* bad : {"", "x", "4x", "1.5", "99999999999"}) {
    try {
      parse_int_flag("--ranks", bad);
      FAIL() << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--ranks '"), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace pipemat::schedule
