// Issue 23 ("nothing lost, nothing crashes, nothing lies") at the command line, one test per misuse:
// depth bombs in every JSON input exit 2 with a short message (they crashed with SIGSEGV, or echoed
// 300 KB); a file's terminal escape sequences are printed escaped; an output that cannot be written is
// an error (never "written"), refused before any work when the path is wrong; nan/inf flags, huge
// integers, huge profile numbers, bytes after a NUL and oversized searches are refused naming the flag
// or field and the limit; a byte order mark is skipped. Each test failed before its fix.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "run_command.h"

namespace {

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;

// The small, quick training setup of issue 23's reports.
const std::string kS = " --layers 1 --d-model 32 --batch-size 8 --eval-every 0 --sample 0";
const std::string kSim = "simulate --schedule 1f1b --stages 2 --microbatches 4";

class Issue23 : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = pipetrain::testing::fresh_temp_dir("issue23",
                                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string put(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
    return (dir_ / name).string();
  }
  fs::path dir_;
};

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

std::string profile_json(const std::string& forward_ms, const std::string& backward_ms, const std::string& parameter_bytes,
                         const std::string& threads = "1") {
  std::string layers;
  for (int i = 0; i < 3; ++i)
    layers += std::string(i ? "," : "") + R"({"name": "l)" + std::to_string(i) + R"(", "type": "Linear", "forward_ms": )" +
              forward_ms + R"(, "backward_ms": )" + backward_ms + R"(, "activation_bytes": 64, "parameter_bytes": )" +
              parameter_bytes + R"(, "optimizer_bytes": 0})";
  return R"({"format": "pipetrain-profile", "version": 1, "model": "toy", "micro_batch_size": 4, "threads": )" + threads +
         R"(, "layers": [)" + layers + "]}\n";
}

std::string plan_json(const std::string& field, const std::string& value) {
  std::string j = R"({"format": "pipetrain-plan", "version": 1, "model": "gpt", "layers": 3, "balance": [2, 1])";
  return j + ", \"" + field + "\": " + value + "}\n";
}

// Exit 2 with every word in the output, and a message of at most a few KB (the old ones echoed 300 KB).
void expect_usage_error(const CommandResult& r, std::initializer_list<std::string> words, const std::string& args) {
  EXPECT_EQ(r.code, 2) << args << "\n" << r.out.substr(0, 2000);
  for (const std::string& w : words) EXPECT_TRUE(r.has(w)) << "missing '" << w << "' for: " << args << "\n" << r.out.substr(0, 2000);
  EXPECT_LT(r.out.size(), 4000u) << args << " printed " << r.out.size() << " bytes";
}

// --- A: depth bombs ----------------------------------------------------------------------------------

TEST_F(Issue23, ConfigDepthBombAsObjectIsAUsageError) {
  const std::string f = put("bomb.json", nested(70000));
  expect_usage_error(run_pipetrain("train --config " + f + kS), {"bomb.json", "64 levels"}, "config bomb");
}

TEST_F(Issue23, ConfigDepthBombInLrIsAUsageError) {
  const std::string f = put("lr.json", "{\"lr\": " + nested(70000) + "}");
  expect_usage_error(run_pipetrain("train --config " + f + kS), {"lr.json", "64 levels"}, "config lr bomb");
}

TEST_F(Issue23, ConfigDepthBombInBalanceIsAUsageError) {
  const std::string f = put("balance.json", "{\"balance\": " + nested(70000) + "}");
  expect_usage_error(run_pipetrain("train --config " + f + kS), {"balance.json", "64 levels"}, "config balance bomb");
}

TEST_F(Issue23, ConfigFiftyThousandLevelsEchoesNoBulk) {
  // No crash at 50,000 levels before, but the error echoed 300 KB; now the reader stops at 64.
  const std::string f = put("lr.json", "{\"lr\": " + nested(50000) + "}");
  expect_usage_error(run_pipetrain("train --config " + f + kS), {"lr.json"}, "config lr 50k");
}

TEST_F(Issue23, ConfigValueWithinTheBoundIsQuotedShort) {
  // A wide value within the depth bound was echoed whole (200 KB).
  std::string wide = "[1";
  for (int i = 0; i < 100000; ++i) wide += ",[1]";
  const std::string f = put("lr.json", "{\"lr\": [" + wide + "]]}");
  expect_usage_error(run_pipetrain("train --config " + f + kS), {"lr.json", "'lr'"}, "config lr 60");
}

TEST_F(Issue23, ProfileDepthBombInThreadsIsAUsageError) {
  const std::string f = put("prof.json", profile_json("1", "2", "1000", nested(70000)));
  expect_usage_error(run_pipetrain("plan --profile " + f), {"prof.json", "64 levels"}, "plan --profile bomb");
}

TEST_F(Issue23, PlanDepthBombInVersionIsAUsageError) {
  const std::string f = put("plan.json", std::string(R"({"format": "pipetrain-plan", "version": )") + nested(70000) + "}");
  expect_usage_error(run_pipetrain("train --plan " + f + kS), {"plan.json", "64 levels"}, "train --plan version bomb");
}

TEST_F(Issue23, PlanDepthBombInBalanceIsAUsageError) {
  const std::string f = put("plan.json", plan_json("pipedream", "{\"balance\": " + nested(70000) + "}"));
  expect_usage_error(run_pipetrain("train --plan " + f + kS), {"plan.json", "64 levels"}, "train --plan balance bomb");
}

// --- B: control characters -----------------------------------------------------------------------------

TEST_F(Issue23, EscapeSequencesFromACsvArePrintedEscaped) {
  // The raw bytes cleared the screen and set the terminal's title.
  const std::string f = put("evil.csv", "0F0,\x1b[2J\x1b]0;pwned\x07,0BW0\n");
  const CommandResult r = run_pipetrain("simulate --load " + f);
  expect_usage_error(r, {"\\x1B[2J\\x1B]0;pwned\\x07"}, "simulate --load evil.csv");
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\x07'), std::string::npos) << r.out;
}

TEST_F(Issue23, Utf8InMessagesStaysReadable) {
  const std::string f = put("utf8.csv", "0F0,caf\xC3\xA9\xE2\x82\xAC\n");
  expect_usage_error(run_pipetrain("simulate --load " + f), {"caf\xC3\xA9\xE2\x82\xAC"}, "simulate --load utf8.csv");
}

TEST_F(Issue23, EscapeSequencesInAConfigValueArePrintedEscaped) {
  // CLI11's own message quoted the value raw.
  const std::string f = put("esc.json", R"({"lr": "\u001b[2J"})");
  const CommandResult r = run_pipetrain("train --config " + f + kS);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_TRUE(r.has("\\x1B[2J")) << r.out;
}

// --- C: writes -------------------------------------------------------------------------------------------

void expect_dev_full_error(const CommandResult& r, const std::string& args) {
  EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
  EXPECT_TRUE(r.has("No space left on device")) << args << "\n" << r.out;
  EXPECT_FALSE(r.has("written")) << args << "\n" << r.out;
  struct stat st {};
  ASSERT_EQ(::stat("/dev/full", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << args << " replaced /dev/full by a regular file";
}

TEST_F(Issue23, SvgToDevFullFails) {
  expect_dev_full_error(run_pipetrain(kSim + " --svg /dev/full"), "--svg /dev/full");
}

TEST_F(Issue23, TraceToDevFullFails) {
  expect_dev_full_error(run_pipetrain(kSim + " --trace /dev/full"), "--trace /dev/full");
}

TEST_F(Issue23, ProfileOutToDevFullFails) {
  expect_dev_full_error(run_pipetrain("profile --model mlp --data synthetic --microbatch-size 2 --repeats 1 --warmup 0 "
                                      "--out /dev/full"),
                        "profile --out /dev/full");
}

TEST_F(Issue23, TraceToAFolderIsRefusedBeforeWork) {
  // Was a failed rename after the simulation (exit 1, and its table printed).
  const CommandResult r = run_pipetrain(kSim + " --trace /");
  expect_usage_error(r, {"--trace /", "is a folder", "give a file path"}, "--trace /");
  EXPECT_FALSE(r.has("makespan")) << r.out;
}

TEST_F(Issue23, PlanOutIntoAMissingFolderIsRefusedBeforeWork) {
  const std::string f = put("prof.json", profile_json("1", "2", "1000"));
  const CommandResult r = run_pipetrain("plan --profile " + f + " --out " + (dir_ / "no/such/plan.json").string());
  expect_usage_error(r, {"--out", "does not exist", "mkdir -p"}, "plan --out no/such/plan.json");
  EXPECT_FALSE(r.has("chosen")) << r.out;
}

TEST_F(Issue23, ScheduleOutToAFolderIsRefused) {
  expect_usage_error(run_pipetrain("schedule -s 1f1b -p 2 -m 2 --out " + dir_.string()), {"--out", "is a folder"},
                     "schedule --out DIR");
}

TEST_F(Issue23, DemoOutThatIsAFileIsRefused) {
  expect_usage_error(run_pipetrain("demo --out /dev/null"), {"--out /dev/null", "is not a folder"}, "demo --out /dev/null");
}

// --- D: numbers and bytes ------------------------------------------------------------------------------

TEST_F(Issue23, ProfileWithHugeParameterBytesIsRefused) {
  // Was planned: "18595431358.65x data parallelism".
  const std::string f = put("prof.json", profile_json("1", "2", "9223372036854775808"));
  expect_usage_error(run_pipetrain("plan --profile " + f), {"prof.json", "parameter_bytes", "1125899906842624 bytes"},
                     "plan huge parameter_bytes");
}

TEST_F(Issue23, ProfileWithoutComputeTimeIsRefusedByPlan) {
  // Every plan took 0 ms and the speed-ups read "infx".
  const std::string f = put("prof.json", profile_json("0", "0", "1000"));
  const CommandResult r = run_pipetrain("plan --profile " + f);
  expect_usage_error(r, {"no compute time", "pipetrain profile"}, "plan all-zero profile");
  EXPECT_FALSE(r.has("infx")) << r.out;
}

TEST_F(Issue23, ConfigWithBytesAfterANulIsRefused) {
  const std::string f = put("nul.json", std::string("{\"stages\": 2}") + '\0' + "garbage");
  expect_usage_error(run_pipetrain("train --config " + f + kS), {"nul.json", "byte 13", "NUL"}, "config NUL");
}

TEST_F(Issue23, MemoryLimitNanIsRefused) {
  expect_usage_error(run_pipetrain(kSim + " --memory-limit nan"), {"--memory-limit", "nan", "finite"}, "--memory-limit nan");
}

TEST_F(Issue23, CommInfIsRefused) {
  expect_usage_error(run_pipetrain(kSim + " --comm inf"), {"--comm", "inf", "finite"}, "--comm inf");
}

TEST_F(Issue23, PlanLatencyNanIsRefused) {
  const std::string f = put("prof.json", profile_json("1", "2", "1000"));
  expect_usage_error(run_pipetrain("plan --profile " + f + " --latency nan"), {"--latency", "nan", "finite"}, "--latency nan");
}

TEST_F(Issue23, ScheduleAndDemoRefuseInfinities) {
  expect_usage_error(run_pipetrain("schedule -s zb-auto -p 2 -m 2 --memory-limit inf"), {"--memory-limit", "inf"},
                     "schedule --memory-limit inf");
  expect_usage_error(run_pipetrain("demo --comm nan --out " + (dir_ / "demo").string()), {"--comm", "nan"}, "demo --comm nan");
  EXPECT_FALSE(fs::exists(dir_ / "demo"));
}

TEST_F(Issue23, ExactNodesOverTheMaximumIsRefused) {
  const CommandResult r = run_pipetrain("simulate -s zb-auto -p 2 -m 2 --exact --exact-nodes 99999999999999");
  expect_usage_error(r, {"99999999999999", "50000000", "--exact-nodes"}, "--exact-nodes 99999999999999");
  EXPECT_LT(r.seconds, 30.0);
}

TEST_F(Issue23, ScheduleCsvWithAByteOrderMarkLoads) {
  // Was "malformed action '\ufeff#...'".
  const std::string f = put("bom.csv", "\xEF\xBB\xBF# pipetrain schedule microbatches=1\n0F0,0BW0,0S0\n");
  const CommandResult r = run_pipetrain("simulate --load " + f);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(r.has("malformed")) << r.out;
}

TEST_F(Issue23, OverflowingIntegerFlagNamesItsRange) {
  // Was only "Could not convert: --sample = 1000000000000".
  const CommandResult r = run_pipetrain("train --layers 1 --sample 1000000000000");
  expect_usage_error(r, {"--sample", "1000000000000", "from -2147483648 to 2147483647"}, "--sample 1e12");
  const CommandResult s = run_pipetrain(kSim + " --stages 99999999999");
  expect_usage_error(s, {"--stages", "from -2147483648 to 2147483647"}, "--stages 99999999999");
}

TEST_F(Issue23, HugeReplicationNamesTheUsersFlag) {
  // Blamed the launcher's "-n 1000001".
  const CommandResult r = run_pipetrain("train --data synthetic --replication 1000000,1" + kS);
  expect_usage_error(r, {"--replication 1000000,1", "1000001 ranks", "256"}, "--replication 1000000,1");
  EXPECT_FALSE(r.has("-n 1000001")) << r.out;
}

TEST_F(Issue23, SelftestWithThousandStagesNamesTheUsersFlag) {
  const CommandResult r = run_pipetrain("selftest --stages 1000");
  expect_usage_error(r, {"--stages 1000", "--stages <= 256"}, "selftest --stages 1000");
  EXPECT_FALSE(r.has("-n 1000")) << r.out;
}

}  // namespace
