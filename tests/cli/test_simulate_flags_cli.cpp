// schedule/simulate flags that did nothing without a word (a tester's findings, 2026-11-28): a negative
// --memory-limit read as no limit, --microbatch-size 0 as the profile's, --cost beside --profile, sizes
// beside --load, --skip-bandwidth without skips. Each is now exit 2 naming the flag and the fix; what
// agrees with the file is still accepted.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;

TEST(SimulateFlags, FlagsThatDidNothingAreRefused) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("simflags", "refused");
  const std::string csv = (d / "s.csv").string();
  ASSERT_EQ(run_pipetrain("schedule -s 1f1b -p 2 -m 4 --steps 2 --format csv > " + csv, false).code, 0);
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const std::pair<std::string, std::string> rows[] = {
      {"simulate -s gpipe -p 2 -m 2 --memory-limit -5", "--memory-limit must be >= 0"},
      {"simulate -s 1f1b -p 2 -m 2 --profile " + vgg + " --pipedream-batch 128 --microbatch-size 0",
       "--microbatch-size must be > 0"},
      {"simulate -s 1f1b -p 2 -m 2 --profile " + vgg + " --pipedream-batch 128 --cost 1:2:1", "drop one"},
      {"simulate --load " + csv + " -p 3", "--stages 3 but " + csv + " has 2"},
      {"simulate --load " + csv + " -m 8", "--microbatches 8 but " + csv + " has 4"},
      {"schedule --load " + csv + " --steps 1", "--steps 1 but " + csv + " has 2"},
      {"simulate -s 1f1b -p 2 -m 2 --skip-bandwidth 4", "this schedule has no skip routes"},
      {"simulate -s 1f1b -p 2 -m 2 --comm 1e308", "1e+308 must be finite, >= 0 and at most 1e12"},
  };
  for (const auto& [args, words] : rows) {
    const CommandResult r = run_pipetrain(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(r.has(words)) << args << "\n" << r.out;
  }
  // What agrees with the file runs.
  const CommandResult r = run_pipetrain("simulate --load " + csv + " -p 2 -m 4 --steps 2");
  EXPECT_EQ(r.code, 0) << r.out;
  fs::remove_all(d);
}

// The flags that shape a profile's costs did nothing without --profile (a tester's findings, 2026-11-28):
// each is refused by name, with the fix, in simulate and schedule alike; with --profile they still run.
TEST(SimulateFlags, ProfileFlagsWithoutAProfileAreRefused) {
  const std::string flags[] = {"--balance memory", "--balance 1,1", "--balance-solver block-partition",
                               "--bandwidth 1", "--latency 5", "--microbatch-size 16", "--pipedream-batch 128"};
  for (const std::string command : {"simulate -s 1f1b -p 2 -m 2 ", "schedule -s 1f1b -p 2 -m 2 "})
    for (const std::string& flag : flags) {
      const CommandResult r = run_pipetrain(command + flag);
      const std::string name = flag.substr(0, flag.find(' '));
      EXPECT_EQ(r.code, 2) << command << flag << "\n" << r.out;
      EXPECT_TRUE(r.has(name + " applies with --profile")) << command << flag << "\n" << r.out;
      EXPECT_TRUE(r.has("add --profile FILE, or drop " + name)) << command << flag << "\n" << r.out;
    }
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const CommandResult r = run_pipetrain("simulate -s 1f1b -p 2 -m 2 --profile " + vgg +
                                        " --pipedream-batch 128 --balance 17,22 --balance-solver block-partition "
                                        "--bandwidth 1 --latency 5 --microbatch-size 16");
  EXPECT_EQ(r.code, 0) << r.out;
}

// A PipeDream graph file read without --pipedream-batch is read at batch 1 (33809 ms instead of 264 ms for
// VGG-16 at micro-batch 16): simulate and schedule warn as plan does, once.
TEST(SimulateFlags, APipeDreamGraphWithoutItsBatchIsWarnedAbout) {
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const std::string warning = "is a PipeDream graph file, read as profiled at batch size 1";
  const CommandResult at_1 = run_pipetrain("simulate --profile " + vgg + " -s 1f1b -p 2 -m 2 --microbatch-size 16 "
                                           "--replication 1,1 --json");
  EXPECT_EQ(at_1.code, 0) << at_1.out;
  EXPECT_TRUE(at_1.has("pipetrain simulate: warning: " + vgg + " " + warning)) << at_1.out;
  EXPECT_TRUE(at_1.has("give --pipedream-batch N")) << at_1.out;
  std::size_t count = 0;
  for (std::size_t at = at_1.out.find(warning); at != std::string::npos; at = at_1.out.find(warning, at + 1)) ++count;
  EXPECT_EQ(count, 1u) << at_1.out;  // once, though a replicated run reads the profile twice
  const CommandResult at_128 = run_pipetrain("simulate --profile " + vgg + " -s 1f1b -p 2 -m 2 --microbatch-size 16 "
                                             "--pipedream-batch 128 --replication 1,1 --json", false);
  EXPECT_EQ(at_128.code, 0) << at_128.out;
  EXPECT_FALSE(at_128.has(warning)) << at_128.out;
  const double m1 = nlohmann::json::parse(at_1.out.substr(at_1.out.find('{'))).at("makespan").get<double>();
  const double m128 = nlohmann::json::parse(at_128.out).at("makespan").get<double>();
  EXPECT_GT(m1, 100 * m128);  // the times of batch 1 scaled to 16 samples, against those of 128
  const CommandResult sched = run_pipetrain("schedule -s zb-h2 -p 2 -m 4 --profile " + vgg);
  EXPECT_EQ(sched.code, 0) << sched.out;
  EXPECT_TRUE(sched.has("pipetrain schedule: warning: " + vgg + " " + warning)) << sched.out;
  EXPECT_FALSE(run_pipetrain("schedule -s zb-h2 -p 2 -m 4 --pipedream-batch 128 --profile " + vgg).has(warning));
}

// A tester's findings (2026-11-28, second round): plan's genetic-algorithm flags did nothing without
// --planner umpipe; a V or looped schedule whose p x v stages exceed a profile's layers was told to use
// "--stages <= L", which it already did.
TEST(SimulateFlags, FlagsOfAnotherPlannerAndStagesPerRankAreNamed) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("simflags", "planner");
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  for (const std::string flag : {"--generations 5", "--seed 7", "--fit affine", "--overhead 3", "--no-rematerialise"}) {
    const CommandResult r = run_pipetrain("plan --profile " + vgg + " --pipedream-batch 128 --ranks 4 " + flag);
    EXPECT_EQ(r.code, 2) << flag << "\n" << r.out;
    EXPECT_TRUE(r.has("applies with --planner umpipe")) << flag << "\n" << r.out;
  }
  const CommandResult lists = run_pipetrain("plan --profile " + vgg + " --pipedream-batch 128 --ranks 4 --no-hybrid "
                                            "--balances 10,10,10,9 --schedules interleaved");
  EXPECT_EQ(lists.code, 2) << lists.out;
  EXPECT_TRUE(lists.has("--balances 10,10,10,9 lists 4 stages, and only plans that cut that many")) << lists.out;
  const std::string prof = (d / "m4.json").string();
  {
    std::ofstream f(prof);
    f << R"({"format":"pipetrain-profile","version":1,"model":"m4","micro_batch_size":1,"threads":1,"layers":[)";
    for (int i = 0; i < 4; ++i)
      f << (i ? "," : "") << R"({"name":"l)" << i
        << R"(","type":"Linear","forward_ms":1,"backward_ms":2,"activation_bytes":1000,"parameter_bytes":1000,"optimizer_bytes":2000})";
    f << "]}";
  }
  const std::pair<std::string, std::string> rows[] = {
      {"simulate -s zb-v -p 3 -m 6 --profile " + prof, "6 stages (2 on each of the 3 ranks) but the profile has 4 "
                                                        "layers: use --stages <= 2"},
      {"simulate -s interleaved -p 2 -m 4 -v 3 --profile " + prof, "use --stages <= 1 or a smaller --virtual"},
  };
  for (const auto& [args, words] : rows) {
    const CommandResult r = run_pipetrain(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(r.has(words)) << args << "\n" << r.out;
  }
  EXPECT_EQ(run_pipetrain("simulate -s zb-v -p 2 -m 4 --profile " + prof).code, 0);
  fs::remove_all(d);
}

// The torch-free commands wrote their outputs over the files they read (`simulate --profile p --svg p`
// replaced a measured profile; `plan --out` over its --profile; `--svg x --trace x` kept one), and an
// empty name (an unset variable) wrote nothing with exit 0; train refused both. --json --ascii dropped
// the timeline.
TEST(SimulateFlags, OutputsOverInputsAndEmptyNamesAreRefused) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("simflags", "outputs");
  const std::string vgg = (d / "v.txt").string(), csv = (d / "s.csv").string(), x = (d / "x.out").string();
  fs::copy_file(std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt", vgg);
  ASSERT_EQ(run_pipetrain("schedule -s 1f1b -p 2 -m 2 --format csv > " + csv, false).code, 0);
  const std::string before = [&] {
    std::ifstream f(vgg);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();
  const std::string prof = " --profile " + vgg + " --pipedream-batch 128";
  const std::pair<std::string, std::string> rows[] = {
      {"simulate -s 1f1b -p 2 -m 2" + prof + " --svg " + vgg, "--svg " + vgg + " is the file --profile reads"},
      {"simulate -s 1f1b -p 2 -m 2" + prof + " --trace " + vgg, "--trace " + vgg + " is the file --profile reads"},
      {"simulate --load " + csv + " --svg " + csv, "is the file --load reads"},
      {"plan" + prof + " --ranks 2 --out " + vgg, "--out " + vgg + " is the file --profile reads"},
      {"schedule --load " + csv + " --out " + csv, "is the file --load reads"},
      {"simulate -s 1f1b -p 2 -m 2 --svg " + x + " --trace " + x, "--trace and --svg both write"},
      {"simulate -s 1f1b -p 2 -m 2 --svg ''", "--svg was given an empty name"},
      {"simulate -s 1f1b -p 2 -m 2 --trace ''", "--trace was given an empty name"},
      {"schedule -s 1f1b -p 2 -m 2 --out ''", "--out was given an empty name"},
      {"plan" + prof + " --ranks 2 --out ''", "--out was given an empty name"},
      {"simulate -s 1f1b -p 2 -m 2 --json --ascii", "drop one"},
      {"profile --model mlp --data synthetic --repeats 1 --out ''", "--out was given an empty name"},
      {"profile --text " + csv + " --layers 1 --d-model 16 --seq-len 8 --repeats 1 --out " + csv,
       "--out " + csv + " is the file --text reads"},
      {"profile --model mlp --data-dir " + d.string() + " --repeats 1 --out " + (d / "p.json").string(),
       "lies in the --data-dir folder"},
      // The default folder, without --data-dir, when it is read (root may write there).
      {"profile --model mlp --repeats 1 --out /usr/share/datasets/fashion-mnist/p.json",
       "lies in the Fashion-MNIST folder /usr/share/datasets/fashion-mnist, which holds the data this profile reads"},
  };
  for (const auto& [args, words] : rows) {
    const CommandResult r = run_pipetrain(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(r.has(words)) << args << "\n" << r.out;
  }
  std::ifstream f(vgg);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), before);  // the profile is untouched
  EXPECT_FALSE(fs::exists(x));
  fs::remove_all(d);
}

// demo printed gpipe's and 1f1b's closed forms under --comm and per-stage costs too, where its own table
// (gpipe 72, 1f1b 82 with --comm 0.5, against the formula's 66) contradicts them.
TEST(SimulateFlags, DemoStatesTheClosedFormsOnlyWhereTheyHold) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("simflags", "demo");
  const CommandResult plain = run_pipetrain("demo --out " + (d / "a").string());
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_TRUE(plain.has("For gpipe and 1f1b the makespan is")) << plain.out;
  for (const std::string extra : {" --comm 0.5", " --cost 1:2:1,1:1:1,1:1:1,2:2:2"}) {
    const CommandResult r = run_pipetrain("demo --out " + (d / "b").string() + extra);
    ASSERT_EQ(r.code, 0) << extra << "\n" << r.out;
    EXPECT_FALSE(r.has("For gpipe and 1f1b the makespan is")) << extra << "\n" << r.out;
    EXPECT_TRUE(r.has("do not hold: the table is the simulation's")) << extra << "\n" << r.out;
  }
  fs::remove_all(d);
}

// --config FILE is train's: other commands read the file, checked its keys, then failed with CLI11's "The
// following arguments were not expected: FILE --config". info's --config is a switch of its own.
TEST(SimulateFlags, ConfigFilesAreTrainsAndSaidSo) {
  const fs::path d = pipetrain::testing::fresh_temp_dir("simflags", "config");
  const std::string file = (d / "sc.json").string();
  std::ofstream(file) << R"({"stages": 2, "schedule": "1f1b", "microbatches": 4})";
  for (const std::string command : {"simulate", "schedule", "plan"}) {
    const CommandResult r = run_pipetrain(command + " --config " + file);
    EXPECT_EQ(r.code, 2) << command << "\n" << r.out;
    EXPECT_TRUE(r.has("--config FILE is not a flag of pipetrain " + command)) << command << "\n" << r.out;
    EXPECT_FALSE(r.has("were not expected")) << command << "\n" << r.out;
  }
  EXPECT_EQ(run_pipetrain("info --config").code, 0);
  fs::remove_all(d);
}

// "PREFIX" followed by x with 3 decimals, as the table prints it.
static std::string fmt_3(const std::string& prefix, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", x);
  return prefix + buf;
}

// A profile's costs are milliseconds and bytes, yet the table showed bare numbers (peak memory in bytes),
// and the SVG and trace said "units" (a tester's finding, 2026-11-28). Hand-given costs keep their units.
TEST(SimulateFlags, AProfilesTimesAreShownInMillisecondsAndItsMemoryInMiB) {
  const std::string dir = pipetrain::testing::fresh_temp_dir("simflags", "units").string();
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const CommandResult r = run_pipetrain("simulate -s 1f1b -p 2 -m 4 --profile " + vgg + " --pipedream-batch 64 --svg " +
                                        dir + "/t.svg --trace " + dir + "/t.json");
  ASSERT_EQ(r.code, 0) << r.out;
  // The figures are --json's (ms and bytes, as the profile gives them), shown in ms and MiB.
  const CommandResult j = run_pipetrain("simulate -s 1f1b -p 2 -m 4 --profile " + vgg + " --pipedream-batch 64 --json",
                                        false);
  const nlohmann::json sim = nlohmann::json::parse(j.out);
  EXPECT_TRUE(r.has(fmt_3("makespan ", sim.at("makespan").get<double>()) + " ms   bubble")) << r.out;
  EXPECT_TRUE(r.has("busy ms")) << r.out;
  EXPECT_TRUE(r.has("peak MiB")) << r.out;
  const double peak_bytes = sim.at("per_stage").at(0).at("peak_memory").get<double>();
  EXPECT_TRUE(r.has(fmt_3(" ", peak_bytes / 1048576.0) + "\n")) << r.out;  // stage 0's row ends with it
  EXPECT_FALSE(r.has(fmt_3(" ", peak_bytes))) << r.out;                        // not in bytes
  for (const auto& [file, unit] : {std::pair<const char*, const char*>{"/t.svg", "time (ms)"}, {"/t.json", "\"unit\":\"ms\""}}) {
    std::ifstream in(dir + file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.find("units"), std::string::npos) << file;
    EXPECT_NE(text.find(unit), std::string::npos) << file;
  }
  // Hand-given costs keep their units: (m + p - 1)(F + B + W) = 5 x 3 at the default 1:1:1.
  const CommandResult plain = run_pipetrain("simulate -s 1f1b -p 2 -m 4 --svg " + dir + "/u.svg");
  EXPECT_TRUE(plain.has("makespan 15.000   bubble")) << plain.out;
  std::ifstream in(dir + "/u.svg");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("makespan=15 units"), std::string::npos);
  fs::remove_all(dir);
}
