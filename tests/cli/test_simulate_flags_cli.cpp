// schedule/simulate flags that did nothing without a word (a tester's findings, 2026-11-28): a negative
// --memory-limit read as no limit, --microbatch-size 0 as the profile's, --cost beside --profile, sizes
// beside --load, --skip-bandwidth without skips. Each is now exit 2 naming the flag and the fix; what
// agrees with the file is still accepted.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;

TEST(SimulateFlags, FlagsThatDidNothingAreRefused) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("simflags", "refused");
  const std::string csv = (d / "s.csv").string();
  ASSERT_EQ(run_pipetrain("schedule -s 1f1b -p 2 -m 4 --steps 2 --format csv > " + csv, false).code, 0);
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const std::pair<std::string, std::string> rows[] = {
      {"simulate -s gpipe -p 2 -m 2 --memory-limit -5", "--memory-limit must be >= 0"},
      {"simulate -s 1f1b -p 2 -m 2 --profile " + vgg + " --pipedream-batch 128 --microbatch-size 0",
       "--microbatch-size must be > 0"},
      {"simulate -s 1f1b -p 2 -m 2 --profile " + vgg + " --pipedream-batch 128 --cost 1:2:1", "drop one"},
      {"simulate --load " + csv + " -p 3", "--stages 3 but " + csv + " has 2"},
      {"simulate --load " + csv + " -m 8", "--microbatches 8 but " + csv + " has 4"},
      {"schedule --load " + csv + " --steps 1", "--steps 1 but " + csv + " has 2"},
      {"simulate -s 1f1b -p 2 -m 2 --skip-bandwidth 4", "this schedule has no skip routes"},
      {"simulate -s 1f1b -p 2 -m 2 --comm 1e308", "1e+308 must be finite, >= 0 and at most 1e12"},
  };
  for (const auto& [args, words] : rows) {
    const CommandResult r = run_pipetrain(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(r.has(words)) << args << "\n" << r.out;
  }
  // What agrees with the file runs.
  const CommandResult r = run_pipetrain("simulate --load " + csv + " -p 2 -m 4 --steps 2");
  EXPECT_EQ(r.code, 0) << r.out;
  fs::remove_all(d);
}

// The flags that shape a profile's costs did nothing without --profile (a tester's findings, 2026-11-28):
// each is refused by name, with the fix, in simulate and schedule alike; with --profile they still run.
TEST(SimulateFlags, ProfileFlagsWithoutAProfileAreRefused) {
  const std::string flags[] = {"--balance memory", "--balance 1,1", "--balance-solver block-partition",
                               "--bandwidth 1", "--latency 5", "--microbatch-size 16", "--pipedream-batch 128"};
  for (const std::string& command : {"simulate -s 1f1b -p 2 -m 2 ", "schedule -s 1f1b -p 2 -m 2 "})
    for (const std::string& flag : flags) {
      const CommandResult r = run_pipetrain(command + flag);
      const std::string name = flag.substr(0, flag.find(' '));
      EXPECT_EQ(r.code, 2) << command << flag << "\n" << r.out;
      EXPECT_TRUE(r.has(name + " applies with --profile")) << command << flag << "\n" << r.out;
      EXPECT_TRUE(r.has("add --profile FILE, or drop " + name)) << command << flag << "\n" << r.out;
    }
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const CommandResult r = run_pipetrain("simulate -s 1f1b -p 2 -m 2 --profile " + vgg +
                                        " --pipedream-batch 128 --balance 17,22 --balance-solver block-partition "
                                        "--bandwidth 1 --latency 5 --microbatch-size 16");
  EXPECT_EQ(r.code, 0) << r.out;
}

// A PipeDream graph file read without --pipedream-batch is read at batch 1 (33809 ms instead of 264 ms for
// VGG-16 at micro-batch 16): simulate and schedule warn as plan does, once.
TEST(SimulateFlags, APipeDreamGraphWithoutItsBatchIsWarnedAbout) {
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const std::string warning = "is a PipeDream graph file, read as profiled at batch size 1";
  const CommandResult at_1 = run_pipetrain("simulate --profile " + vgg + " -s 1f1b -p 2 -m 2 --microbatch-size 16 "
                                           "--replication 1,1 --json");
  EXPECT_EQ(at_1.code, 0) << at_1.out;
  EXPECT_TRUE(at_1.has("pipetrain simulate: warning: " + vgg + " " + warning)) << at_1.out;
  EXPECT_TRUE(at_1.has("give --pipedream-batch N")) << at_1.out;
  std::size_t count = 0;
  for (std::size_t at = at_1.out.find(warning); at != std::string::npos; at = at_1.out.find(warning, at + 1)) ++count;
  EXPECT_EQ(count, 1u) << at_1.out;  // once, though a replicated run reads the profile twice
  const CommandResult at_128 = run_pipetrain("simulate --profile " + vgg + " -s 1f1b -p 2 -m 2 --microbatch-size 16 "
                                             "--pipedream-batch 128 --replication 1,1 --json", false);
  EXPECT_EQ(at_128.code, 0) << at_128.out;
  EXPECT_FALSE(at_128.has(warning)) << at_128.out;
  const double m1 = nlohmann::json::parse(at_1.out.substr(at_1.out.find('{'))).at("makespan").get<double>();
  const double m128 = nlohmann::json::parse(at_128.out).at("makespan").get<double>();
  EXPECT_GT(m1, 100 * m128);  // the times of batch 1 scaled to 16 samples, against those of 128
  const CommandResult sched = run_pipetrain("schedule -s zb-h2 -p 2 -m 4 --profile " + vgg);
  EXPECT_EQ(sched.code, 0) << sched.out;
  EXPECT_TRUE(sched.has("pipetrain schedule: warning: " + vgg + " " + warning)) << sched.out;
  EXPECT_FALSE(run_pipetrain("schedule -s zb-h2 -p 2 -m 4 --pipedream-batch 128 --profile " + vgg).has(warning));
}
