// `pipetrain selftest` checks what its flags say (-s, -m, -v, --replicas, the default schedule list) and
// its help states its own defaults; `pipetrain demo` refuses sizes that simulate nothing; the torch-free
// front copied without pipetrain-torch names the missing file. Threads (--transport local), small models:
// each command takes a second or two.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <regex>
#include <string>

#include "run_command.h"

namespace {

using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;
namespace fs = std::filesystem;

const std::string kLocal = "selftest --stages 2 --transport local ";

// The lines of a selftest run that checked or skipped `schedule`.
int lines_of(const CommandResult& r, const std::string& schedule, const std::string& what) {
  const std::regex line("(^|\n)" + schedule + " +p=[^\n]*" + what);
  return static_cast<int>(std::distance(std::sregex_iterator(r.out.begin(), r.out.end(), line), std::sregex_iterator()));
}

}  // namespace

TEST(SelftestCli, ShortScheduleAndMicrobatchFlagsCount) {
  // -s zb-v -m 8 ran the default schedules at m=1,3,8 and exited 0.
  const CommandResult r = run_pipetrain(kLocal + "-s zb-v -m 8");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("selftest over local: 1 passed, 0 failed")) << r.out;
  EXPECT_EQ(lines_of(r, "zb-v", "m=8 .* ok"), 1) << r.out;
  EXPECT_FALSE(r.has("gpipe")) << r.out;
  EXPECT_FALSE(r.has("m=1")) << r.out;
  // The long names too, and both forms at once are refused rather than one silently winning.
  const CommandResult l = run_pipetrain(kLocal + "--schedule gpipe --microbatches 3");
  ASSERT_EQ(l.code, 0) << l.out;
  EXPECT_TRUE(l.has("1 passed, 0 failed")) << l.out;
  EXPECT_EQ(lines_of(l, "gpipe", "m=3 .* ok"), 1) << l.out;
  const CommandResult both = run_pipetrain(kLocal + "-s gpipe --schedules 1f1b");
  EXPECT_EQ(both.code, 2) << both.out;
  EXPECT_TRUE(both.has("--schedule gpipe and --schedules")) << both.out;
  const CommandResult both_m = run_pipetrain(kLocal + "-m 2 --microbatch-counts 4");
  EXPECT_EQ(both_m.code, 2) << both_m.out;
  EXPECT_TRUE(both_m.has("--microbatches 2 and --microbatch-counts")) << both_m.out;
}

TEST(SelftestCli, TheAdviceOfATooSmallMicrobatchCountWorks) {
  // dualpipev cannot take m=1: that check is skipped with the reason, the others run.
  const CommandResult r = run_pipetrain(kLocal + "--schedules dualpipev --microbatch-counts 1 8");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(lines_of(r, "dualpipev", "m=1  skipped: .*--microbatches"), 1) << r.out;
  EXPECT_EQ(lines_of(r, "dualpipev", "m=8 .* ok"), 1) << r.out;
  EXPECT_TRUE(r.has("1 passed, 0 failed, 1 skipped")) << r.out;
  // Nothing left to check is an error naming the flag that fixes it, and that flag works.
  const CommandResult none = run_pipetrain(kLocal + "--schedules dualpipev -m 1");
  EXPECT_EQ(none.code, 2) << none.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(none.out, m, std::regex("use --microbatches ([0-9]+) or more"))) << none.out;
  const CommandResult advised = run_pipetrain(kLocal + "--schedules dualpipev --microbatches " + m[1].str());
  EXPECT_EQ(advised.code, 0) << advised.out;
  EXPECT_TRUE(advised.has("1 passed, 0 failed")) << advised.out;
}

TEST(SelftestCli, VirtualCounts) {
  // --virtual 3 checked v=2 without a word.
  const CommandResult r = run_pipetrain(kLocal + "--virtual 3 --schedules interleaved --layers 6 --microbatch-counts 4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(lines_of(r, "interleaved", "v=3 m=4 .* ok"), 1) << r.out;
  // Without --layers, enough of them for 3 stages per rank.
  const CommandResult d = run_pipetrain(kLocal + "-v 3 -s looped-bfs -m 2");
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_EQ(lines_of(d, "looped-bfs", "v=3 m=2 .* ok"), 1) << d.out;
  // A --virtual no schedule checked takes is refused, naming the ones that take it.
  const CommandResult bad = run_pipetrain(kLocal + "-v 3 -s 1f1b");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_TRUE(bad.has("--virtual 3 applies only to")) << bad.out;
}

TEST(SelftestCli, ReplicasCheckCopiesOfThePipeline) {
  // --replicas 2 checked one 4-stage pipeline over the 4 ranks (and with --layers 2 asked for fewer stages).
  const CommandResult r =
      run_pipetrain("selftest --transport local --schedules 1f1b --microbatch-counts 4 --replicas 2 --layers 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(lines_of(r, "1f1b", "2 replicas=2 m=4 .* ok"), 1) << r.out;
  EXPECT_TRUE(r.has("1 passed, 0 failed")) << r.out;
  // Several schedules, and copies placed a stage's side by side.
  const CommandResult z = run_pipetrain(
      "selftest --transport local --schedules gpipe zb-h1 interleaved --microbatch-counts 2 --replicas 2 "
      "--placement replicas-inner");
  ASSERT_EQ(z.code, 0) << z.out;
  EXPECT_TRUE(z.has("3 passed, 0 failed")) << z.out;
  // The check can fail: tolerance 0 asks bitwise equality, which GPipe misses at m >= 3 (it adds the micro-
  // batches' gradients in the reverse order of plain accumulation, and (a + b) + c is not (c + b) + a).
  const CommandResult f = run_pipetrain(
      "selftest --transport local --schedules gpipe --microbatch-counts 3 --replicas 2 --batch-size 12 --tolerance 0");
  EXPECT_EQ(f.code, 1) << f.out;
  EXPECT_TRUE(f.has("MISMATCH")) << f.out;
  const CommandResult odd = run_pipetrain(kLocal + "-s 1f1b -m 2 --replicas 2 --batch-size 7");
  EXPECT_EQ(odd.code, 2) << odd.out;
  EXPECT_TRUE(odd.has("--batch-size 7") && odd.has("--batch-size 8")) << odd.out;
  const CommandResult mixed = run_pipetrain("selftest --transport local -s 1f1b -m 2 --replicas 2 --replication 2,1");
  EXPECT_EQ(mixed.code, 2) << mixed.out;
  EXPECT_TRUE(mixed.has("do not combine")) << mixed.out;
}

TEST(SelftestCli, ReplicationIsChecked) {
  const CommandResult r = run_pipetrain("selftest --transport local --replication 2,1 --schedules 1f1b gpipe -m 4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("replication=2,1")) << r.out;
  EXPECT_TRUE(r.has("2 passed, 0 failed")) << r.out;
}

TEST(SelftestCli, APlansScheduleMicrobatchesAndBatchAreChecked) {
  const fs::path dir = pipetrain::testing::fresh_temp_dir("selftest", "plan");
  const std::string profile = (dir / "profile.json").string(), plan = (dir / "plan.json").string();
  ASSERT_EQ(run_pipetrain("profile --model mlp --data synthetic --hidden 16 --layers 4 --out " + profile).code, 0);
  ASSERT_EQ(run_pipetrain("plan --profile " + profile + " --ranks 2 --no-hybrid --out " + plan).code, 0);
  const nlohmann::json p = pipetrain::testing::read_json_file(plan);
  const std::string schedule = p.at("schedule").get<std::string>();
  const int m = p.at("microbatches").get<int>();
  const CommandResult r = run_pipetrain("selftest --transport local --layers 4 --plan " + plan);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(lines_of(r, schedule, "m=" + std::to_string(m) + "  loss .* ok"), 1) << p.dump() << "\n" << r.out;
  EXPECT_TRUE(r.has("1 passed, 0 failed")) << r.out;
  fs::remove_all(dir);
}

TEST(SelftestCli, DefaultChecksEverySynchronousSchedule) {
  const CommandResult r = run_pipetrain(kLocal);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has(" 0 failed")) << r.out;
  for (const std::string s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-auto", "zb-v", "v-half", "v-min",
                              "dualpipev", "interleaved-zb", "looped-bfs"})
    EXPECT_GE(lines_of(r, s, "  ok"), 1) << s << "\n" << r.out;
  for (const std::string s : {"pipedream", "2bw", "spectrain"}) EXPECT_FALSE(r.has(s)) << s << "\n" << r.out;
  // interleaved cannot order 3 micro-batches on 2 ranks: a line says it is skipped, the run goes on.
  EXPECT_EQ(lines_of(r, "interleaved", "m=3  skipped: "), 1) << r.out;
}

TEST(SelftestCli, HelpStatesSelftestsOwnDefaults) {
  const CommandResult r = run_pipetrain("selftest --help");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const std::string s : {"default mlp", "default synthetic", "gpt width, default 16", "attention heads, default 2",
                              "context length, default 8", "default 11", "default 16 (mlp)", "looped-bfs"})
    EXPECT_TRUE(r.has(s)) << s << "\n" << r.out;
  for (const std::string s : {"default gpt", "default 128", "default 256", "default: kjv", "default 1f1b"})
    EXPECT_FALSE(r.has(s)) << s << "\n" << r.out;
}

TEST(DemoCli, SizesThatSimulateNothingAreRefused) {
  const fs::path dir = pipetrain::testing::fresh_temp_dir("demo", "sizes");
  for (const std::string flag : {"--stages", "-p", "--microbatches", "-m", "--steps"}) {
    const fs::path out = dir / "dz";
    const CommandResult r = run_pipetrain("demo " + flag + " 0 --out " + out.string());
    EXPECT_EQ(r.code, 2) << flag << "\n" << r.out;
    const std::string name = flag == "-p" ? "--stages" : flag == "-m" ? "--microbatches" : flag;
    EXPECT_TRUE(r.has(name + " 0") && r.has("1 or more")) << flag << "\n" << r.out;
    EXPECT_FALSE(r.has("written")) << flag << "\n" << r.out;
    EXPECT_FALSE(fs::exists(out)) << flag;
  }
  // A cost no schedule takes: an error before --out is made, not a table of skips.
  const CommandResult c = run_pipetrain("demo --cost 1:x:1 --out " + (dir / "dc").string());
  EXPECT_EQ(c.code, 2) << c.out;
  EXPECT_FALSE(c.has("written")) << c.out;
  EXPECT_FALSE(fs::exists(dir / "dc"));
  // What it says it wrote, it wrote.
  const CommandResult ok = run_pipetrain("demo -p 2 -m 3 --steps 1 --out " + (dir / "ok").string());
  ASSERT_EQ(ok.code, 0) << ok.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(ok.out, m, std::regex("Chrome traces of the ([0-9]+) schedules simulated written")))
      << ok.out;
  int svgs = 0;
  for (const auto& e : fs::directory_iterator(dir / "ok")) svgs += e.path().extension() == ".svg";
  EXPECT_EQ(svgs, std::stoi(m[1])) << ok.out;
  fs::remove_all(dir);
}

TEST(MainFront, ACopyWithoutPipetrainTorchNamesTheMissingFile) {
  const fs::path dir = pipetrain::testing::fresh_temp_dir("front", "lone");
  fs::copy_file(PIPETRAIN_BIN, dir / "pipetrain");
  const CommandResult r = pipetrain::testing::run_command((dir / "pipetrain").string() + " train --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has((dir / "pipetrain-torch").string() + ", which does not exist")) << r.out;
  EXPECT_TRUE(r.has("cmake --install")) << r.out;
  EXPECT_FALSE(r.has("CORE_ONLY")) << r.out;
  // Present but not executable: said so.
  fs::copy_file(PIPETRAIN_BIN, dir / "pipetrain-torch");
  ::chmod((dir / "pipetrain-torch").c_str(), 0644);
  const CommandResult x = pipetrain::testing::run_command((dir / "pipetrain").string() + " selftest");
  EXPECT_EQ(x.code, 2) << x.out;
  EXPECT_TRUE(x.has("is not executable")) << x.out;
  // The torch-free commands still run alone.
  EXPECT_EQ(pipetrain::testing::run_command((dir / "pipetrain").string() + " schedule -s 1f1b -p 2 -m 2").code, 0);
  fs::remove_all(dir);
}

// Ranks started by hand with other flags: another seed was reported as a pipeline "MISMATCH" (a gradient
// error of 1.5), other schedules hung. Every rank now compares its settings first and names what differs.
TEST(SelftestCli, RanksStartedWithOtherFlagsAreToldWhatDiffers) {
  const std::string bin = PIPETRAIN_BIN;
  CommandResult r = pipetrain::testing::run_command(
      "timeout 60 " + bin + " launch -n 2 -- sh -c 'exec " + bin +
      " selftest --stages 2 --transport shm --schedules 1f1b --microbatch-counts 2 --seed $((1 + RANK))'");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("rank 1 was started with other settings than rank 0: --seed differs")) << r.out;
  EXPECT_FALSE(r.has("MISMATCH")) << r.out;
  r = pipetrain::testing::run_command(
      "timeout 60 " + bin + " launch -n 2 -- sh -c 'exec " + bin +
      " selftest --stages 2 --transport shm --microbatch-counts 2 --schedules $([ $RANK = 0 ] && echo 1f1b || echo gpipe)'");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("the checks (--schedules, --microbatch-counts, -s, -m, -v) differs")) << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
}
