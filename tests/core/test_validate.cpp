// Checks the validator: each kind of broken schedule is rejected with a message that says what is wrong
// and a step x rank grid with the offending cell marked; valid hand-written schedules pass.
#include <gtest/gtest.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/heap.h"
#include "pipetrain/core/simulate.h"
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

// The advice names only schedules that hold fewer micro-batches in flight than the one given (it named 1f1b
// and zb-h1 to a 1f1b schedule, and to v-min, which holds fewer than both).
TEST(Validate, MemoryLimitAdvisesOnlySchedulesThatHoldFewer) {
  auto advice = [](const Schedule& s, double limit) {
    ValidateOptions o;
    o.memory_limit = limit;
    const std::string msg = rejection(s, o);
    const std::string head = msg.substr(0, msg.find('\n'));
    const auto at = head.find("above the memory limit");
    return at == std::string::npos ? head : head.substr(at);
  };
  GeneratorOptions g;
  g.ranks = 4;
  g.microbatches = 8;
  const std::string for_1f1b = advice(generate("1f1b", g), 2);
  expect_contains(for_1f1b, "fewer micro-batches in flight than this one's 4 (at p=4, m=8, equal activations: v-min");
  expect_contains(for_1f1b, "v-half");
  for (const char* name : {"(1f1b", " 1f1b", "zb-h1", "gpipe", "zb-h2", "zb-v"})
    EXPECT_EQ(for_1f1b.find(name), std::string::npos) << name << " in: " << for_1f1b;
  const std::string for_vmin = advice(generate("v-min", g), 1);
  expect_contains(for_vmin, "no other built-in schedule holds fewer micro-batches in flight than this one's");
  for (const char* name : {"1f1b", "zb-h1", "v-half"})
    EXPECT_EQ(for_vmin.find(name), std::string::npos) << name << " in: " << for_vmin;
  // gpipe (m in flight) gets the 1F1B family too, the fewest first.
  const std::string for_gpipe = advice(generate("gpipe", g), 3);
  expect_contains(for_gpipe, "1f1b 4");
  EXPECT_LT(for_gpipe.find("v-min"), for_gpipe.find("1f1b")) << for_gpipe;
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

// A schedule built by hand (C++ or Python) reaches simulate, lowering, the heap model and the CSV writer
// without validate(): a default Schedule, an action with a negative micro-batch, rows that disagree with
// `ranks`, replicas on missing ranks. Each was a segfault or a heap corruption; each is now refused with
// validate's message.
TEST(CheckRanges, EveryConsumerRefusesASchedulesOutOfRangeParts) {
  std::vector<std::pair<std::string, Schedule>> broken;
  broken.emplace_back("a default Schedule", Schedule{});
  Schedule negative = gpipe(2, 2);
  negative.actions[0].push_back(Action{ActionKind::F, 0, -1});
  broken.emplace_back("micro-batch -1", negative);
  Schedule rows = one_f_one_b(2, 2);
  rows.ranks = 3;
  broken.emplace_back("3 ranks, 2 rows", rows);
  Schedule past = one_f_one_b(2, 2);
  past.actions[1].push_back(Action{ActionKind::BW, 1, 7});
  broken.emplace_back("micro-batch 7 of 2", past);
  Schedule send = one_f_one_b(2, 2);
  send.actions[1].insert(send.actions[1].begin(), Action{ActionKind::SendAct, 1, 0});  // to stage 2: none
  broken.emplace_back("a send past the last stage", send);
  Schedule replicas = one_f_one_b(2, 2);
  replicas.stage_replicas = {{0}, {1, 9}};
  broken.emplace_back("a replica on rank 9", replicas);
  for (const auto& [what, s] : broken) {
    SCOPED_TRACE(what);
    const CostModel costs = CostModel::uniform(std::max(s.stages, 1), StageCost{});
    EXPECT_THROW(check_ranges(s), ScheduleError);
    EXPECT_THROW(simulate(s, costs), ScheduleError);
    EXPECT_THROW(insert_communication(s, costs), ScheduleError);
    EXPECT_THROW(predict_heap(s, costs), ScheduleError);
    EXPECT_THROW(to_csv(s), ScheduleError);
    // The grid that draws the error draws the rows there are.
    EXPECT_NE(render_grid(s, {{0, 0}}).find("step x rank grid"), std::string::npos);
  }
  // What validate() alone refuses (an incomplete schedule) still simulates as written.
  Schedule incomplete = one_f_one_b(2, 2);
  incomplete.actions[0].pop_back();
  EXPECT_NO_THROW(check_ranges(incomplete));
  EXPECT_THROW(validate(incomplete), ScheduleError);
}

TEST(CheckRanges, ACsvHeaderItsCellsExceedIsRefusedOnLoading) {
  const std::string text =
      "# pipetrain schedule name=x ranks=2 stages=2 microbatches=1 microbatches_per_step=1 synchronous=1 "
      "stage_rank=0:1\n0F0,0F1,0BW0,0BW1\n1F0,1BW0,1F1,1BW1\n";
  try {
    from_csv(text);
    FAIL() << "accepted";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("micro-batch 1 but the schedule has 1 micro-batches"), std::string::npos)
        << e.what();
  }
}
