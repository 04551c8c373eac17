// Issue 16, items D and E, as a user meets them: the README's interleaved example runs, --eval-every 0
// turns evaluation off, help texts tell the truth, and the demo gallery's titles agree with its table.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "run_command.h"

namespace {
using pipetrain::testing::run_pipetrain;

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

TEST(Issue16Cli, ReadmeInterleavedExampleRuns) {
  // The README's line without --layers failed ("use --stages <= 6"); with --layers 6 the gpt has the
  // 8 layers that 4 ranks x 2 virtual stages need.
  SKIP_WITHOUT_BIBLE();
  const auto r = run_pipetrain(
      "train --transport local --stages 4 --schedule interleaved --virtual 2 --layers 6 --steps 2 --sample 0 "
      "--eval-every 0 --progress quiet");
  EXPECT_EQ(r.code, 0) << r.out;
  const std::string readme = slurp(std::filesystem::path(PIPETRAIN_SOURCE_DIR) / "README.md");
  EXPECT_NE(readme.find("--schedule interleaved --virtual 2 --layers 6"), std::string::npos);
  EXPECT_EQ(readme.find("--config run.json"), std::string::npos);  // run.json is the trace written just before
}

TEST(Issue16Cli, EvalEveryZeroMeansNoEvaluation) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist"))
    GTEST_SKIP() << "dataset-fashion-mnist not installed (the mlp's held-out split)";
  const std::string base = "train --transport local --model mlp --stages 2 --steps 4 --eval-samples 64 --progress lines ";
  const auto on = run_pipetrain(base + "--eval-every 2");
  ASSERT_EQ(on.code, 0) << on.out;
  EXPECT_TRUE(on.has("eval at step 2")) << on.out;
  // --eval-samples with --eval-every 0 would do nothing: refused (2026-11-28), so the run without it.
  const auto refused = run_pipetrain(base + "--eval-every 0");
  EXPECT_EQ(refused.code, 2) << refused.out;
  EXPECT_TRUE(refused.has("--eval-every 0 makes none")) << refused.out;
  const auto off = run_pipetrain("train --transport local --model mlp --stages 2 --steps 4 --progress lines "
                                 "--eval-every 0");  // was: the default, ten evaluations
  ASSERT_EQ(off.code, 0) << off.out;
  EXPECT_FALSE(off.has("eval at step")) << off.out;
  EXPECT_FALSE(off.has("held-out:")) << off.out;
  const auto help = run_pipetrain("train --help");
  EXPECT_TRUE(help.has("0 = never")) << help.out;
  EXPECT_TRUE(help.has("--eval-samples")) << help.out;
  EXPECT_TRUE(help.has("gpt context length, default 64")) << help.out;  // said 128; the model's default is 64
}

TEST(Issue16Cli, DemoTitlesAgreeWithTheTable) {
  // pipedream.svg's title said m=1 beside a table row under "m=8 micro-batches per step": PipeDream steps
  // after every micro-batch, so both now say m=1 per step and the title counts the micro-batches.
  const auto dir = pipetrain::testing::fresh_temp_dir("issue16", "demo");
  const auto r = run_pipetrain("demo --out " + dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("pipedream m=1*")) << r.out;
  const std::string svg = slurp(dir / "pipedream.svg");
  EXPECT_NE(svg.find("pipedream  p=4  m=1 per step (16 micro-batches, 16 steps)"), std::string::npos) << svg.substr(0, 600);
  EXPECT_NE(slurp(dir / "gpipe.svg").find("m=8 per step (16 micro-batches, 2 steps)"), std::string::npos);
  std::filesystem::remove_all(dir);
}
