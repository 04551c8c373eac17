// The schedules on V-shaped and looped placements across real processes: `pipetrain selftest` over Gloo
// (two ranks, so four stages) checks that zb-v, v-half, v-min, dualpipev, interleaved-zb and looped-bfs give the
// gradients of plain training; `pipetrain demo` lists them.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "run_command.h"

namespace {

using Result = pipetrain::testing::CommandResult;

const std::string bin = PIPETRAIN_BIN;

}  // namespace

TEST(VSchedulesCli, SelftestOverGloo) {
  SKIP_WITHOUT_GLOO();
  const Result r = pipetrain::testing::run_command(
      bin + " selftest --stages 2 --transport gloo --schedules zb-v v-half v-min dualpipev "
            "interleaved-zb looped-bfs --microbatch-counts 4 8");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("selftest over gloo: 12 passed, 0 failed")) << r.out;
  for (const std::string s : {"zb-v", "v-half", "v-min", "dualpipev", "interleaved-zb", "looped-bfs"})
    EXPECT_NE(r.out.find(s + " "), std::string::npos) << s << "\n" << r.out;
}

TEST(VSchedulesCli, DemoShowsTheNewSchedules) {
  const std::filesystem::path dir = pipetrain::testing::fresh_temp_dir("vsched", "demo");
  const Result r =
      pipetrain::testing::run_command(bin + " demo --stages 4 --microbatches 8 --steps 1 --out " + dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  for (const std::string s : {"zb-v", "v-half", "v-min", "dualpipev", "interleaved-zb", "looped-bfs"})
    EXPECT_TRUE(std::filesystem::exists(dir / (s + ".svg"))) << s;
  std::filesystem::remove_all(dir);
  for (const std::string s : {"zb-v V", "v-half V", "v-min V", "dualpipev V", "interleaved-zb v=2", "looped-bfs v=2"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  EXPECT_EQ(r.out.find("skipped"), std::string::npos) << r.out;
}
