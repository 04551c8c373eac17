// Checks the simulator on small schedules whose timelines are worked out by hand: start and end times,
// communication latency on cross-rank edges only, memory accounting (F adds, B frees its share, W the
// rest), step cost, and deadlock and bad-cost errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"

using namespace pipetrain;

namespace {
const TimedAction& find(const SimResult& r, const std::string& text) {
  for (const TimedAction& e : r.timeline.events)
    if (to_string(e.action) == text) return e;
  throw std::runtime_error("no " + text);
}
}  // namespace

TEST(Simulate, TwoStageTimelineByHand) {
  // p=2, m=2 1F1B, F=1, B=2, W=1 (BW=3), comm 0.5:
  //   0F0 [0,1]; 1F0 [1.5,2.5]; 0F1 [1,2]; 1BW0 [2.5,5.5]; 0BW0 waits for 1BW0 + 0.5 -> [6,9]
  //   1F1 needs 0F1 (end 2) + 0.5 and rank 1 free at 5.5 -> [5.5,6.5]; 1BW1 [6.5,9.5]
  //   0BW1 needs 1BW1 + 0.5 = 10 -> [10,13]; makespan 13.
  const Schedule s = one_f_one_b(2, 2);
  const SimResult r = simulate(s, CostModel::uniform(2, StageCost{1, 2, 1, 1}, 1, 0.5));
  EXPECT_DOUBLE_EQ(find(r, "1F0").start, 1.5);
  EXPECT_DOUBLE_EQ(find(r, "1BW0").end, 5.5);
  EXPECT_DOUBLE_EQ(find(r, "0BW0").start, 6.0);
  EXPECT_DOUBLE_EQ(find(r, "1F1").start, 5.5);
  EXPECT_DOUBLE_EQ(find(r, "0BW1").start, 10.0);
  EXPECT_DOUBLE_EQ(r.metrics.makespan, 13.0);
  EXPECT_DOUBLE_EQ(r.metrics.per_rank[0].busy, 8.0);
  EXPECT_DOUBLE_EQ(r.metrics.per_rank[1].span, 9.5 - 1.5);
  EXPECT_DOUBLE_EQ(r.metrics.bubble_fraction, 1.0 - 16.0 / (2 * 13.0));
}

TEST(Simulate, SameRankEdgesHaveNoCommLatency) {
  // Interleaved p=1, v=2: both chunks on rank 0, so comm never applies.
  const Schedule s = interleaved(1, 2, 2);
  const SimResult r = simulate(s, CostModel::uniform(2, StageCost{1, 1, 1, 1}, 2, 100.0));
  EXPECT_DOUBLE_EQ(r.metrics.makespan, 2 * 3.0);
}

TEST(Simulate, MemoryFollowsTheZeroBubbleConvention) {
  // One stage, F B W F B W with activation 2 and B releasing 1/4: peak is 2 after each F.
  const Schedule s = from_csv("0F0,0B0,0F1,0W0,0B1,0W1\n");
  CostModel c = CostModel::uniform(1, StageCost{1, 1, 1, 2});
  c.b_release_fraction = 0.25;
  // After 0F0: 2; 0B0: 1.5; 0F1: 3.5; 0W0: 2; 0B1: 1.5; 0W1: 0.
  EXPECT_DOUBLE_EQ(simulate(s, c).metrics.per_rank[0].peak_memory, 3.5);
  EXPECT_EQ(simulate(s, c).metrics.per_rank[0].peak_inflight, 2);
}

TEST(Simulate, StepCost) {
  CostModel c = CostModel::uniform(2, StageCost{});
  c.step = 0.5;
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(2, 2, 2), c).metrics.makespan, 2 * (3 * 3.0 + 0.5));
}

// Per-stage step costs (a replicated stage's gradient all-reduce) add to that stage's Step only. One
// step of 1f1b, p = 2, m = 2, F = 1, BW = 2: stage 0 steps at 9, stage 1 at 7.
TEST(Simulate, PerStageStepCost) {
  CostModel c = CostModel::uniform(2, StageCost{});
  c.step = 0.5;
  c.stage_step = {0.25, 3.0};
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(2, 2, 1), c).metrics.makespan, std::max(9 + 0.5 + 0.25, 7 + 0.5 + 3.0));
  c.stage_step = {0.25};
  EXPECT_THROW(simulate(one_f_one_b(2, 2, 1), c), UsageError);
  c.stage_step = {0.25, -1};
  EXPECT_THROW(simulate(one_f_one_b(2, 2, 1), c), UsageError);
}

TEST(Simulate, DeadlockAndBadCosts) {
  EXPECT_THROW(simulate(from_csv("0F0,0BW0,0F1,0BW1\n1F1,1BW1,1F0,1BW0\n"), CostModel::uniform(2, {})), ScheduleError);
  EXPECT_THROW(simulate(one_f_one_b(2, 2), CostModel::uniform(3, {})), UsageError);
  EXPECT_THROW(simulate(one_f_one_b(2, 2), CostModel::uniform(2, StageCost{-1, 1, 1, 1})), UsageError);
  EXPECT_THROW(parse_stage_costs("1:2"), UsageError);
  EXPECT_THROW(parse_stage_costs("1:x:1"), UsageError);
  EXPECT_THROW(parse_stage_costs("1:-2:1"), UsageError);
  EXPECT_EQ(parse_stage_costs("1:2:3,4:5:6").size(), 2u);
}

// A synchronous step is a barrier (the runtime's Step all-reduces the loss and gradient norm over every
// rank): rank 0 ran step 2's forwards while rank 3 was still in step 1, so zb-h2's two steps took 51, not
// two of its one-step 27. Asynchronous schedules have no such barrier.
TEST(Simulate, ASynchronousStepIsABarrierAcrossRanks) {
  const CostModel c = CostModel::uniform(4, StageCost{});
  for (const std::string name : {"zb-h2", "zb-h1", "1f1b", "zb-v"}) {
    GeneratorOptions o;
    o.ranks = 4;
    o.microbatches = 8;
    const Schedule one_step = generate(name, o);
    const CostModel c = CostModel::uniform(one_step.stages, StageCost{});  // zb-v: 8 stages
    const double one = simulate(one_step, c).metrics.makespan;
    o.steps = 2;
    const Schedule two = generate(name, o);
    const SimResult r = simulate(two, c);
    EXPECT_DOUBLE_EQ(r.metrics.makespan, 2 * one) << name;
    // No action of step 2 starts before every action of step 1 has ended.
    double first_of_2 = 1e300, last_of_1 = 0;
    for (const TimedAction& e : r.timeline.events) {
      const bool second = e.action.kind == ActionKind::Step ? e.action.index == 1 : e.action.index >= 8;
      if (second) first_of_2 = std::min(first_of_2, e.start);
      else last_of_1 = std::max(last_of_1, e.end);
    }
    EXPECT_GE(first_of_2, last_of_1 - 1e-9) << name;
  }
  GeneratorOptions a;
  a.ranks = 4;
  a.microbatches = 4;
  a.steps = 3;
  const Schedule pd = generate("pipedream", a);
  a.steps = 1;
  EXPECT_LT(simulate(pd, c).metrics.makespan, 3 * simulate(generate("pipedream", a), c).metrics.makespan);
}
