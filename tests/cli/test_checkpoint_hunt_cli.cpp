// `pipetrain train`'s checkpoints and stops, found by a tester: a second run saving to the same --save
// folder is refused at start-up (exit 2, naming the folder and the other run's pid), with threads and
// with rank processes, and a run killed with SIGKILL does not block the next; a stop asked for during
// an asynchronous call that holds the rest of the run is reported ("stopped by", 128 + N) after the
// end's checkpoint instead of the run ending "successfully" with exit 1 and no word.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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

// A tester's finding (2026-11-28): `train --resume CK` took the checkpoint's model, data and optimizer
// name but trained on with the default learning rate, schedule, warm-up, clip, weight decay, momentum,
// batch and pipeline schedule: another training, exit 0. They are the checkpoint's now where not given
// (the losses continue bitwise), and a given one that differs wins with a note naming it.
TEST(CheckpointHunt, ResumeTakesTheTrainingSettingsItWasNotGiven) {
  const fs::path dir = fresh_temp_dir("adopt", "settings");
  const std::string run = " train --model gpt --layers 2 --d-model 16 --heads 2 --seq-len 8 --vocab 16 --data synthetic "
                          "--transport local --eval-every 0 --sample 0 --progress quiet";
  // A constant rate without warm-up, so that a 3-step run is the first half of the 6-step one; every
  // other setting differs from the defaults (lr 3e-3 cosine, 5% warm-up, batch 32, m=4, clip 1, 1f1b).
  const std::string settings = " --lr 1e-3 --lr-schedule constant --warmup 0 --batch-size 8 -m 2 --clip 0.5 "
                               "--weight-decay 0.01 --momentum 0.5 --optimizer sgd --schedule gpipe";
  CommandResult r = run_pipetrain(run + settings + " --steps 6 --log " + (dir / "whole.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain(run + settings + " --steps 3 --save " + (dir / "ck").string());
  ASSERT_EQ(r.code, 0) << r.out;
  // Only --resume: the checkpoint's settings and pipeline, and the losses go on bitwise as in one run.
  r = run_pipetrain(" train --resume " + (dir / "ck").string() + " --steps 6 --transport local "
                    "--eval-every 0 --sample 0 --progress quiet --log " + (dir / "rest.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("schedule gpipe, m=2, batch 8")) << r.out;
  EXPECT_TRUE(r.has("optimizer sgd lr 0.001 (constant), clip 0.5")) << r.out;
  const std::vector<double> whole = log_loss_values(dir / "whole.jsonl"), rest = log_loss_values(dir / "rest.jsonl");
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(rest.size(), 3u);
  for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(rest[k], whole[k + 3]) << k;
  // At another stage count (a new shape: the command line's schedule), the training settings still hold:
  // the losses agree to float rounding.
  r = run_pipetrain(" train --resume " + (dir / "ck").string() + " --steps 6 --stages 1 --transport local "
                    "--eval-every 0 --sample 0 --progress quiet --log " + (dir / "one.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("optimizer sgd lr 0.001 (constant), clip 0.5")) << r.out;
  const std::vector<double> one = log_loss_values(dir / "one.jsonl");
  ASSERT_EQ(one.size(), 3u);
  for (std::size_t k = 0; k < 3; ++k) EXPECT_NEAR(one[k], whole[k + 3], 1e-5 * std::abs(whole[k + 3])) << k;
  // A given setting that differs (a lower learning rate after a spike): the flag given wins, and the run
  // says so before it starts, naming each difference.
  for (const auto& [flag, named] : std::vector<std::pair<std::string, std::string>>{
           {" --lr 3e-3", "optimizer.lr"}, {" --batch-size 16", "batch_size"}, {" --clip 1", "optimizer.clip"},
           {" --warmup 2", "optimizer.warmup"}, {" --lr-schedule cosine", "optimizer.lr_schedule"},
           {" --schedule pipedream", "schedule: gpipe in the checkpoint, pipedream in this run"}}) {
    r = run_pipetrain(" train --resume " + (dir / "ck").string() + " --steps 4 --transport local --eval-every 0 "
                      "--sample 0 --progress quiet" + flag);
    EXPECT_EQ(r.code, 0) << flag << "\n" << r.out;
    EXPECT_TRUE(r.has("note: resuming " + (dir / "ck").string() + " with other settings")) << flag << "\n" << r.out;
    EXPECT_TRUE(r.has(named)) << flag << "\n" << r.out;
  }
  // The pipeline's shape may change: another synchronous schedule and micro-batch count resume.
  r = run_pipetrain(" train --resume " + (dir / "ck").string() + " --steps 4 --transport local --eval-every 0 "
                    "--sample 0 --progress quiet --schedule 1f1b -m 4");
  EXPECT_EQ(r.code, 0) << r.out;
  fs::remove_all(dir);
}

// The same for an asynchronous run's weight policy and call length, and for the precision: a resumed
// pipedream --no-stash run went on stashing, a bf16 run in fp32.
TEST(CheckpointHunt, ResumeTakesTheAsynchronousSettingsAndThePrecision) {
  const fs::path dir = fresh_temp_dir("adopt", "async");
  const std::string run = " train --model gpt --layers 2 --d-model 16 --heads 2 --seq-len 8 --vocab 16 --data synthetic "
                          "--transport local --eval-every 0 --sample 0 --progress quiet";
  const std::string quiet = " --transport local --eval-every 0 --sample 0 --progress quiet";
  CommandResult r = run_pipetrain(run + " --schedule pipedream -m 1 --batch-size 8 --no-stash --steps 3 --save " +
                                  (dir / "ns").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain(" train --resume " + (dir / "ns").string() + " --steps 5" + quiet);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("schedule pipedream (weights: current")) << r.out;
  // Its manifest given for the folder (a common slip) is named as a file, with the folder to pass.
  r = run_pipetrain(" train --resume " + (dir / "ns" / "manifest.json").string() + " --steps 5" + quiet);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("is a file; a checkpoint is the folder a save wrote: pass " + (dir / "ns").string())) << r.out;
  r = run_pipetrain(" train --resume " + (dir / "ns").string() + " --steps 5 --vertical-sync" + quiet);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("asynchronous.vertical_sync")) << r.out;
  EXPECT_TRUE(r.has("schedule pipedream (weights: vertical-sync")) << r.out;
  r = run_pipetrain(run + " --precision bf16 --batch-size 8 --steps 2 --save " + (dir / "bf").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain(" train --resume " + (dir / "bf").string() + " --steps 3" + quiet);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("precision bf16")) << r.out;
  r = run_pipetrain(" train --resume " + (dir / "bf").string() + " --steps 3 --precision fp32" + quiet);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("precision: \"bf16\" in the checkpoint")) << r.out;
  // An interleaved checkpoint from before the manifest recorded virtual stages: its schedule is not taken
  // (without its --virtual it was refused), the command line's is, and the run resumes.
  r = run_pipetrain(run + " --schedule interleaved --virtual 2 --stages 2 --batch-size 8 -m 4 --steps 2 --save " +
                    (dir / "il").string());
  ASSERT_EQ(r.code, 0) << r.out;
  {
    nlohmann::json m = nlohmann::json::parse(read_text(dir / "il" / "manifest.json"));
    m["run"].erase("virtual_stages");
    std::ofstream(dir / "il" / "manifest.json") << m.dump(2) << "\n";
  }
  r = run_pipetrain(" train --resume " + (dir / "il").string() + " --steps 3" + quiet);
  EXPECT_EQ(r.code, 0) << r.out;
  fs::remove_all(dir);
}

// A tester's finding (2026-11-28): a SIGKILL between a save's last marker removal and its rename left the
// run's newest checkpoint, complete, in DIR.partial; every later --save DIR called it "not made by
// pipetrain" and advised moving it away, and --resume DIR (on a first save) said only that DIR does not
// exist. Both states are made by hand here: each message names the newer checkpoint and how to continue.
TEST(CheckpointHunt, ACompleteCheckpointLeftInPartialIsNamedNotCalledForeign) {
  const fs::path dir = fresh_temp_dir("partial-left", "cli");
  const std::string ck = (dir / "ck").string(), keep = (dir / "keep").string();
  const std::string run = "train" + kMlp + " --transport local --lr-schedule constant";
  ASSERT_EQ(run_pipetrain(run + " --steps 2 --save " + ck).code, 0);
  fs::copy(ck, keep);  // the checkpoint at step 2
  ASSERT_EQ(run_pipetrain(run + " --steps 4 --resume " + ck + " --save " + ck).code, 0);  // step 4, replaces step 2's
  fs::rename(ck, ck + ".partial");
  fs::rename(keep, ck);
  CommandResult r = run_pipetrain(run + " --steps 6 --resume " + ck + " --save " + ck);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("holds a complete checkpoint at step 4, newer than " + ck + "'s (step 2)")) << r.out;
  EXPECT_TRUE(r.has("mv " + ck + " " + ck + ".step-2 && mv " + ck + ".partial " + ck)) << r.out;
  EXPECT_FALSE(r.has("not made by pipetrain")) << r.out;
  EXPECT_TRUE(fs::exists(fs::path(ck + ".partial") / "manifest.json"));  // nothing moved or deleted

  // A first save stopped so: no DIR, the only checkpoint in DIR.partial.
  fs::remove_all(ck);
  r = run_pipetrain(run + " --steps 6 --save " + ck);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("holds a complete checkpoint at step 4")) << r.out;
  r = run_pipetrain(run + " --steps 6 --resume " + ck);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has(ck + ".partial holds a complete checkpoint")) << r.out;
  fs::remove_all(dir);
}

// A hand-edited manifest whose "run" section held a value of another type ("layers": "4") stopped
// --resume with a bare "[json.exception.type_error.302] type must be number, but is string", exit 1.
TEST(CheckpointHunt, AManifestRunSectionOfAnotherTypeIsNamed) {
  const fs::path dir = fresh_temp_dir("run-types", "cli");
  const std::string ck = (dir / "ck").string();
  const std::string run = "train" + kMlp + " --transport local";
  ASSERT_EQ(run_pipetrain(run + " --steps 2 --save " + ck).code, 0);
  const fs::path manifest = fs::path(ck) / "manifest.json";
  const nlohmann::json original = nlohmann::json::parse(read_text(manifest));
  for (const auto& edit : {std::make_pair(std::string("/run/model/layers"), nlohmann::json("4")),
                           std::make_pair(std::string("/run/optimizer"), nlohmann::json("adam"))}) {
    nlohmann::json m = original;
    m[nlohmann::json::json_pointer(edit.first)] = edit.second;
    std::ofstream(manifest) << m.dump(2);
    const CommandResult r = run_pipetrain("train --transport local --progress quiet --steps 3 --resume " + ck);
    EXPECT_EQ(r.code, 2) << edit.first << "\n" << r.out;
    EXPECT_TRUE(r.has("its \"run\" section")) << edit.first << "\n" << r.out;
  }
  fs::remove_all(dir);
}

// A checkpoint recorded its --text as typed ("fox.txt"): a resume from another folder looked for it there
// and blamed a --text nobody gave. The name is now recorded absolute; an older checkpoint's relative name
// that is not there is said to be relative to the folder that run started in.
TEST(CheckpointHunt, ATextNamedRelativelyIsFoundOrExplained) {
  const fs::path dir = fresh_temp_dir("relative-text", "cli"), a = dir / "a";
  fs::create_directories(a);
  {
    std::ofstream text(a / "fox.txt");
    for (int i = 0; i < 200; ++i) text << "the quick brown fox jumps over the lazy dog. ";
  }
  const std::string bin = PIPETRAIN_BIN;
  const std::string flags = " --transport local --eval-every 0 --sample 0 --progress quiet --layers 1 --d-model 16 "
                            "--heads 2 --seq-len 8";
  CommandResult r = pipetrain::testing::run_command("cd " + a.string() + " && " + bin + " train --text fox.txt" +
                                                    flags + " --steps 2 --save ck");
  ASSERT_EQ(r.code, 0) << r.out;
  r = pipetrain::testing::run_command("cd " + dir.string() + " && " + bin + " train --resume a/ck" + flags +
                                      " --steps 3 --save a/ck");
  EXPECT_EQ(r.code, 0) << r.out;
  const fs::path manifest = a / "ck" / "manifest.json";
  nlohmann::json m = nlohmann::json::parse(read_text(manifest));
  m["run"]["data"]["file"] = "fox.txt";  // as an older pipetrain recorded it
  std::ofstream(manifest) << m.dump(2);
  r = pipetrain::testing::run_command("cd " + dir.string() + " && " + bin + " train --resume a/ck" + flags +
                                      " --steps 4");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("was trained on the text fox.txt (a name relative to the folder that run started in)")) << r.out;
  fs::remove_all(dir);
}

// A resume drops the log's lines after its checkpoint and a JSON line cut short by a crash; a note the
// user appended without a final newline was deleted too, without a word. It stays now.
TEST(CheckpointHunt, AResumeKeepsAnUnterminatedNoteInTheLog) {
  const fs::path dir = fresh_temp_dir("log-note", "cli");
  const std::string ck = (dir / "ck").string(), log = (dir / "l.jsonl").string();
  const std::string run = "train" + kMlp + " --transport local";
  ASSERT_EQ(run_pipetrain(run + " --steps 2 --save " + ck + " --log " + log).code, 0);
  { std::ofstream(log, std::ios::app) << "# my notes about this run: lr too high"; }
  const CommandResult r = run_pipetrain(run + " --steps 4 --resume " + ck + " --save " + ck + " --log " + log);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string text = read_text(log);
  EXPECT_NE(text.find("# my notes about this run: lr too high\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\"step\":4"), std::string::npos) << text;
  fs::remove_all(dir);
}

// A tester's finding (2026-11-28): a resumed run whose --log another run was writing replaced that file
// (dropping its later steps by a rename) before it took the log's lock: the other run's whole log was
// lost and both said "written". The lock comes first now: the resumed run is refused, the file untouched.
TEST(CheckpointHunt, AResumeDoesNotRewriteALogAnotherRunHolds) {
  const fs::path dir = fresh_temp_dir("log-held", "cli");
  const std::string ck = (dir / "ck").string(), log = (dir / "l.jsonl").string();
  const std::string run = "train" + kMlp + " --transport local";
  ASSERT_EQ(run_pipetrain(run + " --steps 4 --save " + ck + " --log " + log).code, 0);
  ASSERT_EQ(run_pipetrain(run + " --steps 2 --save " + ck + " --overwrite").code, 0);  // a checkpoint at step 2
  const std::string before = read_text(log);  // steps 1..4: a resume at 2 would drop 3 and 4
  const int fd = ::open(log.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);  // another run writing it
  const CommandResult r = run_pipetrain(run + " --steps 4 --resume " + ck + " --log " + log);
  ::close(fd);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("is being written by another run now")) << r.out;
  EXPECT_EQ(read_text(log), before);
  // Unheld, the same resume drops steps 3 and 4 and logs them again.
  const CommandResult again = run_pipetrain(run + " --steps 4 --resume " + ck + " --log " + log);
  ASSERT_EQ(again.code, 0) << again.out;
  const std::string after = read_text(log);
  EXPECT_EQ(std::count(after.begin(), after.end(), '\n'), 4) << after;
  for (const char* step : {"\"step\":1", "\"step\":2", "\"step\":3", "\"step\":4"})
    EXPECT_NE(after.find(step), std::string::npos) << step << "\n" << after;
  fs::remove_all(dir);
}

// A tester's finding (2026-11-28): --save DIR on a mount point (a container's volume) trained the whole run,
// then could not rename the new checkpoint over DIR ("Device or resource busy") and deleted it. It is
// refused at start-up now; the save's own fallback keeps a complete checkpoint that cannot take DIR's
// place aside (DIR.step-N) instead of deleting it.
TEST(CheckpointHunt, AMountPointAsTheSaveFolderIsRefusedBeforeTraining) {
  const fs::path dir = fresh_temp_dir("mount-point", "cli"), ck = dir / "ck";
  fs::create_directories(ck);
  if (pipetrain::testing::run_command("mount -t tmpfs -o size=16m tmpfs " + ck.string()).code != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (not root, or no mount permission in this container)";
  const CommandResult r = run_pipetrain("train" + kMlp + " --transport local --steps 2 --save " + ck.string());
  pipetrain::testing::run_command("umount " + ck.string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("is a mount point")) << r.out;
  EXPECT_TRUE(r.has("--save " + (ck / "run1").string())) << r.out;
  fs::remove_all(dir);
}

// Two runs with one --log (the same command started twice): the second emptied the first's log, which then
// filled with NUL bytes up to the first run's offset, and both exited 0. The second is refused now, and the
// first's lines stay.
TEST(CheckpointHunt, ASecondRunWritingTheSameLogIsRefused) {
  const fs::path dir = fresh_temp_dir("same-log", "cli");
  const std::string log = (dir / "same.jsonl").string();
  const pid_t a = start_pipetrain("train" + kMlp + " --transport local --steps 1000000 --log " + log, dir / "a.out");
  ASSERT_GT(a, 0);
  bool logging = false;  // the first run's first line is there
  for (int i = 0; i < 1200 && !logging; ++i) {
    logging = read_text(log).find("\"step\"") != std::string::npos;
    if (!logging) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(logging) << read_text(dir / "a.out");
  const CommandResult r = run_pipetrain("train" + kMlp + " --transport local --steps 2 --log " + log);
  ::kill(-a, SIGKILL);
  int status = 0;
  ::waitpid(a, &status, 0);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("is being written by another run now")) << r.out;
  const std::string text = read_text(log);
  EXPECT_EQ(text.find('\0'), std::string::npos);
  EXPECT_EQ(text.rfind("{\"", 0), 0u) << text.substr(0, 80);  // its first line is still the first run's
  fs::remove_all(dir);
}

// Under a file-size limit (ulimit -f) a write past it killed the run with SIGXFSZ without a word (exit 153);
// ignored, the write fails with EFBIG and the log's writer says so.
TEST(CheckpointHunt, AFileSizeLimitIsReportedNotAKill) {
  const fs::path dir = fresh_temp_dir("fsize", "cli");
  const std::string log = (dir / "fz.jsonl").string();
  const CommandResult r = pipetrain::testing::run_command(
      "ulimit -f 20 && " + std::string(PIPETRAIN_BIN) + " train" + kMlp + " --transport local --steps 400 --log " + log);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(r.has("File too large")) << r.out.substr(r.out.size() > 2000 ? r.out.size() - 2000 : 0);
  fs::remove_all(dir);
}

// A run trained with --data-dir DIR resumed without it on the default Fashion-MNIST folder, without a
// word: the checkpoint records the folder now, and a resume takes it where --data-dir is not given.
TEST(CheckpointHunt, AResumeTrainsOnTheImagesFolderItWasTrainedOn) {
  const fs::path images = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(images)) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  const fs::path dir = fresh_temp_dir("data-dir", "cli"), copy = dir / "fm-copy";
  fs::create_directories(copy);
  for (const auto& e : fs::directory_iterator(images)) fs::create_symlink(e.path(), copy / e.path().filename());
  const std::string ck = (dir / "ck").string();
  const std::string run = "train --model mlp --batch-size 8 --eval-every 0 --transport local";
  CommandResult r = run_pipetrain(run + " --data-dir " + copy.string() + " --steps 2 --save " + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain(run + " --steps 3 --resume " + ck + " --save " + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("Fashion-MNIST (" + copy.string() + ")")) << r.out;
  fs::remove_all(dir);
}
