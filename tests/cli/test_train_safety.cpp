// Checks that `pipetrain train` loses nothing (issue 16): a --save folder that holds a user's files is
// refused before training and left as it was; a bad save path is found before the first step; a text
// that is not ASCII saves and resumes; SIGINT stops every rank after the same step, leaving the last
// complete checkpoint intact and no temporary folder (and with --save-on-interrupt, one more
// checkpoint at the step reached).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::fresh_temp_dir;
using pipetrain::testing::run_pipetrain;

namespace {

const std::string kMlp = " --model mlp --data synthetic --batch-size 8 --progress lines";

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

int manifest_step(const fs::path& dir) {
  return nlohmann::json::parse(read_text(dir / "manifest.json")).at("step").get<int>();
}

// No DIR.partial, DIR.old or *.tmp file anywhere next to or inside the checkpoint.
void expect_no_leftovers(const fs::path& dir) {
  EXPECT_FALSE(fs::exists(dir.string() + ".partial")) << dir;
  EXPECT_FALSE(fs::exists(dir.string() + ".old")) << dir;
  if (fs::exists(dir))
    for (const auto& e : fs::directory_iterator(dir))
      EXPECT_TRUE(e.path().extension() == ".pt" || e.path().filename() == "manifest.json") << e.path();
}

}  // namespace

TEST(TrainSafety, SaveIntoAUsersFolderIsRefusedBeforeTraining) {
  const fs::path dir = fresh_temp_dir("safety", "userdir");
  fs::create_directories(dir / "userdir");
  std::ofstream(dir / "userdir" / "thesis.txt") << "precious";
  const CommandResult r =
      run_pipetrain("train" + kMlp + " --transport local --steps 2 --save " + (dir / "userdir").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("is a folder that is not a pipetrain checkpoint")) << r.out;
  EXPECT_FALSE(r.has("step 1")) << "refused before training: " << r.out;
  EXPECT_EQ(read_text(dir / "userdir" / "thesis.txt"), "precious");
  EXPECT_FALSE(fs::exists(dir / "userdir.partial"));
  fs::remove_all(dir);
}

TEST(TrainSafety, BadSavePathsAreFoundBeforeTheFirstStep) {
  const fs::path dir = fresh_temp_dir("safety", "paths");
  for (const std::string bad : {".", "/proc/pipetrain-ckpt"}) {
    const CommandResult r = run_pipetrain("train" + kMlp + " --transport local --steps 2 --save " + bad);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.out;
    EXPECT_TRUE(r.has("--save " + bad)) << r.out;
    EXPECT_FALSE(r.has("step 1/")) << "refused before training: " << r.out;
  }
  // A trailing slash is the folder itself (it failed every save, leaving ckpt/.partial).
  const CommandResult r = run_pipetrain("train" + kMlp + " --transport local --steps 2 --save " +
                                        (dir / "ckpt").string() + "/");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(manifest_step(dir / "ckpt"), 2);
  EXPECT_FALSE(fs::exists(dir / "ckpt" / ".partial"));
  expect_no_leftovers(dir / "ckpt");
  fs::remove_all(dir);
}

// The byte vocabulary of a UTF-8 text went into manifest.json as a string, which JSON cannot hold: the
// run trained, then failed at its first save. Now it saves, and resumes with the same vocabulary.
TEST(TrainSafety, NonAsciiTextSavesAndResumes) {
  const fs::path dir = fresh_temp_dir("safety", "utf8");
  {
    std::ofstream text(dir / "utf8.txt", std::ios::binary);
    for (int i = 0; i < 200; ++i) text << "Übung macht den Meister; café, naïve, Ωμέγα, 日本語. ";
  }
  const std::string common = " --text " + (dir / "utf8.txt").string() +
                             " --transport local --d-model 16 --heads 2 --seq-len 16 --layers 2 --batch-size 4 "
                             "--eval-samples 8 --sample 0 --progress lines";
  CommandResult r = run_pipetrain("train" + common + " --steps 2 --save " + (dir / "ckpt").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(manifest_step(dir / "ckpt"), 2);
  const nlohmann::json vocab = nlohmann::json::parse(read_text(dir / "ckpt" / "manifest.json")).at("run").at("data").at("vocabulary");
  EXPECT_TRUE(vocab.is_array()) << vocab.dump();
  r = run_pipetrain("train" + common + " --steps 3 --resume " + (dir / "ckpt").string() + " --save " +
                    (dir / "ckpt").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("resuming at step 2")) << r.out;
  EXPECT_EQ(manifest_step(dir / "ckpt"), 3);
  fs::remove_all(dir);
}

// Ctrl-C on the launcher (PIPETRAIN_FAULT's interrupt: rank 0 sends SIGINT to its launcher just before
// step 7's first forward; the launcher passes it on to every rank). Every rank stops after the same
// step, the exit is non-zero, the last checkpoint (--save-every 5: a multiple of 5, as the signal takes
// a few of these millisecond steps to arrive) is intact and resumes, and nothing temporary is left.
// With --save-on-interrupt a checkpoint at the step reached is written first.
TEST(TrainSafety, InterruptStopsEveryRankAndKeepsTheCheckpoint) {
  const fs::path dir = fresh_temp_dir("safety", "sigint");
  const std::string common = "train" + kMlp + " --stages 2 --steps 400 --save-every 5";
  CommandResult r = pipetrain::testing::run_command("PIPETRAIN_FAULT=0:0F0:interrupt:7 " + std::string(PIPETRAIN_BIN) +
                                                    " " + common + " --save " + (dir / "a").string());
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 20.0) << r.out;
  EXPECT_TRUE(r.has("stopped by SIGINT after step")) << r.out;
  EXPECT_FALSE(r.has("step 400/400")) << r.out;
  ASSERT_TRUE(fs::exists(dir / "a" / "manifest.json")) << r.out;
  const int saved = manifest_step(dir / "a");
  EXPECT_EQ(saved % 5, 0) << r.out;
  EXPECT_GE(saved, 5) << r.out;
  EXPECT_LT(saved, 400) << r.out;
  expect_no_leftovers(dir / "a");

  r = pipetrain::testing::run_command("PIPETRAIN_FAULT=0:0F0:interrupt:7 " + std::string(PIPETRAIN_BIN) + " " + common +
                                      " --save-on-interrupt --save " + (dir / "b").string());
  EXPECT_NE(r.code, 0) << r.out;
  ASSERT_TRUE(fs::exists(dir / "b" / "manifest.json")) << r.out;
  const int step = manifest_step(dir / "b");
  EXPECT_GE(step, 8) << r.out;  // the step the ranks had reached when they agreed to stop
  EXPECT_LT(step, 400) << r.out;
  EXPECT_TRUE(r.has("stopped by SIGINT after step " + std::to_string(step) + " ")) << r.out;
  EXPECT_TRUE(r.has("continue with --resume")) << r.out;
  expect_no_leftovers(dir / "b");
  // It resumes from there.
  r = run_pipetrain("train" + kMlp + " --stages 2 --steps " + std::to_string(step + 2) + " --resume " +
                    (dir / "b").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("resuming at step " + std::to_string(step))) << r.out;
  fs::remove_all(dir);
}
