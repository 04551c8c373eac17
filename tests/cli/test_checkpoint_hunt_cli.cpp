// `pipetrain train`'s checkpoints and stops, found by a tester: a second run saving to the same --save
// folder is refused at start-up (exit 2, naming the folder and the other run's pid), with threads and
// with rank processes, and a run killed with SIGKILL does not block the next; a stop asked for during
// an asynchronous call that holds the rest of the run is reported ("stopped by", 128 + N) after the
// end's checkpoint instead of the run ending "successfully" with exit 1 and no word.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::fresh_temp_dir;
using pipetrain::testing::run_pipetrain;

namespace {

const std::string kMlp = " --model mlp --data synthetic --batch-size 8 --eval-every 0 --progress quiet";

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Starts `pipetrain ARGS` in the background (output to `log`); returns its pid.
pid_t start_pipetrain(const std::string& args, const fs::path& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);  // its own process group, so the test can kill the run with its ranks
    const std::string cmd = "exec " + std::string(PIPETRAIN_BIN) + " " + args + " > " + log.string() + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// The pid a run's lock file names once a run holds it (0 when none does within a minute).
long wait_for_holder(const fs::path& lock, pid_t run) {
  for (int i = 0; i < 1200; ++i) {
    const std::string text = read_text(lock);
    const auto at = text.find("pid ");
    if (at != std::string::npos) return std::stol(text.substr(at + 4));
    int status = 0;
    if (::waitpid(run, &status, WNOHANG) == run) return 0;  // the run ended first
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return 0;
}

void check_second_run_refused(const std::string& first_flags) {
  const fs::path dir = fresh_temp_dir("ckhunt", "lock");
  const fs::path save = dir / "shared";
  // The first run saves only at its end, which it never reaches: the folder stays free of checkpoints,
  // so nothing but the lock can refuse the second run.
  const pid_t a = start_pipetrain("train" + kMlp + first_flags + " --steps 1000000 --save " + save.string(),
                                  dir / "a.log");
  ASSERT_GT(a, 0);
  const long holder = wait_for_holder(save.string() + ".pipetrain-lock", a);
  ASSERT_GT(holder, 0) << read_text(dir / "a.log");

  // The second run is refused before it trains, naming the folder and the first run's process.
  CommandResult b = run_pipetrain("train" + kMlp + " --steps 2 --seed 7 --save " + save.string());
  EXPECT_EQ(b.code, 2) << b.out;
  EXPECT_TRUE(b.has("another run is saving to " + save.string())) << b.out;
  EXPECT_TRUE(b.has("pid " + std::to_string(holder))) << b.out;
  EXPECT_FALSE(b.has("step 1/2")) << b.out;

  // The first run is killed (SIGKILL: no clean-up of its own); its stale lock does not block the next run.
  // (A launcher then stops the other ranks and ends by itself; it is killed too after a minute.)
  ::kill(static_cast<pid_t>(holder), SIGKILL);
  int status = 0;
  for (int i = 0; i < 600 && ::waitpid(a, &status, WNOHANG) != a; ++i) {
    if (i == 599) {
      ::kill(-a, SIGKILL);
      ::waitpid(a, &status, 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CommandResult c = run_pipetrain("train" + kMlp + " --steps 2 --seed 7 --save " + save.string());
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_EQ(nlohmann::json::parse(read_text(save / "manifest.json")).at("step").get<int>(), 2) << c.out;
  EXPECT_FALSE(fs::exists(save.string() + ".pipetrain-lock"));  // the run that ended removed its lock
  fs::remove_all(dir);
}

}  // namespace

TEST(CheckpointLockCli, ASecondRunSavingToTheSameFolderIsRefusedAtStartUp) {
  check_second_run_refused(" --stages 2 --transport local");
}

// Rank processes (the launcher's): only rank 0 holds the lock, so the run's own ranks do not refuse
// each other, and the second run's launcher refuses before it starts any rank.
TEST(CheckpointLockCli, ASecondRunIsRefusedWhenTheFirstRunsRankProcesses) {
  check_second_run_refused(" --stages 2 --transport shm");
}

// PIPETRAIN_FAULT's interrupt: rank 0 sends SIGINT to its launcher before micro-batch 20's forward, in
// the middle of the one asynchronous call that holds all 60 steps. The call ends, the end's checkpoint
// is written, and the run says it was stopped, with 128 + SIGINT.
TEST(CheckpointLockCli, AStopDuringTheLastAsynchronousCallIsReported) {
  const fs::path dir = fresh_temp_dir("ckhunt", "asyncstop");
  const CommandResult r = pipetrain::testing::run_command(
      "PIPETRAIN_FAULT=0:0F20:interrupt " + std::string(PIPETRAIN_BIN) + " train" + kMlp +
      " --stages 2 --schedule pipedream --steps 60 --save-on-interrupt --save " + (dir / "ck").string());
  EXPECT_EQ(r.code, 128 + SIGINT) << r.out;
  EXPECT_TRUE(r.has("stopped by SIGINT after step 60 of 60")) << r.out;
  EXPECT_EQ(nlohmann::json::parse(read_text(dir / "ck" / "manifest.json")).at("step").get<int>(), 60) << r.out;
  fs::remove_all(dir);
}

namespace {

std::vector<double> log_loss_values(const fs::path& log) {
  std::vector<double> out;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

}  // namespace

// `train --resume DIR` with none of the model and data flags continues the checkpoint's model on its data
// (the help's example was refused for the default model): bitwise the losses of an uninterrupted run.
// A flag given that disagrees with the checkpoint is still refused.
TEST(CheckpointHunt, ResumeTakesTheModelAndDataFlagsItWasNotGiven) {
  const fs::path dir = fresh_temp_dir("adopt", "cli");
  {
    std::ofstream text(dir / "words.txt");
    for (int i = 0; i < 400; ++i) text << "the quick brown fox " << i % 7 << " jumps over the lazy dog\n";
  }
  const std::string model = " --text " + (dir / "words.txt").string() +
                            " --layers 1 --d-model 16 --heads 2 --seq-len 16 --seed 5 --optimizer sgd";
  const std::string run = " train --transport local --batch-size 8 --eval-every 0 --sample 0 --progress quiet "
                          "--lr-schedule constant";
  CommandResult r = run_pipetrain(run + model + " --steps 4 --log " + (dir / "whole.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain(run + model + " --steps 2 --save " + (dir / "ck").string());
  ASSERT_EQ(r.code, 0) << r.out;
  // No model, data, seed or optimizer flag: the checkpoint's.
  r = run_pipetrain(run + " --steps 4 --resume " + (dir / "ck").string() + " --log " + (dir / "rest.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("gpt: 1 blocks, d_model 16, 2 heads")) << r.out;
  EXPECT_TRUE(r.has("optimizer sgd")) << r.out;
  const std::vector<double> whole = log_loss_values(dir / "whole.jsonl"), rest = log_loss_values(dir / "rest.jsonl");
  ASSERT_EQ(whole.size(), 4u);
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0], whole[2]);
  EXPECT_EQ(rest[1], whole[3]);
  // A flag given still counts, and is refused where it is not the checkpoint's.
  r = run_pipetrain(run + " --resume " + (dir / "ck").string() + " --d-model 32");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("does not match this run")) << r.out;
  fs::remove_all(dir);
}
