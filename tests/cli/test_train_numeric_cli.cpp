// What `pipetrain train` computes must not depend on how the work is cut. With --variable-length (lines
// of differing length, padded): the step's loss and gradients are the mini-batch's mean per real token
// for any --microbatches and --replicas (schedules that cannot give it are refused); the held-out score
// does not depend on --eval-batch; tokens/s counts real tokens, not padding. With --replicas and
// --dropout, each copy of the pipeline draws its own masks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::run_pipetrain;

namespace {

std::vector<nlohmann::json> log_lines(const fs::path& log) {
  std::vector<nlohmann::json> out;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// `lines` lines of random lower-case words, 5 to 40 characters each (a fixed generator: the same file
// every run).
void write_lines(const fs::path& path, int lines) {
  std::ofstream f(path);
  uint64_t x = 12345;
  auto next = [&x](uint64_t n) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return (x >> 33) % n;
  };
  for (int k = 0; k < lines; ++k) {
    const auto length = static_cast<std::size_t>(5 + next(36));
    std::string line;
    while (line.size() < length) {
      if (!line.empty()) line += ' ';
      const uint64_t word = 1 + next(7);
      for (uint64_t c = 0; c < word; ++c) line += static_cast<char>('a' + next(26));
    }
    f << line.substr(0, length) << "\n";
  }
}

void expect_close(double got, double want, const std::string& what, double rel = 1e-5) {
  EXPECT_NEAR(got, want, rel * std::abs(want)) << what;
}

class VariableLength : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = pipetrain::testing::fresh_temp_dir("numeric", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    write_lines(dir_ / "lines.txt", 200);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A small gpt on the lines, 2 stages in threads; `flags` add to (or override) these.
  std::string run(const std::string& flags, const std::string& log, int seq_len = 32) const {
    return "train --text " + (dir_ / "lines.txt").string() +
           " --variable-length --transport local --stages 2 --layers 2 --d-model 16 --heads 2 --seq-len " +
           std::to_string(seq_len) + " --batch-size 8 --sample 0 --progress quiet --log " + (dir_ / log).string() +
           " " + flags;
  }
  fs::path dir_;
};

}  // namespace

TEST_F(VariableLength, LossAndGradientsAreTheSameForAnySplit) {
  // Micro-batches of 8, 4, 2 samples and two replicas of 4 hold different numbers of real tokens: the
  // mean of each part's own token mean, weighted by its samples, was 2.9869 at m = 1 and 2.9624 at m = 2.
  std::vector<std::vector<nlohmann::json>> runs;
  const std::vector<std::string> splits = {"-m 1", "-m 2", "-m 4", "-m 2 --replicas 2", "-m 1 --schedule gpipe"};
  for (std::size_t k = 0; k < splits.size(); ++k) {
    const std::string log = "split" + std::to_string(k) + ".jsonl";
    const CommandResult r = run_pipetrain(run("--steps 2 --eval-every 0 " + splits[k], log));
    ASSERT_EQ(r.code, 0) << splits[k] << "\n" << r.out;
    runs.push_back(log_lines(dir_ / log));
    ASSERT_EQ(runs.back().size(), 2u) << splits[k];
  }
  for (std::size_t k = 1; k < runs.size(); ++k)
    for (std::size_t step = 0; step < 2; ++step) {
      const std::string what = splits[k] + " against " + splits[0] + ", step " + std::to_string(step + 1);
      expect_close(runs[k][step].at("loss").get<double>(), runs[0][step].at("loss").get<double>(), what + " loss");
      expect_close(runs[k][step].at("grad_norm").get<double>(), runs[0][step].at("grad_norm").get<double>(),
                   what + " gradient norm", 1e-4);
    }
  // PipeDream's first step runs the initial weights on the whole mini-batch (one micro-batch): the same
  // per-token loss.
  const CommandResult r = run_pipetrain(run("--steps 2 --eval-every 0 --schedule pipedream", "pipedream.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto pipedream = log_lines(dir_ / "pipedream.jsonl");
  ASSERT_EQ(pipedream.size(), 2u);
  expect_close(pipedream[0].at("loss").get<double>(), runs[0][0].at("loss").get<double>(), "pipedream step 1");
}

TEST_F(VariableLength, SchedulesWithoutAMiniBatchTokenCountAreRefused) {
  const CommandResult r = run_pipetrain(run("--steps 2 --eval-every 0 --schedule 2bw -m 2", "2bw.jsonl"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("--variable-length averages the loss over the mini-batch's real tokens")) << r.out;
  EXPECT_TRUE(r.has("--schedule 2bw")) << r.out;
}

TEST_F(VariableLength, HeldOutScoreDoesNotDependOnTheEvaluationBatch) {
  // 20 held-out lines in chunks of 1, 6 (6+6+6+2) and 20: each chunk's mean per token was weighted by its
  // lines, not its tokens.
  std::vector<nlohmann::json> last;
  for (const int chunk : {1, 6, 20}) {
    const std::string log = "eval" + std::to_string(chunk) + ".jsonl";
    const CommandResult r =
        run_pipetrain(run("--steps 1 --eval-every 1 --eval-samples 20 --eval-batch " + std::to_string(chunk), log));
    ASSERT_EQ(r.code, 0) << r.out;
    const auto lines = log_lines(dir_ / log);
    ASSERT_EQ(lines.size(), 1u);
    ASSERT_TRUE(lines[0].contains("eval_loss")) << lines[0].dump();
    last.push_back(lines[0]);
  }
  for (std::size_t k = 1; k < last.size(); ++k) {
    expect_close(last[k].at("eval_loss").get<double>(), last[0].at("eval_loss").get<double>(),
                 "held-out loss, chunk " + std::to_string(k), 1e-6);
    EXPECT_NEAR(last[k].at("eval_accuracy").get<double>(), last[0].at("eval_accuracy").get<double>(), 1e-9);
  }
}

TEST_F(VariableLength, TokensPerSecondCountRealTokensNotPadding) {
  // The lines hold at most 39 real tokens each: tokens/s over samples/s is the tokens of a sample, which
  // the context length (the padding) must not change; it was --seq-len itself.
  std::vector<std::vector<nlohmann::json>> runs;
  std::vector<std::string> outs;
  for (const int seq_len : {48, 128}) {
    const std::string log = "rate" + std::to_string(seq_len) + ".jsonl";
    const CommandResult r = run_pipetrain(run("--steps 3 --eval-every 0 --progress lines", log, seq_len));
    ASSERT_EQ(r.code, 0) << r.out;
    runs.push_back(log_lines(dir_ / log));
    outs.push_back(r.out);
    ASSERT_EQ(runs.back().size(), 3u);
  }
  for (std::size_t step = 0; step < 3; ++step) {
    const auto per_sample = [&](std::size_t k) {
      return runs[k][step].at("tokens_per_s").get<double>() / runs[k][step].at("samples_per_s").get<double>();
    };
    EXPECT_LE(per_sample(0), 39.0) << "step " << step + 1;
    EXPECT_GE(per_sample(0), 4.0) << "step " << step + 1;
    expect_close(per_sample(1), per_sample(0), "tokens per sample at --seq-len 128 and 48, step " + std::to_string(step + 1));
  }
  // The summary's rate likewise: tokens/s x the median step is at most 39 tokens per sample of 8.
  for (const std::string& out : outs) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(median step ([0-9.]+) ms, ([0-9.]+)([kM]?) tokens/s)"))) << out;
    const double scale = m[3] == "k" ? 1e3 : m[3] == "M" ? 1e6 : 1.0;
    const double tokens_per_step = std::stod(m[2]) * scale * std::stod(m[1]) / 1000.0;
    EXPECT_LT(tokens_per_step, 39.0 * 8 * 1.1) << out;
  }
}

TEST(ReplicaDropout, ReplicasDrawTheirOwnMasks) {
  // Every window of a text of one repeated character is the same sample: two replicas of one sample each
  // see what one pipeline of one sample sees. Without dropout they agree (the control); with dropout they
  // must not, as each replica draws its own masks (they drew the same ones, so the copies were one).
  const fs::path dir = pipetrain::testing::fresh_temp_dir("numeric", "dropout");
  {
    std::ofstream f(dir / "a.txt");
    f << std::string(5000, 'a') << "\n";  // the newline is in the held-out tail: training windows are all 'a'
  }
  const std::string common = "train --text " + (dir / "a.txt").string() +
                             " --transport local --stages 2 --layers 2 --d-model 16 --heads 2 --seq-len 16 -m 1 "
                             "--steps 1 --eval-every 0 --sample 0 --progress quiet --log ";
  auto loss_and_norm = [&](const std::string& flags, const std::string& log) {
    const CommandResult r = run_pipetrain(common + (dir / log).string() + " " + flags);
    EXPECT_EQ(r.code, 0) << flags << "\n" << r.out;
    const auto lines = log_lines(dir / log);
    if (lines.size() != 1u) return std::make_pair(-1.0, -1.0);
    return std::make_pair(lines[0].at("loss").get<double>(), lines[0].at("grad_norm").get<double>());
  };
  const auto one = loss_and_norm("--batch-size 1", "one.jsonl");
  const auto two = loss_and_norm("--batch-size 2 --replicas 2", "two.jsonl");
  expect_close(two.first, one.first, "without dropout, loss");
  expect_close(two.second, one.second, "without dropout, gradient norm", 1e-4);
  const auto one_d = loss_and_norm("--batch-size 1 --dropout 0.5", "one-dropout.jsonl");
  const auto two_d = loss_and_norm("--batch-size 2 --replicas 2 --dropout 0.5", "two-dropout.jsonl");
  ASSERT_GT(one_d.first, 0);
  EXPECT_GT(std::abs(two_d.first - one_d.first), 1e-4 * one_d.first)
      << "replicas drew the same dropout masks: loss " << two_d.first << " and " << one_d.first;
  fs::remove_all(dir);
}
