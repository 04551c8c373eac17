// `--skip FROM:TO[:SIZE]` and `--skip-bandwidth` on `pipetrain simulate` and `schedule` (issue 13 item 2):
// the routes reach the simulator's time and memory, the lowered schedule and the CSV, and bad routes are
// usage errors that name the fix; `--exact` refuses them. `train` on the zoo's U-Net, whose skip goes from
// stage 0 straight to stage 2, records each skip transfer of the last step in its trace, naming the peer,
// in process and over gloo.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using Result = pipetrain::testing::CommandResult;

const std::string bin = PIPETRAIN_BIN;

nlohmann::json simulate_json(const std::string& flags) {
  const Result r = pipetrain::testing::run_command(bin + " simulate " + flags + " --json", false);
  EXPECT_EQ(r.code, 0) << r.out;
  return nlohmann::json::parse(r.out);
}

}  // namespace

// GPipe p=3 m=1 at unit costs: 9 without the skip; a skip 0 -> 2 of size 1 at bandwidth 0.1 takes 10 each
// way, so stage 2's forward waits until 11 and stage 0's backward until 24: 26 (test_skip.cpp derives it).
// 1F1B p=3 m=4 with a skip of 0.25: the last rank's peak memory grows by 3 x 0.25, the others' not at all.
TEST(SkipCli, SimulateChargesTimeAndMemory) {
  const nlohmann::json plain = simulate_json("-s gpipe -p 3 -m 1");
  EXPECT_DOUBLE_EQ(plain["makespan"].get<double>(), 9.0);
  const nlohmann::json slow = simulate_json("-s gpipe -p 3 -m 1 --skip 0:2 --skip-bandwidth 0.1");
  EXPECT_DOUBLE_EQ(slow["makespan"].get<double>(), 26.0);
  EXPECT_EQ(slow["skips"][0]["to_stage"], 2);

  const nlohmann::json a = simulate_json("-s 1f1b -p 3 -m 4");
  const nlohmann::json b = simulate_json("-s 1f1b -p 3 -m 4 --skip 0:2:0.25");
  for (int r = 0; r < 3; ++r)
    EXPECT_DOUBLE_EQ(b["per_stage"][r]["peak_memory"].get<double>(),
                     a["per_stage"][r]["peak_memory"].get<double>() + (r == 2 ? 0.75 : 0.0))
        << "rank " << r;
  EXPECT_DOUBLE_EQ(b["makespan"].get<double>(), a["makespan"].get<double>());  // free skips never delay

  const Result table = pipetrain::testing::run_command(bin + " simulate -s 1f1b -p 3 -m 4 --skip 0:2:0.25");
  EXPECT_TRUE(table.has("skip stage 0 -> stage 2, size 0.25")) << table.out;
}

TEST(SkipCli, ScheduleLowersSkipTransfersAndTheCsvKeepsThem) {
  const Result lowered = pipetrain::testing::run_command(bin + " schedule -s 1f1b -p 3 -m 2 --skip 0:2 --lower");
  ASSERT_EQ(lowered.code, 0) << lowered.out;
  for (const char* t : {"0SF0@2", "2RF0@0", "2SB1@0", "0RB1@2"}) EXPECT_TRUE(lowered.has(t)) << t << "\n" << lowered.out;
  const std::string file = ::testing::TempDir() + "skip_cli_lowered.csv";
  const Result csv = pipetrain::testing::run_command(bin + " schedule -s 1f1b -p 3 -m 2 --skip 0:2 --lower --format csv > " + file);
  ASSERT_EQ(csv.code, 0) << csv.out;
  const Result loaded = pipetrain::testing::run_command(bin + " simulate --load " + file);
  EXPECT_EQ(loaded.code, 0) << loaded.out;
  EXPECT_TRUE(loaded.has("skip stage 0 -> stage 2")) << loaded.out;
  const Result torch = pipetrain::testing::run_command(bin + " schedule -s 1f1b -p 3 -m 2 --skip 0:2 --format torch");
  EXPECT_EQ(torch.code, 2) << torch.out;
  EXPECT_TRUE(torch.has("cannot name a skip's peer")) << torch.out;
}

TEST(SkipCli, BadRoutesAreUsageErrors) {
  const std::pair<const char*, const char*> cases[] = {
      {"--skip 2:0", "to a later stage"},
      {"--skip 0:1", "neighbouring"},
      {"--skip 0:7", "outside 0..3"},
      {"--skip 0:x", "expected FROM:TO"},
      {"--skip 0:3 --skip 0:3", "repeats"},
      {"--skip 0:3 --skip-bandwidth -1", "--skip-bandwidth"},
  };
  for (const auto& [flags, why] : cases) {
    const Result r = pipetrain::testing::run_command(bin + " simulate -s 1f1b -p 4 -m 4 " + flags);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.out;
    EXPECT_TRUE(r.has(why)) << flags << "\n" << r.out;
  }
}

TEST(SkipCli, ExactRefusesSkipsNamingTheFix) {
  const Result r = pipetrain::testing::run_command(bin + " simulate -s zb-auto -p 3 -m 3 --skip 0:2 --exact");
  EXPECT_EQ(r.code, 2) << r.out;
  for (const char* part : {"--exact searches schedules without skip routes", "--skip 0:2", "drop --skip", "drop --exact"})
    EXPECT_TRUE(r.has(part)) << part << "\n" << r.out;
  const Result s = pipetrain::testing::run_command(bin + " schedule -s zb-auto -p 3 -m 3 --skip 0:2:0.5 --exact");
  EXPECT_EQ(s.code, 2) << s.out;
  EXPECT_TRUE(s.has("drop --skip")) << s.out;
  EXPECT_EQ(pipetrain::testing::run_command(bin + " simulate -s zb-auto -p 3 -m 3 --skip 0:2").code, 0);  // greedy: fine
}

TEST(SkipCli, TrainTracesEverySkipTransferInProcessAndOverGloo) {
  SKIP_WITHOUT_GLOO();
  namespace fs = std::filesystem;
  const fs::path dir = pipetrain::testing::fresh_temp_dir("skip", "trace");
  for (const std::string transport : {"local", "gloo"}) {
    const fs::path trace = dir / (transport + ".json");
    const Result r = pipetrain::testing::run_pipetrain(
        "train --transport " + transport + " --model unet --width 4 --stages 3 -m 4 --batch-size 16 --steps 2 "
        "--eval-every 0 --progress quiet --trace " + trace.string());
    ASSERT_EQ(r.code, 0) << transport << "\n" << r.out;
    // name -> the ranks (tids) it ran on
    std::multimap<std::string, int> seen;
    const nlohmann::json doc = pipetrain::testing::read_json_file(trace);
    for (const auto& e : doc.at("traceEvents"))
      if (e["ph"] == "X") seen.emplace(e["name"].get<std::string>(), e["tid"].get<int>());
    for (int i = 0; i < 4; ++i)
      for (const auto& [name, rank] : std::vector<std::pair<std::string, int>>{
               {"0SF" + std::to_string(i) + "@2", 0}, {"2RF" + std::to_string(i) + "@0", 2},
               {"2SB" + std::to_string(i) + "@0", 2}, {"0RB" + std::to_string(i) + "@2", 0}}) {
        ASSERT_EQ(seen.count(name), 1u) << transport << ": " << name;
        EXPECT_EQ(seen.find(name)->second, rank) << transport << ": " << name;
      }
    int with_peer = 0;
    for (const auto& [name, rank] : seen) with_peer += name.find('@') != std::string::npos ? 1 : 0;
    EXPECT_EQ(with_peer, 16) << transport;  // nothing but route 0 -> 2, which skips rank 1
  }
  fs::remove_all(dir);
}
