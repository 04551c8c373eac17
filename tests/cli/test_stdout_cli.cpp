// What a command prints must reach its standard output, or the command fails: `pipetrain schedule
// --format csv > zb.csv` on a full disk left a cut CSV behind and exit 0 (README recommends that line).
#include <gtest/gtest.h>

#include <filesystem>

#include "run_command.h"


TEST(StdoutCli, AFailedWriteOfTheOutputFailsTheCommand) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this machine";
  for (const char* args : {"schedule -s zb-h1 -p 4 -m 8 --format csv", "simulate -s 1f1b -p 4 -m 8 --json",
                           "simulate -s 1f1b -p 2 -m 2 --ascii"}) {
    SCOPED_TRACE(args);
    const auto r = pipetrain::testing::run_command("(" + std::string(PIPETRAIN_BIN) + " " + args + " >/dev/full)");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(r.has("writing the standard output failed")) << r.out;
  }
  // A reader that stops early (| head) is not an error of the command's.
  const auto r = pipetrain::testing::run_command("({ " + std::string(PIPETRAIN_BIN) +
                                                 " schedule -s 1f1b -p 2 -m 2 --format csv; echo rc=$? >&2; } | head -1)");
  EXPECT_TRUE(r.has("rc=0")) << r.out;
  EXPECT_TRUE(r.has("# pipetrain schedule name=1f1b")) << r.out;
}
