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
