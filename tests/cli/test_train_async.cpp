// Checks `pipetrain train` with the asynchronous schedules (issue 5; docs/ALGORITHMS.md §5, §6): pipedream
// (with stashing, vertical sync and the no-stash baseline), 2bw and spectrain train over threads and
// over gloo processes, report their weight policy and the extra weight sets each stage kept; a resumed
// asynchronous run gives bitwise the losses of an uninterrupted one (calls end at the same steps); data
// without a held-out split is not cut into calls at evaluations that never run; bad combinations exit 2
// with the fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;

namespace {

// A small GPT on synthetic tokens: a second or two per run.
const std::string kSmall =
    " --data synthetic --d-model 32 --heads 2 --seq-len 16 --vocab 32 --layers 2 --batch-size 8 --sample 0";

std::pair<double, double> first_last_loss(const CommandResult& r) {
  std::smatch m;
  if (!std::regex_search(r.out, m, std::regex(R"(summary: training loss ([0-9.]+) -> ([0-9.]+))"))) return {0, 0};
  return {std::stod(m[1]), std::stod(m[2])};
}

std::map<int, double> losses(const fs::path& log) {
  std::map<int, double> out;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    out[j.at("step").get<int>()] = j.at("loss").get<double>();
  }
  return out;
}

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("pipetrain-async-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

TEST(TrainAsync, EveryScheduleTrainsOverThreads) {
  struct Case {
    std::string flags, policy, stage0;  // stage0: extra weight sets stage 0 of 4 keeps (calls of 8 steps)
  };
  for (const Case& c : std::vector<Case>{
           {"--schedule pipedream", "weights: stash", "stage 0 3 ("},
           {"--schedule pipedream --vertical-sync", "weights: vertical-sync", "stage 0 3 ("},
           {"--schedule pipedream --no-stash", "weights: current", "stage 0 0 ("},
           {"--schedule 2bw --microbatches 4", "weights: 2bw", "stage 0 1 ("},
           {"--schedule spectrain --optimizer sgd --lr 0.1 --momentum 0.9", "weights: spectrain", "stage 0 4 ("},
           {"--schedule spectrain", "weights: pipeoptim", "stage 0 4 ("},
       }) {
    const CommandResult r = run_pipetrain("train --transport local --stages 4 --steps 16 --steps-per-call 8 --layers 2" +
                                          kSmall + " " + c.flags);
    ASSERT_EQ(r.code, 0) << c.flags << "\n" << r.out;
    EXPECT_TRUE(r.has(c.policy)) << c.flags << "\n" << r.out;
    EXPECT_TRUE(r.has("extra weight sets kept at most, per stage: " + c.stage0)) << c.flags << "\n" << r.out;
    EXPECT_TRUE(r.has("last call (8 steps, one pipeline fill and drain)")) << c.flags << "\n" << r.out;
    const auto [first, last] = first_last_loss(r);
    EXPECT_GT(first, 0) << r.out;
    EXPECT_LT(last, first) << c.flags << "\n" << r.out;
  }
}

TEST(TrainAsync, PipeDreamOverGlooProcesses) {
  SKIP_WITHOUT_GLOO();
  const CommandResult r = run_pipetrain("train --transport gloo --stages 2 --schedule pipedream --steps 12 --steps-per-call 6" + kSmall);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("over gloo")) << r.out;
  EXPECT_TRUE(r.has("weights: stash")) << r.out;
  // Two calls of 6 steps (each drains the pipeline); stage 0 of 2 keeps one extra version.
  EXPECT_TRUE(r.has("last call (6 steps, one pipeline fill and drain)")) << r.out;
  EXPECT_TRUE(r.has("per stage: stage 0 1 (")) << r.out;
  const auto [first, last] = first_last_loss(r);
  EXPECT_LT(last, first) << r.out;
}

TEST(TrainAsync, ResumeAfterACrashGivesBitwiseTheSameLosses) {
  // Calls end at checkpoints and every --steps-per-call steps (4 here), so a run resumed from step 4 cuts
  // the remaining steps into the same calls and its pipeline sees the same versions.
  const fs::path dir = temp_dir("resume");
  const std::string common =
      " --transport local --stages 2 --schedule pipedream --steps 8 --steps-per-call 4 --dropout 0.1" + kSmall;
  const CommandResult straight = run_pipetrain("train" + common + " --log " + (dir / "a.jsonl").string());
  ASSERT_EQ(straight.code, 0) << straight.out;
  // The process dies before rank 1's first forward of the call that starts at step 4 (0-based).
  const CommandResult crash = pipetrain::testing::run_command(
      "PIPETRAIN_FAULT=1:1F0:kill:4 " + std::string(PIPETRAIN_BIN) + " train" + common + " --save " +
      (dir / "ckpt").string() + " --save-every 4 --log " + (dir / "b.jsonl").string());
  EXPECT_NE(crash.code, 0) << crash.out;
  ASSERT_TRUE(fs::exists(dir / "ckpt" / "manifest.json")) << crash.out;
  const CommandResult resumed = run_pipetrain("train" + common + " --resume " + (dir / "ckpt").string() + " --log " +
                                              (dir / "c.jsonl").string());
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_TRUE(resumed.has("resuming at step 4")) << resumed.out;
  const auto a = losses(dir / "a.jsonl"), b = losses(dir / "b.jsonl"), c = losses(dir / "c.jsonl");
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(c.size(), 4u);
  for (int step = 1; step <= 4; ++step) EXPECT_EQ(a.at(step), b.at(step)) << "step " << step;
  for (int step = 5; step <= 8; ++step) EXPECT_EQ(a.at(step), c.at(step)) << "step " << step;
  fs::remove_all(dir);
}

TEST(TrainAsync, NoEvaluationsNoCallBoundaries) {
  // Synthetic data has no held-out split, so no evaluation runs: the default --eval-every (ten per run)
  // cut the run into calls of 2 steps all the same, each draining the pipeline (partly synchronous).
  const fs::path dir = temp_dir("boundaries");
  const std::string common = " --transport local --stages 2 --schedule pipedream --steps 20" + kSmall + " --log ";
  const CommandResult plain = run_pipetrain("train" + common + (dir / "default.jsonl").string());
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_TRUE(plain.has("last call (20 steps, one pipeline fill and drain)")) << plain.out;
  const CommandResult none = run_pipetrain("train" + common + (dir / "none.jsonl").string() + " --eval-every 0");
  ASSERT_EQ(none.code, 0) << none.out;
  const auto a = losses(dir / "default.jsonl"), b = losses(dir / "none.jsonl");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (int step = 1; step <= 20; ++step) EXPECT_EQ(a.at(step), b.at(step)) << "step " << step;
  fs::remove_all(dir);
}

TEST(TrainAsync, BadCombinationsExitTwo) {
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--vertical-sync", "vertical sync applies to --schedule pipedream only, not '1f1b'"},
           {"--schedule 2bw --microbatches 4 --no-stash", "--no-stash applies to --schedule pipedream only"},
           {"--schedule pipedream --no-stash --vertical-sync", "vertical sync is a weight-stashing policy"},
           {"--schedule pipedream --microbatches 2", "use --microbatches 1"},
           {"--schedule 2bw --microbatches 1", "use --microbatches 2 or more"},
           {"--schedule spectrain --optimizer sgd --momentum 0", "SGD needs --momentum > 0"},
           {"--steps-per-call 4", "--steps-per-call applies to the asynchronous schedules"},
           {"--schedule 2bw --microbatches 2 --steps-per-call -1", "--steps-per-call must be >= 0"},
       }) {
    const CommandResult r = run_pipetrain("train --transport local --stages 2 --steps 2" + kSmall + " " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(r.has(c.message)) << c.args << "\n" << r.out;
  }
}
