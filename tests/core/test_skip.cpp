// Skip routes in the core layer (skip.h, docs/ALGORITHMS.md §1.10): the text form of skip transfers,
// route checks, lowering with skip transfers that validate, the simulator's waiting, transfer time and
// memory (P-BUNDLE-2), and the CSV forms.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "pipetrain/core/dependencies.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/torch_csv.h"
#include "pipetrain/core/validate.h"

using namespace pipetrain;

namespace {

Schedule make(const std::string& name, int p, int m) {
  GeneratorOptions o;
  o.ranks = p;
  o.microbatches = m;
  o.virtual_stages = name == "interleaved" ? 2 : 1;
  return generate(name, o);
}

const TimedAction& event_of(const SimResult& r, const Action& a) {
  for (const TimedAction& e : r.timeline.events)
    if (e.action == a) return e;
  throw std::logic_error("no event " + to_string(a));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Skip, TransferTextRoundTripsAndPairs) {
  for (const char* text : {"0SF2@3", "3RF2@0", "3SB2@0", "0RB2@3"}) {
    const Action a = parse_action(text);
    EXPECT_EQ(a.peer, text[std::string(text).size() - 1] - '0') << text;
    EXPECT_EQ(to_string(a), text);
    EXPECT_EQ(matching_comm(matching_comm(a)), a) << text;
    EXPECT_NE(a, parse_action(std::string(text).substr(0, std::string(text).find('@')))) << text;
  }
  EXPECT_EQ(matching_comm(parse_action("0SF2@3")), parse_action("3RF2@0"));
  EXPECT_EQ(matching_comm(parse_action("3SB2@0")), parse_action("0RB2@3"));
  EXPECT_EQ(to_string(parse_action("0SF2")), "0SF2");  // a neighbour transfer prints as before
  for (const char* bad : {"1F0@2", "0SF2@", "0SF2@x", "0SF@3"})
    EXPECT_THROW(parse_action(bad), UsageError) << bad;
}

TEST(Skip, RoutesAreChecked) {
  Schedule s = make("1f1b", 4, 4);
  EXPECT_EQ(parse_skip_route("0:3").size, 1.0);
  EXPECT_EQ(parse_skip_route("1:3:0.5").size, 0.5);
  for (const char* bad : {"0", "0:3:1:2", "a:3", "0:3x", "0:3:y"}) EXPECT_THROW(parse_skip_route(bad), UsageError) << bad;
  const std::pair<SkipEdge, const char*> cases[] = {
      {{3, 1, 1}, "to a later stage"},     {{2, 2, 1}, "to a later stage"}, {{1, 2, 1}, "neighbouring"},
      {{0, 4, 1}, "outside 0..3"},         {{0, 3, -1}, "size"},
  };
  for (const auto& [route, why] : cases) {
    s.skips = {route};
    const std::string msg = error_of([&] { check_skip_routes(s); });
    EXPECT_NE(msg.find(why), std::string::npos) << msg;
    EXPECT_THROW(simulate(s, CostModel::uniform(4, StageCost{})), UsageError);
    EXPECT_THROW(validate(s), UsageError);
  }
  s.skips = {{0, 3, 1}, {0, 3, 2}};
  EXPECT_NE(error_of([&] { check_skip_routes(s); }).find("repeats"), std::string::npos);
}

// For each synchronous generator the task names, p = 3 and 4, a skip from the first stage to the last:
// lowering adds exactly its four transfers per micro-batch, the result validates and strips back, the
// consumer's F never starts before the skip arrives (nor the producer's backward before its gradient),
// and a free skip (size / bandwidth = 0) never moves the makespan at uniform costs, whatever `comm`:
// the boundary chain from the producer to the consumer crosses at least one rank boundary, so the data
// arrives through it no earlier than the skip does (and the same holds for the gradient going back).
TEST(Skip, LoweredSchedulesValidateAndFreeSkipsNeverDelay) {
  for (const std::string name : {"gpipe", "1f1b", "interleaved", "zb-h1"})
    for (int p : {3, 4}) {
      const Schedule plain = make(name, p, 2 * p);
      Schedule s = plain;
      s.skips = {{0, s.stages - 1, 0.5}};
      ASSERT_NO_THROW(validate(s)) << name << " p=" << p;
      for (double comm : {0.0, 0.7}) {
        CostModel costs = CostModel::uniform(s.stages, StageCost{1, 1, 1, 1}, s.virtual_stages_per_rank(), comm);
        const Schedule lowered = insert_communication(s, costs);
        ASSERT_NO_THROW(validate(lowered)) << name << " p=" << p;
        EXPECT_EQ(strip_communication(lowered), s);
        int skip_transfers = 0;
        for (const auto& row : lowered.actions)
          skip_transfers += static_cast<int>(std::count_if(row.begin(), row.end(), [](const Action& a) { return a.peer >= 0; }));
        EXPECT_EQ(skip_transfers, 4 * s.microbatches) << name << " p=" << p;
        // Lowering without skips is what it was.
        EXPECT_EQ(strip_communication(insert_communication(plain, costs)), plain);

        costs.bandwidth = 0.25;  // a skip of 0.5 takes comm + 2
        const SimResult r = simulate(lowered, costs);
        const double transfer = skip_transfer_time(costs, s.skips[0]);
        EXPECT_DOUBLE_EQ(transfer, comm + 2.0);
        for (int i = 0; i < s.microbatches; ++i) {
          const double made = event_of(r, {ActionKind::F, 0, i}).end;
          EXPECT_GE(event_of(r, {ActionKind::F, s.stages - 1, i}).start, made + transfer - 1e-9) << name << " i=" << i;
          const ActionKind back = name == "zb-h1" ? ActionKind::B : ActionKind::BW;
          EXPECT_GE(event_of(r, {back, 0, i}).start, event_of(r, {back, s.stages - 1, i}).end + transfer - 1e-9)
              << name << " i=" << i;
        }
        costs.bandwidth = 0;  // free skips: the makespan of the schedule without them
        EXPECT_DOUBLE_EQ(simulate(s, costs).metrics.makespan, simulate(plain, costs).metrics.makespan)
            << name << " p=" << p << " comm=" << comm;
      }
    }
}

// GPipe, p = 3, m = 1, F = B = W = 1 (BW = 2), comm = 0, a skip 0 -> 2 of size 1 at bandwidth 0.1 (10 per
// transfer). Without it: F at 0, 1, 2, BW at 3, 5, 7, makespan 9. With it: F(2,0) waits for the skip made
// at 1 until 11, BW(2,0) runs 12-14, BW(1,0) 14-16, and BW(0,0) waits for the gradient made at 14 until
// 24, ending at 26.
TEST(Skip, SlowLinkDelaysByHand) {
  Schedule s = make("gpipe", 3, 1);
  CostModel costs = CostModel::uniform(3, StageCost{1, 1, 1, 1});
  EXPECT_DOUBLE_EQ(simulate(s, costs).metrics.makespan, 9.0);
  s.skips = {{0, 2, 1.0}};
  costs.bandwidth = 0.1;
  for (const Schedule& x : {s, insert_communication(s, costs)}) {
    const SimResult r = simulate(x, costs);
    EXPECT_DOUBLE_EQ(event_of(r, {ActionKind::F, 2, 0}).start, 11.0);
    EXPECT_DOUBLE_EQ(event_of(r, {ActionKind::BW, 1, 0}).end, 16.0);
    EXPECT_DOUBLE_EQ(event_of(r, {ActionKind::BW, 0, 0}).start, 24.0);
    EXPECT_DOUBLE_EQ(r.metrics.makespan, 26.0);
  }
}

// P-BUNDLE-2 by hand for 1F1B, unit costs, comm 0, a skip 0 -> p-1 of size x, m >= p. Stage 0 runs its p
// forwards at 0..p (skip i arrives at i + 1) before any backward reaches it; the last stage runs F(p-1,0)
// at p-1..p and BW(p-1,0) from p, when skips 0..p-1 have all arrived, on top of micro-batch 0's
// activation (1): the peak is 1 + p x. Skip p arrives only after BW(0,0), by when the last stage has
// released skip 0 and holds at most p again. The producer holds nothing extra, nor do the ranks between.
TEST(Skip, PeakMemoryOnTheConsumerByHand) {
  for (int p : {3, 4})
    for (int m : {p, p + 1, 2 * p}) {
      const Schedule plain = make("1f1b", p, m);
      Schedule s = plain;
      const double x = 0.25;
      s.skips = {{0, p - 1, x}};
      const CostModel costs = CostModel::uniform(p, StageCost{1, 1, 1, 1});
      const SimResult with = simulate(s, costs), without = simulate(plain, costs);
      const SimResult lowered = simulate(insert_communication(s, costs), costs);
      for (int r = 0; r < p; ++r) {
        const double extra = r == p - 1 ? p * x : 0.0;
        EXPECT_DOUBLE_EQ(with.metrics.per_rank[r].peak_memory, without.metrics.per_rank[r].peak_memory + extra)
            << "p=" << p << " m=" << m << " rank " << r;
        EXPECT_DOUBLE_EQ(lowered.metrics.per_rank[r].peak_memory, with.metrics.per_rank[r].peak_memory);
      }
      EXPECT_DOUBLE_EQ(without.metrics.per_rank[p - 1].peak_memory, 1.0);
    }
}

TEST(Skip, ValidatorNamesMissingAndMisplacedSkipTransfers) {
  Schedule s = make("1f1b", 3, 3);
  s.skips = {{0, 2, 1}};
  const Schedule lowered = insert_communication(s, CostModel{});
  // A missing receive.
  Schedule missing = lowered;
  auto& last = missing.actions[2];
  last.erase(std::find(last.begin(), last.end(), parse_action("2RF1@0")));
  EXPECT_NE(error_of([&] { validate(missing); }).find("misses the skip transfer 2RF1@0"), std::string::npos);
  // A send before the forward that makes it.
  Schedule early = lowered;
  auto& first = early.actions[0];
  first.erase(std::find(first.begin(), first.end(), parse_action("0SF0@2")));
  first.insert(first.begin(), parse_action("0SF0@2"));
  EXPECT_NE(error_of([&] { validate(early); }).find("before rank 0 has made it"), std::string::npos);
  // A transfer on a route the schedule does not declare.
  Schedule undeclared = lowered;
  undeclared.skips.clear();
  EXPECT_NE(error_of([&] { validate(undeclared); }).find("names no skip route"), std::string::npos);
  // The skip's receive moved after the forward that needs it: receives out of the senders' order block
  // (rendezvous), and the validator names the skip transfers it is stuck at.
  Schedule late = lowered;
  auto& row = late.actions[2];
  const auto f = std::find(row.begin(), row.end(), Action{ActionKind::F, 2, 0});
  const auto rf = std::find(row.begin(), row.end(), parse_action("2RF0@0"));
  ASSERT_LT(rf, f);
  std::rotate(rf, rf + 1, f + 1);
  const std::string late_msg = error_of([&] { validate(late); });
  EXPECT_NE(late_msg.find("deadlock"), std::string::npos) << late_msg;
  EXPECT_NE(late_msg.find("waits for rank 2 to reach 2RF0@0"), std::string::npos) << late_msg;
}

TEST(Skip, CsvCarriesRoutesAndTorchCsvRefusesThem) {
  Schedule s = make("zb-h1", 4, 4);
  s.skips = {{0, 3, 0.5}, {1, 3, 2}};
  const Schedule lowered = insert_communication(s, CostModel{});
  EXPECT_EQ(from_csv(to_csv(lowered)), lowered);
  EXPECT_NE(to_csv(lowered).find("skips=0:3:0.5,1:3:2"), std::string::npos);
  EXPECT_THROW(from_csv("# pipetrain schedule ranks=1 skips=0:x\n0F0,0BW0\n"), UsageError);
  EXPECT_NE(error_of([&] { to_torch_csv(lowered); }).find("skip"), std::string::npos);
  EXPECT_EQ(to_csv(make("zb-h1", 4, 4)).find("skips"), std::string::npos);  // without routes: as before
}

// Interleaved p = 2, v = 2: stages 0 and 2 both live on rank 0, so a skip 0 -> 2 moves nothing between
// ranks (no transfers, no transfer time) yet is still held on rank 0 from F(0, i) to W/BW(2, i).
TEST(Skip, ARouteWithinOneRankHasNoTransfers) {
  const Schedule plain = make("interleaved", 2, 4);
  ASSERT_EQ(plain.rank_of(0), plain.rank_of(2));
  Schedule s = plain;
  s.skips = {{0, 2, 0.5}};
  CostModel costs = CostModel::uniform(s.stages, StageCost{1, 1, 1, 1}, 2, 0.3);
  costs.bandwidth = 0.01;  // would cost 50 per transfer if any were made
  const Schedule lowered = insert_communication(s, costs);
  ASSERT_NO_THROW(validate(lowered));
  for (const auto& row : lowered.actions)
    for (const Action& a : row) EXPECT_LT(a.peer, 0) << to_string(a);
  const SimResult with = simulate(lowered, costs), without = simulate(insert_communication(plain, costs), costs);
  EXPECT_DOUBLE_EQ(with.metrics.makespan, without.metrics.makespan);
  EXPECT_GT(with.metrics.per_rank[0].peak_memory, without.metrics.per_rank[0].peak_memory);
  EXPECT_DOUBLE_EQ(with.metrics.per_rank[1].peak_memory, without.metrics.per_rank[1].peak_memory);
}

// The validator's memory limit counts skips in rank order. 1F1B p = 3, m = 4 with activations 0.1, 0.1, 1:
// rank 0 holds at most 0.3, rank 1 0.2, rank 2 1 (one micro-batch). A skip 0 -> 2 of 0.25 adds 0.25 on
// rank 2 from its F when unlowered (1.25); lowered, from its receive, which comes before F(2,0) for
// skip 0 at least, and at most all 4 skips are held (<= 2).
TEST(Skip, MemoryLimitCountsSkips) {
  Schedule s = make("1f1b", 3, 4);
  ValidateOptions o;
  o.costs = CostModel::uniform(3, StageCost{});
  for (int st = 0; st < 3; ++st) o.costs.stage[st].activation = st == 2 ? 1.0 : 0.1;
  o.memory_limit = 1.1;
  ASSERT_NO_THROW(validate(s, o));
  s.skips = {{0, 2, 0.25}};
  std::string msg = error_of([&] { validate(s, o); });
  EXPECT_NE(msg.find("rank 2 holds 1.25"), std::string::npos) << msg;
  o.memory_limit = 1.3;
  EXPECT_NO_THROW(validate(s, o));
  const Schedule lowered = insert_communication(s, CostModel{});
  o.memory_limit = 1.1;
  msg = error_of([&] { validate(lowered, o); });
  EXPECT_NE(msg.find("rank 2 holds"), std::string::npos) << msg;
  o.memory_limit = 2.0;
  EXPECT_NO_THROW(validate(lowered, o));
}
