// Checks the `pipetrain` command line as a user meets it: exit codes (0 success, 2 usage error with a
// message naming the value and the fix), the simulate --json contract (README and docs/ARCHITECTURE.md) with numbers from
// the closed forms, the trace and SVG files, CSV schedules written by hand, and --help examples.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "run_command.h"
#include <sstream>
#include <string>

namespace {

using Result = pipetrain::testing::CommandResult;

Result run(const std::string& args) { return pipetrain::testing::run_pipetrain(args); }

std::string stdout_only(const std::string& args) { return pipetrain::testing::run_pipetrain(args, false).out; }

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("pipetrain-cli-" + std::to_string(::getpid()) + "-" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  return dir;
}

void expect_usage_error(const std::string& args, const std::string& must_mention) {
  const Result r = run(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
  EXPECT_NE(r.out.find(must_mention), std::string::npos) << args << "\n" << r.out;
}

}  // namespace

// The acceptance command: zb-h1, p=4, m=8, F=B=W=1. Closed forms: 1F1B makespan would be
// (m+p-1)(F+B+W) = 33; ZB-H1 shortens every stage's idle to (p-1)(F+B-W) = 3, so stage 0 spans
// busy + 3 = 24 + 3 = 27 = makespan, and bubble_fraction = 1 - (4*24)/(4*27) = 1/9.
TEST(Cli, SimulateZbH1Json) {
  const Result r = run("simulate --schedule zb-h1 --stages 4 --microbatches 8 --cost 1:1:1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schedule"], "zb-h1");
  EXPECT_EQ(j["stages"], 4);
  EXPECT_EQ(j["microbatches"], 8);
  EXPECT_DOUBLE_EQ(j["makespan"].get<double>(), 27.0);
  EXPECT_NEAR(j["bubble_fraction"].get<double>(), 1.0 / 9.0, 1e-12);
  ASSERT_EQ(j["per_stage"].size(), 4u);
  for (const auto& st : j["per_stage"]) {
    EXPECT_DOUBLE_EQ(st["busy"].get<double>(), 24.0);
    EXPECT_LE(st["bubble"].get<double>(), 3.0 + 1e-12);
    EXPECT_LE(st["peak_inflight"].get<int>(), 4);
  }
  EXPECT_DOUBLE_EQ(j["per_stage"][0]["bubble"].get<double>(), 3.0);
}

// GPipe's bubble fraction (p-1)/(m+p-1) = 3/11 and makespan (m+p-1)(F+B+W) = 11 * 4 with F:B:W = 1:2:1.
TEST(Cli, SimulateTableAndFiles) {
  const auto dir = temp_dir();
  const std::string svg = (dir / "g.svg").string(), trace = (dir / "g.json").string();
  const Result r =
      run("simulate -s gpipe -p 4 -m 8 --cost 1:2:1 --svg " + svg + " --trace " + trace + " --ascii");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("makespan 44.000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bubble fraction 0.2727"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 3  ......f0"), std::string::npos) << r.out;
  std::ifstream svg_in(svg), trace_in(trace);
  std::stringstream svg_text;
  svg_text << svg_in.rdbuf();
  EXPECT_NE(svg_text.str().find("<svg"), std::string::npos);
  EXPECT_NE(svg_text.str().find("gpipe"), std::string::npos);
  const auto tj = nlohmann::json::parse(trace_in);
  int slices = 0;
  for (const auto& e : tj["traceEvents"]) slices += e["ph"] == "X";
  EXPECT_EQ(slices, 4 * (8 + 8 + 1));  // per rank: 8 F, 8 BW, 1 step
  std::filesystem::remove_all(dir);
}

TEST(Cli, ScheduleTextCsvAndLowering) {
  Result r = run("schedule --schedule 1f1b --stages 2 --microbatches 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, "rank 0: 0F0 0F1 0BW0 0BW1 0S0\nrank 1: 1F0 1BW0 1F1 1BW1 1S0\n");
  r = run("schedule --schedule 1f1b --stages 2 --microbatches 2 --lower");
  EXPECT_NE(r.out.find("rank 1: 1RF0 1F0 1RF1 1BW0 1SB0"), std::string::npos) << r.out;
  // The CSV form loads back to the same schedule.
  const auto dir = temp_dir();
  const std::string csv = (dir / "s.csv").string();
  ASSERT_EQ(run("schedule -s zb-h1 -p 3 -m 5 --out " + csv).code, 0);
  EXPECT_EQ(stdout_only("schedule --load " + csv), stdout_only("schedule -s zb-h1 -p 3 -m 5"));
  EXPECT_EQ(stdout_only("simulate --load " + csv + " --json"), stdout_only("simulate -s zb-h1 -p 3 -m 5 --json"));
  std::filesystem::remove_all(dir);
}

TEST(Cli, HandWrittenDeadlockingCsvIsRejectedWithGrid) {
  const auto dir = temp_dir();
  const std::string csv = (dir / "bad.csv").string();
  std::ofstream(csv) << "# my schedule\n0F0,0BW0,0F1,0BW1\n1F1,1BW1,1F0,1BW0\n";
  const Result r = run("simulate --load " + csv);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("deadlock"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[1F1]"), std::string::npos) << r.out;
  std::ofstream(csv) << "0F0,0BW0\n1F0,1XX0\n";
  expect_usage_error("schedule --load " + csv, "line 2, cell 2");
  std::filesystem::remove_all(dir);
}

TEST(Cli, BadInputExitsTwoWithTheFix) {
  expect_usage_error("simulate -s 1f1b -p 0 -m 4", "stages must be >= 1, got 0");
  expect_usage_error("simulate -s 1f1b -p -3 -m 4", "got -3");
  expect_usage_error("simulate -s 1f1b -p 4 -m 0", "micro-batches must be >= 1, got 0");
  expect_usage_error("simulate -s interleaved -p 4 -m 6 -v 2", "use --microbatches 4 or 8");
  expect_usage_error("simulate -s interleaved -p 4 -m 8 -v 0", "virtual stages must be >= 1");
  expect_usage_error("simulate -s nosuch -p 4 -m 8", "valid schedules are gpipe, 1f1b, interleaved");
  expect_usage_error("simulate -s 1f1b -p 4 -m 8 --cost 1:-1:1", "must be a finite number >= 0");
  expect_usage_error("simulate -s 1f1b -p 4 -m 8 --cost 1:1", "must have three parts F:B:W");
  expect_usage_error("simulate -s 1f1b -p 4 -m 8 --cost 1:1:1,2:2:2", "give one triple, one per rank");
  expect_usage_error("simulate -s 1f1b -p 4 -m 8 --comm -1", "--comm");
  expect_usage_error("simulate -s 1f1b -p 4", "missing --microbatches");
  expect_usage_error("simulate -p 4 -m 8", "missing --schedule");
  expect_usage_error("simulate -s 1f1b -p four -m 8", "four");
  expect_usage_error("simulate -s gpipe -p 4 -m 8 --memory-limit 3", "above the memory limit 3");
  expect_usage_error("simulate --load /nonexistent.csv", "cannot read schedule file");
  expect_usage_error("frobnicate", "Commands are schedule, simulate, demo, info, launch, train, selftest, profile and plan");
}

// An output path in a folder that does not exist is known to be bad before any work: a usage error
// naming the flag, the path and the fix (issue 23; it was a runtime failure after the simulation). A
// write that fails later is a runtime failure (test_issue23_cli.cpp: /dev/full).
TEST(Cli, OutputInAMissingFolderIsAUsageError) {
  const Result r = run("simulate -s 1f1b -p 2 -m 2 --svg /nonexistent-dir/x.svg");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--svg /nonexistent-dir/x.svg"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mkdir -p /nonexistent-dir"), std::string::npos) << r.out;
}

TEST(Cli, HelpShowsExamples) {
  for (const char* cmd : {"schedule", "simulate", "demo", "info"}) {
    const Result r = run(std::string(cmd) + " --help");
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_NE(r.out.find("Example"), std::string::npos) << cmd << "\n" << r.out;
  }
  EXPECT_EQ(run("--help").code, 0);
}

TEST(Cli, DemoWritesOneSvgPerSchedule) {
  const auto dir = temp_dir();
  const Result r = run("demo --out " + dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* name : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-auto", "pipedream", "2bw"}) {
    EXPECT_TRUE(std::filesystem::exists(dir / (std::string(name) + ".svg"))) << name;
    EXPECT_NE(r.out.find(name), std::string::npos) << name;
  }
  std::filesystem::remove_all(dir);
}
