// Checks the shm transport from the command line (issue 15): `pipetrain train --transport shm` runs its
// self-started ranks over shared memory and gives bitwise the losses of the same run over gloo (the
// default).
#include <gtest/gtest.h>

#include <filesystem>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::log_losses;
using pipetrain::testing::run_pipetrain;

namespace {

const std::string kRun = " --model mlp --data synthetic --stages 2 --steps 6 --batch-size 16 --progress quiet --log ";

// Also: with no --transport, the ranks train starts on this host meet over shm (auto).
TEST(ShmCli, TrainingOverShmIsBitwiseEqualToGloo) {
  SKIP_WITHOUT_GLOO();
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

namespace {

// A rank of an shm run killed during the rendezvous (after it joined the store, before the segment)
// ends the run with a message naming it, without the launcher's kill.
TEST(ShmCli, RankKilledDuringTheRendezvousEndsTheRun) {
  const CommandResult r = pipetrain::testing::run_command(
      "env PIPETRAIN_RENDEZVOUS_FAULT=1:after-join:1 timeout 120 " + std::string(PIPETRAIN_BIN) +
      " train --transport shm --model mlp --data synthetic --stages 2 --steps 5");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "timed out\n" << r.out;
  EXPECT_TRUE(r.has("rank 1 was killed by signal 9")) << r.out;
  EXPECT_TRUE(r.has("rank 1 failed")) << r.out;
  EXPECT_FALSE(r.has("did not stop within")) << r.out;
}

}  // namespace
