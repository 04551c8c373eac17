// Checks the shm transport from the command line (issue 15): `pipetrain train` picks it by default (its
// ranks are started by pipetrain on this host), and a run over shm gives bitwise the losses of the same
// run over gloo.
#include <gtest/gtest.h>

#include <filesystem>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::log_losses;
using pipetrain::testing::run_pipetrain;

namespace {

const std::string kRun = " --model mlp --data synthetic --stages 2 --steps 6 --batch-size 16 --progress quiet --log ";

TEST(ShmCli, TrainingOverShmIsTheDefaultAndBitwiseEqualToGloo) {
  const fs::path dir = pipetrain::testing::fresh_temp_dir("shm", "bitwise");
  const CommandResult gloo = run_pipetrain("train --transport gloo" + kRun + (dir / "gloo.jsonl").string());
  ASSERT_EQ(gloo.code, 0) << gloo.out;
  EXPECT_TRUE(gloo.has("2 stages over gloo")) << gloo.out;
  const CommandResult shm = run_pipetrain("train" + kRun + (dir / "shm.jsonl").string());
  ASSERT_EQ(shm.code, 0) << shm.out;
  EXPECT_TRUE(shm.has("2 stages over shm")) << shm.out;
  const std::vector<double> a = log_losses(dir / "gloo.jsonl"), b = log_losses(dir / "shm.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (std::size_t k = 0; k < a.size(); ++k) EXPECT_EQ(a[k], b[k]) << "step " << k + 1;
  fs::remove_all(dir);
}

}  // namespace
