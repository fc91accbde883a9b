// Deterministic mutation fuzzing of the YAML config loader and of the torch CSV importer: every
// mutated input either parses or is rejected with a typed pipemat error; nothing else escapes
// (no yaml-cpp or std exception), nothing crashes or hangs. Seeded, so a failure repeats.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "pipemat/core/error.h"
#include "pipemat/schedule/schedule.h"
#include "pipemat/schedule/torch_csv.h"
#include "pipemat/train/config.h"

namespace pipemat::train {
namespace {

// One random edit: flip a byte, insert or delete a few bytes, duplicate or cut a range, or put
// in a YAML / CSV token.
std::string mutate(std::string s, std::mt19937_64& rng) {
  static const std::vector<std::string> tokens = {
      ":",           ",",     "\n",     " ",      "[",
      "]",           "{",     "}",      "-",      "*",
      "&a",          "!!int", "~",      "'",      "\"",
      "#",           "0",     "-1",     "1e309",  "99999999999999999999",
      ".nan",        "0x10",  "F",      "B",      "I",
      "W",           "R",     "SEND_F", "RECV_B", "UNSHARD",
      "REDUCE_GRAD", "\t",    "---",    "? ",     "|",
      ">",           "%"};
  auto pos = [&](size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng() % (n + 1)); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 6) {
      case 0:
        if (!s.empty()) s[rng() % s.size()] = static_cast<char>(rng() % 256);
        break;
      case 1:
        s.insert(pos(s.size()), tokens[rng() % tokens.size()]);
        break;
      case 2: {
        const size_t at = pos(s.size());
        s.erase(at, rng() % 8);
        break;
      }
      case 3: {
        const size_t a = pos(s.size()), len = rng() % 32;
        s.insert(pos(s.size()), s.substr(a, len));
        break;
      }
      case 4:
        s.resize(pos(s.size()));
        break;
      default:
        s.insert(pos(s.size()), std::string(1 + rng() % 3, static_cast<char>(rng() % 128)));
    }
  }
  return s;
}

// Feeds `count` mutations of the seeds to `parse`. Returns {accepted, rejected}; any exception
// other than `Rejected` / `AlsoRejected` is a test failure that shows the input.
template <typename Rejected, typename AlsoRejected = std::nullptr_t, typename Parse>
std::pair<int, int> fuzz(const std::vector<std::string>& seeds, uint64_t seed, int count,
                         Parse&& parse) {
  std::mt19937_64 rng(seed);
  int accepted = 0, rejected = 0;
  for (int i = 0; i < count; ++i) {
    const std::string text = mutate(seeds[i % seeds.size()], rng);
    try {
      parse(text);
      ++accepted;
    } catch (const Rejected&) {
      ++rejected;
    } catch (const AlsoRejected&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "input " << i << " escaped as " << typeid(e).name() << ": " << e.what()
                    << "\n---\n"
                    << text;
      break;
    }
  }
  return {accepted, rejected};
}

TEST(ConfigFuzz, MutatedConfigsParseOrFailWithAConfigError) {
  std::vector<std::string> seeds;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(PIPEMAT_SOURCE_DIR) / "configs")) {
    if (entry.path().extension() != ".yaml") continue;  // configs/tokenizers/ is no config
    std::ifstream in(entry.path());
    seeds.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GE(seeds.size(), 8u);
  std::sort(seeds.begin(), seeds.end());  // the directory's order is the file system's
  const auto [parsed, rejected] = fuzz<ConfigError>(
      seeds, 20261201, 30000, [](const std::string& text) { parse_config(text, "fuzz.yaml"); });
  EXPECT_EQ(parsed + rejected, 30000) << "every mutation parses or is a ConfigError";
  // The split depends on the shipped configs, so it is bounded, not pinned.
  EXPECT_GT(parsed, 1000) << "the mutations should leave many configs valid";
  EXPECT_GT(rejected, 1000);
}

TEST(ConfigFuzz, MutatedTorchCsvSchedulesImportOrFailWithAScheduleError) {
  std::vector<std::string> seeds;
  for (auto kind : {schedule::ScheduleKind::kOneFOneB, schedule::ScheduleKind::kZeroBubbleV,
                    schedule::ScheduleKind::kInterleaved}) {
    schedule::ScheduleOptions o;
    o.kind = kind;
    o.ranks = 2;
    o.micro_batches = 4;
    o.virtual_stages = kind == schedule::ScheduleKind::kInterleaved ? 2 : 1;
    seeds.push_back(schedule::export_torch_csv(schedule::generate_schedule(o)));
    seeds.push_back(schedule::export_torch_csv(schedule::build_schedule(o)));
  }
  const auto [imported, rejected] = fuzz<ScheduleError, ConfigError>(
      seeds, 7, 30000,
      [](const std::string& text) { schedule::import_torch_csv_report(text, "fuzz.csv"); });
  EXPECT_EQ(imported + rejected, 30000) << "every mutation imports or is a clear error";
  EXPECT_GT(imported, 100);
  EXPECT_GT(rejected, 1000);
}

}  // namespace
}  // namespace pipemat::train
