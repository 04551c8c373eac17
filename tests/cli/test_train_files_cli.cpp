// What `train` reads and writes, as a new user's mistakes meet it (a tester's findings, 2026-11-28): an
// output that is one of the run's inputs or lies in a checkpoint folder, an empty name from an unset shell
// variable, a fresh run saving over a checkpoint, a resume with another seed or without --steps, a log
// resumed after a stop, --transport local under a launcher, and flags that changed nothing. Each of these
// ran and exited 0 before (several destroyed the user's file); now each is refused before training, or
// does what the user meant.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::log_losses;
using pipetrain::testing::read_json_file;
using pipetrain::testing::run_command;
using pipetrain::testing::run_pipetrain;

namespace {

const std::string kRun = "train --transport local --model mlp --data synthetic --hidden 16 --progress quiet ";

fs::path temp_dir(const std::string& name) { return pipetrain::testing::fresh_temp_dir("trainfiles", name); }

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void expect_refused(const std::string& args, const std::string& words) {
  const CommandResult r = run_pipetrain(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
  EXPECT_TRUE(r.has(words)) << args << "\n" << r.out;
}

}  // namespace

TEST(TrainFiles, AnOutputIsNeverAnInputACheckpointOrAnotherOutput) {
  const fs::path d = temp_dir("outputs");
  const std::string text(4000, 'a');
  std::ofstream(d / "my.txt") << text << "bcd efg\n";
  const std::string before = slurp(d / "my.txt");
  const std::string gpt = "train --transport local --model gpt --text " + (d / "my.txt").string() +
                          " --layers 1 --d-model 16 --heads 2 --seq-len 8 --steps 2 --sample 0 --progress quiet ";
  expect_refused(gpt + "--log " + (d / "my.txt").string(), "is the file --text reads");
  expect_refused(gpt + "--svg " + (d / "./my.txt").string(), "is the file --text reads");
  EXPECT_EQ(slurp(d / "my.txt"), before);
  std::ofstream(d / "flags.json") << R"({"steps": 2})";
  expect_refused(kRun + "--config " + (d / "flags.json").string() + " --log " + (d / "flags.json").string(),
                 "is the file --config reads");
  expect_refused(kRun + "--steps 2 --log " + (d / "same.out").string() + " --trace " + (d / "same.out").string(),
                 "--log and --trace both write");
  // Inside the checkpoint folders: the save's and the resume's.
  fs::create_directories(d / "ck");  // a new, empty --save folder (the user made it)
  expect_refused(kRun + "--steps 2 --save " + (d / "ck").string() + " --log " + (d / "ck" / "train.jsonl").string(),
                 "lies in the --save folder");
  ASSERT_EQ(run_pipetrain(kRun + "--steps 2 --save " + (d / "ck").string()).code, 0);
  const std::string manifest = slurp(d / "ck" / "manifest.json");
  expect_refused(kRun + "--steps 4 --resume " + (d / "ck").string() + " --log " + (d / "ck" / "manifest.json").string(),
                 "lies in the --resume folder");
  EXPECT_EQ(slurp(d / "ck" / "manifest.json"), manifest);
  // An empty name (an unset shell variable) is refused, not read as "not given".
  for (const char* flag : {"--save", "--resume", "--log", "--trace", "--svg"})
    expect_refused(kRun + "--steps 2 " + flag + " ''", std::string(flag) + " was given an empty name");
  fs::remove_all(d);
}

TEST(TrainFiles, AFreshRunDoesNotSaveOverACheckpointUnlessTold) {
  const fs::path d = temp_dir("overwrite");
  const std::string ck = (d / "ck").string();
  ASSERT_EQ(run_pipetrain(kRun + "--steps 4 --save " + ck).code, 0);
  const std::string manifest = slurp(d / "ck" / "manifest.json");
  expect_refused(kRun + "--steps 2 --save " + ck, "holds a checkpoint at step 4 that this run does not resume from");
  EXPECT_EQ(slurp(d / "ck" / "manifest.json"), manifest);
  // Continuing it, or saying so, writes it.
  CommandResult r = run_pipetrain(kRun + "--steps 6 --resume " + ck + " --save " + ck);
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_pipetrain(kRun + "--steps 2 --save " + ck + " --overwrite");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_json_file(d / "ck" / "manifest.json").at("step"), 2);
  fs::remove_all(d);
}

TEST(TrainFiles, AResumeKeepsItsSeedItsLengthAndItsLog) {
  const fs::path d = temp_dir("resume");
  const std::string ck = (d / "ck").string(), log = (d / "log.jsonl").string();
  ASSERT_EQ(run_pipetrain(kRun + "--steps 4 --save " + ck + " --log " + log).code, 0);
  // Another seed is other synthetic data.
  expect_refused(kRun + "--steps 6 --resume " + ck + " --seed 5", "draws its samples from the seed");
  // Past its end: refused before any rank starts.
  expect_refused(kRun + "--steps 3 --resume " + ck, "is at step 4 and the run has 3 steps");
  // Without --steps, the saved run's length: make the checkpoint one of a 7-step run stopped at step 4,
  // whose log went on to step 6 (and a line cut short) before it stopped.
  nlohmann::json m = read_json_file(d / "ck" / "manifest.json");
  m["run"]["steps"] = 7;
  std::ofstream(d / "ck" / "manifest.json") << m.dump(1);
  {
    std::ofstream out(log, std::ios::app);
    out << R"({"step":5,"loss":9.0})" << "\n" << R"({"step":6,"loss":9.0})" << "\n" << R"({"step":7,"lo)";
  }
  const CommandResult r = run_pipetrain(kRun + "--resume " + ck + " --log " + log);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(log);
  std::vector<int> steps;
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line).at("step").get<int>());
  EXPECT_EQ(steps, (std::vector<int>{1, 2, 3, 4, 5, 6, 7})) << slurp(log);
  for (double loss : log_losses(log)) EXPECT_LT(loss, 9.0);  // the stopped run's lines are gone
  fs::remove_all(d);
}

TEST(TrainFiles, ATextIsRecognisedByItsContentNotItsPath) {
  const fs::path d = temp_dir("text");
  fs::create_directories(d / "other");
  std::string text;
  for (int i = 0; i < 300; ++i) text += "the quick brown fox " + std::to_string(i % 7) + "\n";
  std::ofstream(d / "my.txt") << text;
  std::string shuffled = text;
  std::reverse(shuffled.begin(), shuffled.end());
  std::ofstream(d / "other" / "my.txt") << shuffled;  // the same characters, another text
  const std::string gpt = "train --transport local --model gpt --layers 1 --d-model 16 --heads 2 --seq-len 8 "
                          "--sample 0 --eval-every 0 --progress quiet ";
  const std::string ck = (d / "ck").string();
  ASSERT_EQ(run_pipetrain(gpt + "--steps 2 --text " + (d / "my.txt").string() + " --save " + ck).code, 0);
  // The same file by another path resumes.
  CommandResult r = run_command("cd " + d.string() + " && " + std::string(PIPETRAIN_BIN) + " " + gpt +
                                "--steps 3 --text ./my.txt --resume ck --save ck");
  EXPECT_EQ(r.code, 0) << r.out;
  // Another text of the same name and characters does not.
  expect_refused(gpt + "--steps 4 --text " + (d / "other" / "my.txt").string() + " --resume " + ck, "does not match");
  fs::remove_all(d);
}

TEST(TrainFiles, FlagsThatChangedNothingAreRefused) {
  expect_refused(kRun + "--steps 2 --layers 0", "--layers must be >= 1, got 0");
  expect_refused(kRun + "--steps 2 --momentum 0.5", "--momentum is SGD's");
  expect_refused(kRun + "--steps 2 --data-dir /tmp", "drop --data-dir");
  // Under a launcher that started several processes, each would run the whole pipeline on its threads.
  const CommandResult r =
      run_command("env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 " + std::string(PIPETRAIN_BIN) + " " +
                  kRun + "--steps 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("--transport local runs every rank as a thread of one process")) << r.out;
}

// A tester's finding (2026-11-28): the held-out prompt and the sample quote the training text, and its
// escape sequences reached the terminal raw (ESC [2J cleared the screen); they are now shown as \xNN.
TEST(TrainFiles, TheSampleAndItsPromptShowControlBytesEscaped) {
  const fs::path dir = temp_dir("escapes");
  const std::string text = (dir / "esc.txt").string();
  {
    std::ofstream f(text, std::ios::binary);
    for (int i = 0; i < 100; ++i) f << "\x1b[2J\x1b]0;title\x07hello world\n";
  }
  const CommandResult r = run_pipetrain("train --transport local --text " + text + " --steps 1 --eval-every 0 "
                                        "--layers 1 --d-model 16 --heads 2 --seq-len 8 --sample 20 --progress quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("after the held-out prompt")) << r.out;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_TRUE(r.has("\\x1B")) << r.out;
  fs::remove_all(dir);
}
