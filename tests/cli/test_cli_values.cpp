// Values on the command line and in --config files that were read as something else than the user wrote
// (a tester's findings, 2026-11-28): integers in another base (`-p 010` ran 8 stages), empty numbers read as
// 0 (`--clip ""` turned clipping off), a value flag that took the next flag as its value (`--svg --json`
// wrote a file named "--json"), {"steps": false} dropped (the default 600 steps trained), a second
// --config replacing the first. Each is refused (exit 2) naming the flag and the fix; plain values still run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;

namespace {

void expect_refused(const std::string& args, const std::string& message) {
  const CommandResult r = run_pipetrain(args);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
  EXPECT_TRUE(r.has(message)) << args << "\n" << r.out;
}

}  // namespace

TEST(CliValues, IntegersInAnotherBaseOrWithADecimalPointAreRefused) {
  expect_refused("simulate -s 1f1b -p 010 -m 4", "--stages 010 has a leading zero (it would be read as octal): write 10");
  expect_refused("schedule -s gpipe -p 2 -m 0x10", "--microbatches 0x10 is hexadecimal: write the number in decimal");
  expect_refused("schedule -s gpipe -p 2 -m 8.0", "--microbatches takes a whole number, got 8.0: write 8");
  expect_refused("schedule -s gpipe -p 2 -m 1e1", "--microbatches takes a whole number, got 1e1: write 10");
  expect_refused("schedule -s gpipe -p 2 -m 2.5", "--microbatches takes a whole number, got 2.5");
  // Plain integers, 0, signs and floats where floats are taken still run.
  EXPECT_EQ(run_pipetrain("simulate -s 1f1b -p 2 -m 4 --cost 1:2:1 --comm 0").code, 0);
  EXPECT_EQ(run_pipetrain("simulate -s 1f1b -p +2 -m 10 --comm 0.5").code, 0);
  EXPECT_TRUE(run_pipetrain("schedule -s gpipe -p 2 -m 10").has("0F9"));
}

TEST(CliValues, EmptyNumbersAreRefusedNotReadAsZero) {
  expect_refused("train --model mlp --data synthetic --transport local --steps 1 --clip ''",
                 "--clip was given an empty value (an unset shell variable?): give a number, or drop --clip");
  expect_refused("train --model mlp --data synthetic --transport local --steps 1 --eval-every ''",
                 "--eval-every was given an empty value");
  expect_refused("simulate -s 1f1b -p 2 -m 4 --comm ''", "--comm was given an empty value");
  expect_refused("launch -n '' -- true", "was given an empty value");
}

TEST(CliValues, AValueFlagDoesNotTakeTheNextFlagAsItsValue) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("clivalues", "swallow");
  const CommandResult r =
      pipetrain::testing::run_command("cd " + d.string() + " && " + PIPETRAIN_BIN + " simulate -s 1f1b -p 2 -m 4 --svg --json");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("--svg took --json as its value, but that is a flag of this command: give --svg its value first"))
      << r.out;
  EXPECT_FALSE(fs::exists(d / "--json"));
  const CommandResult t = pipetrain::testing::run_command(
      "cd " + d.string() + " && " + PIPETRAIN_BIN +
      " train --model mlp --data synthetic --transport local --steps 1 --save --memory");
  EXPECT_EQ(t.code, 2) << t.out;
  EXPECT_TRUE(t.has("--save took --memory as its value")) << t.out;
  EXPECT_FALSE(fs::exists(d / "--memory"));
  expect_refused("simulate -s 1f1b -p 2 -m 4 --trace -p", "--trace took -p as its value");
  fs::remove_all(d);
}

TEST(CliValues, ConfigFilesFalseValuesTwoFilesAndDecimalIntegers) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("clivalues", "config");
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(d / name) << text;
    return (d / name).string();
  };
  const std::string train = "train --model mlp --data synthetic --transport local --progress quiet --config ";
  expect_refused(train + file("f.json", R"({"steps": false})"),
                 "key 'steps' is false, but --steps takes a value (false is only for on/off flags): give its value, "
                 "or drop the key");
  const std::string a = file("a.json", R"({"steps": 1})"), b = file("b.json", R"({"lr": 0.01})");
  expect_refused(train + a + " --config " + b, "--config is given twice (" + a + " and " + b + "): give one file");
  const CommandResult two = run_pipetrain(train + file("two.json", R"({"steps": 2.0})"));
  EXPECT_EQ(two.code, 2) << two.out;
  EXPECT_TRUE(two.has("--steps takes a whole number, got 2.0: write 2")) << two.out;
  EXPECT_TRUE(two.has("the value of --steps comes from key 'steps' of the --config file: fix it there")) << two.out;
  // An on/off flag set false stays off, and the run goes on.
  const CommandResult off = run_pipetrain(train + file("off.json", R"({"steps": 1, "memory": false})"));
  EXPECT_EQ(off.code, 0) << off.out;
  EXPECT_FALSE(off.has("heap model")) << off.out;
  // A --config after launch's command is the command's, not launch's.
  const CommandResult launched = run_pipetrain("launch -n 1 echo --config " + a);
  EXPECT_EQ(launched.code, 0) << launched.out;
  EXPECT_TRUE(launched.has("--config " + a)) << launched.out;
  fs::remove_all(d);
}

// `profile --layers 0` profiled the default depth (train refused it); `profile --vocab 0` drew a batch first and
// failed in LibTorch with a stack trace (exit 1); `selftest --tolerance nan` (or -1) called exact gradients a
// MISMATCH (exit 1).
TEST(CliValues, ModelFlagsAndTheToleranceAreCheckedBeforeAnyWork) {
  expect_refused("profile --model mlp --data synthetic --layers 0 --repeats 1 --warmup 0",
                 "--layers must be >= 1, got 0 (it built the default depth): give the layers, or drop --layers");
  expect_refused("selftest --layers 0 --transport local -s 1f1b -m 1", "--layers must be >= 1, got 0");
  const CommandResult vocab = run_pipetrain("profile --model gpt --data synthetic --vocab 0 --repeats 1 --warmup 0");
  EXPECT_EQ(vocab.code, 2) << vocab.out;
  EXPECT_TRUE(vocab.has("--vocab must be >= 1, got 0")) << vocab.out;
  EXPECT_FALSE(vocab.has("frame #")) << vocab.out;
  for (const char* t : {"nan", "-1"})
    expect_refused(std::string("selftest --stages 2 --transport local -s 1f1b -m 3 --tolerance ") + t,
                   "--tolerance must be a finite number >= 0");
}

// Without --virtual a looped schedule was the unlooped one under its name (interleaved = 1f1b's actions,
// looped-bfs = gpipe's); train refused it, schedule and simulate now do too.
TEST(CliValues, LoopedSchedulesWithoutVirtualStagesAreRefused) {
  for (const char* command : {"schedule", "simulate"}) {
    expect_refused(std::string(command) + " -s interleaved -p 2 -m 4",
                   "schedule 'interleaved' loops several stages over each rank, but --virtual is 1 (not given), which "
                   "gives plain 1F1B's order: give --virtual 2 or more, or ask for 1f1b");
    expect_refused(std::string(command) + " -s looped-bfs -p 2 -m 4 -v 1", "but --virtual is 1, which gives it without a loop");
    EXPECT_EQ(run_pipetrain(std::string(command) + " -s interleaved -p 2 -m 4 -v 2").code, 0);
  }
}

// Models past the host's memory: the cnn, resnet and unet counted only their input batch (--width 65536
// asked LibTorch for 144 GiB and failed with a stack trace, --blocks 100000 grew for 30 s to bad_alloc), and
// profile and selftest checked nothing. Each is refused before anything is built, with the flags to change.
// The sizes need tens of TiB at least, past any host this suite runs on (the check compares with the host's memory).
TEST(CliValues, ModelsPastTheHostsMemoryAreRefusedBeforeTheyAreBuilt) {
  const std::string train = "train --transport local --steps 1 --eval-every 0 ";
  const std::pair<std::string, std::string> rows[] = {
      {train + "--model cnn --width 65536", "use a smaller --width, --hidden or --batch-size"},
      {train + "--model resnet --blocks 100000000", "use a smaller --width, fewer --blocks or a smaller --batch-size"},
      {train + "--model unet --width 100000", "use a smaller --width or --batch-size"},
      {"profile --model gpt --data synthetic --d-model 10000000 --heads 1 --repeats 1 --warmup 0",
       "a smaller --d-model, --seq-len, --vocab or --microbatch-size"},
      {"profile --model mlp --data synthetic --microbatch-size 2000000000 --repeats 1 --warmup 0",
       "a smaller --hidden or --microbatch-size"},
      {"selftest --model mlp --data synthetic --batch-size 100000000000 --transport local -s 1f1b -m 1",
       "a smaller --hidden or --batch-size"},
  };
  for (const auto& [args, fix] : rows) {
    // ulimit keeps a regression from taking the machine's memory.
    const CommandResult r = pipetrain::testing::run_command("ulimit -v 8000000; " + std::string(PIPETRAIN_BIN) + " " + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(r.has("of memory")) << args << "\n" << r.out;
    EXPECT_TRUE(r.has(fix)) << args << "\n" << r.out;
    EXPECT_FALSE(r.has("frame #")) << args << "\n" << r.out;
  }
}

// Values that ran as something else (a tester's findings, 2026-11-28): an unsigned flag wrapped -1 to 2^64 - 1,
// `--warmup -1` meant "the default", `--temperature inf` sampled uniform noise, `launch --grace 1e16` overflowed
// to a negative grace, `simulate --profile P --comm 5` dropped --comm; commands without --config suggested it.
TEST(CliValues, ValuesThatRanAsSomethingElseAreRefused) {
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt --pipedream-batch 128";
  expect_refused("plan --profile " + vgg + " --ranks 2 --planner umpipe --generations 2 --seed -1",
                 "--seed takes a whole number >= 0, got -1");
  const std::string train = "train --model mlp --data synthetic --transport local --steps 1 ";
  expect_refused(train + "--warmup -1", "--warmup must be >= 0, got -1 (drop it for 5% of the steps)");
  expect_refused(train + "--temperature inf", "--temperature must be a finite number > 0, got inf");
  expect_refused("launch -n 2 --grace 1e16 -- true", "--grace 1e+16 must be a number of seconds from 0 to 31536000");
  expect_refused("launch -n 1 --timeout 0.0001 -- true", "is under a millisecond");
  expect_refused("simulate -s 1f1b -p 2 -m 4 --profile " + vgg + " --comm 5", "--comm was ignored: drop --comm");
  const CommandResult typo = run_pipetrain("simulate -s 1f1b -p 2 -m 4 --confg x.json");
  EXPECT_TRUE(typo.has("pipetrain simulate has no flag --confg\n")) << typo.out;
  EXPECT_TRUE(run_pipetrain("train --confg x.json").has("did you mean --config?"));
}

// An unknown command was reported as "A subcommand is required" (one was given), and `zoo --help` printed the
// general help with exit 0.
TEST(CliValues, AnUnknownCommandIsSaidToBeOne) {
  expect_refused("zoo", "pipetrain: error: 'zoo' is not a command\n");
  expect_refused("zoo --help", "'zoo' is not a command");
  expect_refused("trian --steps 1", "'trian' is not a command; did you mean 'train'?");
  EXPECT_FALSE(run_pipetrain("zoo").has("A subcommand is required"));
  EXPECT_EQ(run_pipetrain("--help").code, 0);
}

// profile under a launcher without --transport or --concurrent ran in every process, each measuring (the
// ranks contending for the cores) and writing the same --out; a rank-count mismatch advised "--stages".
TEST(CliValues, ProfileUnderALauncherRunsAsItsRanksOrSaysHow) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("clivalues", "profile-launch");
  const std::string out = (d / "p.json").string();
  const std::string profile = std::string(PIPETRAIN_BIN) + " profile --model mlp --data synthetic --threads 1 "
                                                           "--repeats 1 --warmup 0 --microbatch-size 2 --out " + out;
  const CommandResult r = run_pipetrain("launch -n 2 -- " + profile);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("a launcher started 2 processes, but pipetrain profile runs 1 rank(s) here")) << r.out;
  EXPECT_TRUE(r.has("give --concurrent 2")) << r.out;
  EXPECT_FALSE(fs::exists(out));
  const CommandResult two = run_pipetrain("launch -n 2 -- " + profile + " --concurrent 2");
  EXPECT_EQ(two.code, 0) << two.out;
  EXPECT_TRUE(fs::exists(out));
  const CommandResult shm = pipetrain::testing::run_command("RANK=0 WORLD_SIZE=1 " + profile + " --transport shm");
  EXPECT_EQ(shm.code, 2) << shm.out;
  EXPECT_TRUE(shm.has("launch 2 (pipetrain launch -n 2 -- ...)")) << shm.out;
  EXPECT_FALSE(shm.has("--stages")) << shm.out;
  fs::remove_all(d);
}
