// Checks the validator: each kind of broken schedule is rejected with a message that says what is wrong
// and a step x rank grid with the offending cell marked; valid hand-written schedules pass.
#include <gtest/gtest.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/validate.h"

using namespace pipetrain;

namespace {

std::string rejection(const Schedule& s, const ValidateOptions& o = {}) {
  try {
    validate(s, o);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "accepted";
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "expected '" << part << "' in:\n" << text;
}

}  // namespace

TEST(Validate, HandWrittenCsvThatDeadlocksIsRejectedWithGrid) {
  // Rank 1 starts with micro-batch 1 while rank 0 finishes micro-batch 0 (whose backward needs rank 1)
  // before it forwards micro-batch 1: each waits for the other.
  const Schedule s = from_csv("0F0,0BW0,0F1,0BW1\n1F1,1BW1,1F0,1BW0\n");
  const std::string msg = rejection(s);
  expect_contains(msg, "deadlock: no rank can proceed");
  expect_contains(msg, "step x rank grid");
  expect_contains(msg, "[0BW0]");
  expect_contains(msg, "[1F1]");
  expect_contains(msg, "rank 0 is stuck at 0BW0: needs the input gradient of stage 1 micro-batch 0, which has not been made yet");
  expect_contains(msg, "rank 1 is stuck at 1F1: needs the activation of stage 0 micro-batch 1, which has not been made yet");
}

TEST(Validate, MissingAndDuplicateActions) {
  expect_contains(rejection(from_csv("0F0,0F1,0BW0\n")), "missing the backward of stage 0 micro-batch 1");
  expect_contains(rejection(from_csv("0F0,0BW0,0F0\n")), "0F0 appears twice");
  expect_contains(rejection(from_csv("0F0,0B0\n")), "0B0 has no matching 0W0");
  expect_contains(rejection(from_csv("0F0,0B0,0W0,0BW0\n")), "both a fused backward");
  const Schedule s = from_csv("# pipetrain schedule microbatches=2\n0F0,0BW0\n");
  expect_contains(rejection(s), "missing 0F1");
}

TEST(Validate, WrongOwnerAndRange) {
  Schedule s = one_f_one_b(2, 2);
  std::swap(s.actions[0][0], s.actions[1][0]);
  const std::string msg = rejection(s);
  expect_contains(msg, "which rank 1 owns, but it is on rank 0");
  expect_contains(msg, "[1F0]");
  Schedule t = one_f_one_b(2, 2);
  t.actions[0].push_back(Action{ActionKind::F, 0, 5});
  expect_contains(rejection(t), "names micro-batch 5 but the schedule has 2 micro-batches");
}

TEST(Validate, LocalOrder) {
  expect_contains(rejection(from_csv("0BW0,0F0\n")), "0BW0 runs before 0F0");
  expect_contains(rejection(from_csv("0F0,0W0,0B0\n")), "0W0 runs before 0B0");
  expect_contains(rejection(from_csv("0F0,0S0,0BW0\n")), "optimizer step must follow");
  // Synchronous two-step schedule whose second step starts before the first step's update.
  expect_contains(rejection(from_csv("# pipetrain schedule microbatches_per_step=1\n0F0,0F1,0BW0,0S0,0BW1,0S1\n")),
                  "flush");
  // The same order is fine for an asynchronous schedule.
  EXPECT_EQ(rejection(from_csv(
                "# pipetrain schedule microbatches_per_step=1 synchronous=0\n0F0,0F1,0BW0,0S0,0BW1,0S1\n")),
            "accepted");
}

TEST(Validate, MemoryLimit) {
  ValidateOptions o;
  o.memory_limit = 3;
  EXPECT_EQ(rejection(one_f_one_b(4, 8), ValidateOptions{4, {}}), "accepted");
  const std::string msg = rejection(gpipe(4, 8), o);
  expect_contains(msg, "rank 0 holds 4 micro-batches of activations after 0F3, above the memory limit 3");
  expect_contains(msg, "[0F3]");
}

TEST(Validate, LoweredSchedulesUseBlockingSemantics) {
  // The classic 1F1B deadlock: each send sits right after its producer, so rank 0 sends activation 1
  // while rank 1 sends gradient 0, and with blocking sends neither reaches its receive.
  const Schedule bad = from_csv(
      "0F0,0SF0,0F1,0SF1,0RB0,0BW0,0RB1,0BW1\n"
      "1RF0,1F0,1BW0,1SB0,1RF1,1F1,1BW1,1SB1\n");
  expect_contains(rejection(bad), "rank 0 is stuck at 0SF1: waits for rank 1 to reach 1RF1, but rank 1 is at 1SB0");
  // Moving rank 0's send after its receive resolves it.
  const Schedule good = from_csv(
      "0F0,0SF0,0F1,0RB0,0SF1,0BW0,0RB1,0BW1\n"
      "1RF0,1F0,1BW0,1SB0,1RF1,1F1,1BW1,1SB1\n");
  EXPECT_EQ(rejection(good), "accepted");
  const Schedule crossed = from_csv(
      "0F0,0SF0,0F1,0SF1,0RB0,0BW0,0RB1,0BW1\n"
      "1RF0,1F0,1BW0,1SB0,1BW1,1RF1,1F1,1SB1\n");
  // 1BW1 before 1F1 is a local order error, caught before the dry run.
  expect_contains(rejection(crossed), "1BW1 runs before 1F1");
  const Schedule deadlock = from_csv(
      "0F0,0SF0,0RB0,0BW0,0F1,0SF1,0RB1,0BW1\n"
      "1RF0,1RF1,1F0,1BW0,1SB0,1F1,1BW1,1SB1\n");
  const std::string msg = rejection(deadlock);
  expect_contains(msg, "sends and receives are blocking");
  expect_contains(msg, "rank 1 is stuck at 1RF1: waits for rank 0 to reach 0SF1, but rank 0 is at 0RB0");
  const Schedule missing_recv = from_csv("0F0,0SF0,0BW0\n1F0,1BW0\n");
  expect_contains(rejection(missing_recv), "misses");
}

TEST(Validate, GridWindowOnLongSchedules) {
  Schedule s = one_f_one_b(2, 64);
  const std::string grid = render_grid(s, {{1, 100}});
  expect_contains(grid, "steps 88..111 of 129");
  expect_contains(grid, "[" + to_string(s.actions[1][100]) + "]");
}
