// Checks the cost model's runtime terms (issue 15): a per-action overhead that CostModel::duration adds
// to every compute action, transfer costs of latency + bytes / bandwidth from a profile's measured
// runtime, the profile's "runtime" object in JSON (round trip, version 1 files still read), the fit of
// ping-pong samples to a latency and a bandwidth, and the transfer, overhead and step terms measured
// from a hand-made runtime timeline. Expected makespans are worked out by hand in the comments.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/profile.h"

using namespace pipetrain;
using nlohmann::json;

namespace {

LayerProfile layer(const std::string& name, double f, double b, double act) {
  LayerProfile l;
  l.name = name;
  l.type = "Linear";
  l.forward_ms = f;
  l.backward_ms = b;
  l.activation_bytes = act;
  return l;
}

// Two layers at micro-batch 4: layer 0's output (400 bytes) crosses the one boundary of balance 1,1.
Profile two_layers() {
  Profile p;
  p.model = "toy";
  p.micro_batch_size = 4;
  p.layers = {layer("a", 1, 2, 400), layer("b", 2, 3, 100)};
  return p;
}

RuntimeCosts runtime(double latency, double bandwidth, double overhead) {
  RuntimeCosts r;
  r.transport = "shm";
  r.latency_ms = latency;
  r.bandwidth_bytes_per_ms = bandwidth;
  r.overhead_ms = overhead;
  r.transfers = {{4096, latency + 4096 / bandwidth}, {1 << 20, latency + (1 << 20) / bandwidth}};
  return r;
}

}  // namespace

// One stage, GPipe m=2: F F BW BW back to back, so every compute action's overhead adds once:
// 2 x 1 + 2 x (2 + 1) = 8, plus 4 x 0.25.
TEST(RuntimeCosts, OverheadAddsToEveryComputeActionOnly) {
  CostModel c = CostModel::uniform(1, StageCost{1, 2, 1, 1});
  EXPECT_DOUBLE_EQ(simulate(gpipe(1, 2), c).metrics.makespan, 8.0);
  c.overhead = 0.25;
  EXPECT_DOUBLE_EQ(simulate(gpipe(1, 2), c).metrics.makespan, 9.0);
  EXPECT_DOUBLE_EQ(c.duration(Action{ActionKind::F, 0, 0}), 1.25);
  EXPECT_DOUBLE_EQ(c.duration(Action{ActionKind::BW, 0, 0}), 3.25);
  c.step = 0.5;
  c.comm = 0.125;
  EXPECT_DOUBLE_EQ(c.duration(Action{ActionKind::Step, 0, 0}), 0.5);      // not a compute action
  EXPECT_DOUBLE_EQ(c.duration(Action{ActionKind::SendAct, 0, 0}), 0.125);  // nor a transfer
  EXPECT_DOUBLE_EQ(c.memory_delta(Action{ActionKind::F, 0, 0}), 1.0);      // memory is untouched
}

// 1F1B p=2 m=2, F=1, BW=3, comm 0.5: 13 without overhead (test_simulate's hand timeline). Its critical
// path 0F0 1F0 1BW0 1F1 1BW1 0BW1 holds six compute actions, so overhead 0.25 makes it 13 + 1.5.
TEST(RuntimeCosts, OverheadLengthensTheCriticalPathByItsActions) {
  CostModel c = CostModel::uniform(2, StageCost{1, 2, 1, 1}, 1, 0.5);
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(2, 2), c).metrics.makespan, 13.0);
  c.overhead = 0.25;
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(2, 2), c).metrics.makespan, 14.5);
}

TEST(RuntimeCosts, CheckRejectsABadOverhead) {
  CostModel c = CostModel::uniform(2, StageCost{});
  for (double bad : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), 2e12}) {
    c.overhead = bad;
    try {
      c.check(2);
      ADD_FAILURE() << "overhead " << bad << " accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("overhead"), std::string::npos) << e.what();
    }
  }
  c.overhead = 0.5;
  EXPECT_NO_THROW(c.check(2));
}

// A profile's runtime costs: the overhead reaches the cost model by itself, the transfer options come
// from profile_transfers. GPipe p=2 m=1 runs F0, F1, B1, B0 in a chain with two transfers, so the
// makespan is (1 + 2 + 3 + 2) + 2 x (latency + 400 bytes / bandwidth) + 4 x overhead.
TEST(RuntimeCosts, ProfileTransfersAndOverheadChangeTheMakespanExactly) {
  Profile p = two_layers();
  StageCostOptions o;
  o.micro_batch = 4;  // the profiled size
  const double plain = simulate(gpipe(2, 1), stage_costs(p, {1, 1}, o)).metrics.makespan;
  EXPECT_DOUBLE_EQ(plain, 8.0);
  EXPECT_FALSE(profile_transfers(p));

  p.runtime = runtime(0.05, 200, 0.125);  // a transfer of 400 bytes: 0.05 + 2 ms
  const auto t = profile_transfers(p);
  ASSERT_TRUE(t);
  o.latency_ms = t->latency_ms;
  o.bandwidth_bytes_per_ms = t->bandwidth_bytes_per_ms;
  const CostModel c = stage_costs(p, {1, 1}, o);
  EXPECT_DOUBLE_EQ(c.overhead, 0.125);
  EXPECT_DOUBLE_EQ(c.comm, p.runtime->transfer_ms(400));
  EXPECT_DOUBLE_EQ(simulate(gpipe(2, 1), c).metrics.makespan, plain + 2 * (0.05 + 2.0) + 4 * 0.125);

  o.overhead_ms = 0.0;  // an explicit overhead wins over the profile's
  EXPECT_DOUBLE_EQ(stage_costs(p, {1, 1}, o).overhead, 0.0);

  // Unlimited: only the latency counts. The bandwidth is infinite (it was the largest double, which
  // overflowed to infinity in plan's GB/s round trip and was then refused).
  p.runtime->bandwidth_bytes_per_ms = 0;
  const auto u = profile_transfers(p);
  ASSERT_TRUE(u);
  EXPECT_TRUE(std::isinf(u->bandwidth_bytes_per_ms) && u->bandwidth_bytes_per_ms > 0);
  o.bandwidth_bytes_per_ms = u->bandwidth_bytes_per_ms;
  EXPECT_NEAR(stage_costs(p, {1, 1}, o).comm, 0.05, 1e-12);
}

// Samples on the line 0.02 ms + bytes / 5000 bytes/ms give back that latency and bandwidth.
TEST(RuntimeCosts, FitRecoversLatencyAndBandwidth) {
  std::vector<TransferSample> s;
  for (double bytes : {4096.0, 65536.0, 1048576.0}) s.push_back({bytes, 0.02 + bytes / 5000});
  const RuntimeCosts r = fit_transfers(s);
  EXPECT_NEAR(r.latency_ms, 0.02, 1e-9);
  EXPECT_NEAR(r.bandwidth_bytes_per_ms, 5000, 1e-6);
  EXPECT_EQ(r.transfers.size(), 3u);
  EXPECT_NEAR(r.transfer_ms(10000), 0.02 + 2.0, 1e-9);
  // One size: its time is the latency, the bytes are free.
  const RuntimeCosts one = fit_transfers({{4096, 0.01}});
  EXPECT_DOUBLE_EQ(one.latency_ms, 0.01);
  EXPECT_DOUBLE_EQ(one.bandwidth_bytes_per_ms, 0);
  EXPECT_DOUBLE_EQ(one.transfer_ms(1e9), 0.01);
  // Larger messages that came back faster: no bandwidth term, the mean is the latency.
  EXPECT_DOUBLE_EQ(fit_transfers({{100, 0.03}, {1000, 0.01}}).latency_ms, 0.02);
  EXPECT_THROW(fit_transfers({}), UsageError);
  EXPECT_THROW(fit_transfers({{-1, 0.1}}), UsageError);
}

TEST(RuntimeCosts, ProfileJsonRoundTripsTheRuntime) {
  Profile p = two_layers();
  // Without runtime costs the file stays version 1, as older pipetrains read it.
  const json plain = profile_to_json(p);
  EXPECT_EQ(plain["version"], 1);
  EXPECT_FALSE(plain.contains("runtime"));
  EXPECT_FALSE(profile_from_json(plain).runtime);

  p.runtime = runtime(0.0123, 4567.5, 0.0042);
  const json j = profile_to_json(p);
  EXPECT_EQ(j["version"], 2);
  const Profile back = profile_from_json_text(profile_to_json_text(p), "p.json");
  ASSERT_TRUE(back.runtime);
  EXPECT_EQ(back.runtime->transport, "shm");
  EXPECT_DOUBLE_EQ(back.runtime->latency_ms, 0.0123);
  EXPECT_DOUBLE_EQ(back.runtime->bandwidth_bytes_per_ms, 4567.5);
  EXPECT_DOUBLE_EQ(back.runtime->overhead_ms, 0.0042);
  ASSERT_EQ(back.runtime->transfers.size(), 2u);
  EXPECT_DOUBLE_EQ(back.runtime->transfers[1].bytes, 1 << 20);
  EXPECT_DOUBLE_EQ(back.runtime->transfers[1].one_way_ms, p.runtime->transfers[1].one_way_ms);
  EXPECT_EQ(profile_to_json(back), j);
}

TEST(RuntimeCosts, OldProfilesLoadAndBadRuntimesAreNamed) {
  // A version 1 file as earlier pipetrains wrote it.
  const Profile old = profile_from_json_text(
      R"({"format": "pipetrain-profile", "version": 1, "model": "x", "micro_batch_size": 2, "threads": 1,
          "layers": [{"name": "a", "type": "Linear", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 8,
                      "parameter_bytes": 4, "optimizer_bytes": 8}]})",
      "old.json");
  EXPECT_FALSE(old.runtime);
  StageCostOptions at_two;
  at_two.micro_batch = 2;
  EXPECT_DOUBLE_EQ(stage_costs(old, {1}, at_two).overhead, 0.0);

  Profile p = two_layers();
  p.runtime = runtime(0.01, 1000, 0.001);
  const json good = profile_to_json(p);
  auto error = [&](const std::function<void(json&)>& mutate) {
    json j = good;
    mutate(j);
    try {
      profile_from_json(j, "p.json");
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto has = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << msg << " lacks " << part;
  };
  has(error([](json& j) { j["runtime"]["latency_ms"] = -0.5; }), "runtime.latency_ms");
  has(error([](json& j) { j["runtime"]["overhead_us"] = 1; }), "unknown field \"overhead_us\"");
  has(error([](json& j) { j["runtime"].erase("overhead_ms"); }), "\"overhead_ms\" is missing");
  has(error([](json& j) { j["runtime"]["transport"] = ""; }), "runtime.transport");
  has(error([](json& j) { j["runtime"]["transfers"][0]["one_way_ms"] = "fast"; }), "runtime.transfers[0]");
  has(error([](json& j) { j["version"] = 1; }), "version 1 profile");
  EXPECT_EQ(error([](json& j) { j["runtime"].erase("transfers"); }), "accepted");  // the samples are optional
}

// A runtime timeline by hand (times in ms), 2 ranks, one micro-batch, fused backward:
//   rank 0: 0F0 [0,1], 0SendAct0 [1,1.1], receive wait 0RecvGrad0 [1.2,4.8], 0BW0 [4.9,6.9], step [7,7.5]
//   rank 1: 1RecvAct0 [0.5,1.4], 1F0 [1.5,2.5], 1BW0 [2.5,4.5], step [4.6,7.5]
// Transfers: 1RecvAct0 was waiting when 0F0 ended at 1: 1.4 - 1 = 0.4; 0RecvGrad0 waited for 1BW0 (end
// 4.5): 0.3; median 0.35. Unmodelled time: rank 0 span 7.5 - compute 3 - receive 3.6 - step 0.5 = 0.4,
// rank 1 span 7 - 3 - 0.9 - 2.9 = 0.2; over 4 compute actions 0.15. Step: the shorter, 0.5.
TEST(RuntimeCosts, MeasuredRuntimeFromATimeline) {
  Timeline t;
  t.ranks = 2;
  auto ev = [&](int rank, ActionKind k, int stage, double start, double end) {
    t.events.push_back(TimedAction{rank, Action{k, stage, 0}, start, end});
  };
  ev(0, ActionKind::F, 0, 0, 1);
  ev(0, ActionKind::SendAct, 0, 1, 1.1);
  ev(0, ActionKind::RecvGrad, 0, 1.2, 4.8);
  ev(0, ActionKind::BW, 0, 4.9, 6.9);
  ev(0, ActionKind::Step, 0, 7, 7.5);
  ev(1, ActionKind::RecvAct, 1, 0.5, 1.4);
  ev(1, ActionKind::F, 1, 1.5, 2.5);
  ev(1, ActionKind::BW, 1, 2.5, 4.5);
  ev(1, ActionKind::Step, 1, 4.6, 7.5);
  const MeasuredRuntime m = measured_runtime(t);
  EXPECT_NEAR(m.transfer, 0.35, 1e-12);
  EXPECT_EQ(m.transfer_samples, 2);
  EXPECT_NEAR(m.overhead, 0.15, 1e-12);
  EXPECT_DOUBLE_EQ(m.step, 0.5);
  const CostModel c = measured_costs_with_runtime(t, 2);
  EXPECT_NEAR(c.comm, 0.35, 1e-12);
  EXPECT_NEAR(c.overhead, 0.15, 1e-12);
  EXPECT_DOUBLE_EQ(c.step, 0.5);
  EXPECT_DOUBLE_EQ(c.stage[1].b, 2.0);
  const CostModel plain = measured_costs(t, 2);  // today's model: compute only
  EXPECT_DOUBLE_EQ(plain.comm, 0.0);
  EXPECT_DOUBLE_EQ(plain.overhead, 0.0);
  EXPECT_DOUBLE_EQ(plain.step, 0.0);

  // A receive that started after its data was made did not wait for it: not a sample of its own; with
  // no waiting receive left, the smallest gap stands in.
  t.events[2].start = 4.6;  // 0RecvGrad0 [4.6,4.8], after 1BW0 ended at 4.5: gap 0.3
  t.events[5].start = 1.05;  // 1RecvAct0 [1.05,1.4], after 0F0 ended at 1: gap 0.4
  const MeasuredRuntime late = measured_runtime(t);
  EXPECT_EQ(late.transfer_samples, 0);
  EXPECT_NEAR(late.transfer, 0.3, 1e-12);
  EXPECT_DOUBLE_EQ(measured_runtime(Timeline{}).overhead, 0.0);
}

// Skip receives (docs/ALGORITHMS.md §1.10) are transfers like boundary ones, their data made by the peer
// stage. Three ranks, one micro-batch, a skip from stage 0 to stage 2 (ms):
//   rank 0: 0F0 [0,1], 0RB0@2 [1.1,6.4], 0RB0 [6.4,8.5], 0BW0 [8.5,9.5]
//   rank 1: 1RF0 [0.5,1.3], 1F0 [1.3,3], 1RB0 [3,6.3], 1BW0 [6.3,8]
//   rank 2: 2RF0@0 [0.8,1.5], 2RF0 [1.5,3.2], 2F0 [3.2,4], 2BW0 [4,6]
// Every receive was waiting: 0RB0@2 after 2BW0 (6) 0.4, 0RB0 after 1BW0 (8) 0.5, 1RF0 0.3, 1RB0 0.3,
// 2RF0@0 after 0F0 (1) 0.5, 2RF0 after 1F0 (3) 0.2: six samples, median 0.35. Taken for boundary receives
// (their makers the neighbours' 1F0 and 1BW0, which end after them), the skip receives would be no samples
// and the median of the other four 0.3.
TEST(RuntimeCosts, MeasuredRuntimeCountsSkipReceivesFromTheirPeer) {
  Timeline t;
  t.ranks = 3;
  auto ev = [&](int rank, ActionKind k, int stage, double start, double end, int peer = -1) {
    Action a{k, stage, 0};
    a.peer = peer;
    t.events.push_back(TimedAction{rank, a, start, end});
  };
  ev(0, ActionKind::F, 0, 0, 1);
  ev(0, ActionKind::RecvGrad, 0, 1.1, 6.4, 2);
  ev(0, ActionKind::RecvGrad, 0, 6.4, 8.5);
  ev(0, ActionKind::BW, 0, 8.5, 9.5);
  ev(1, ActionKind::RecvAct, 1, 0.5, 1.3);
  ev(1, ActionKind::F, 1, 1.3, 3);
  ev(1, ActionKind::RecvGrad, 1, 3, 6.3);
  ev(1, ActionKind::BW, 1, 6.3, 8);
  ev(2, ActionKind::RecvAct, 2, 0.8, 1.5, 0);
  ev(2, ActionKind::RecvAct, 2, 1.5, 3.2);
  ev(2, ActionKind::F, 2, 3.2, 4);
  ev(2, ActionKind::BW, 2, 4, 6);
  const MeasuredRuntime m = measured_runtime(t);
  EXPECT_EQ(m.transfer_samples, 6);
  EXPECT_NEAR(m.transfer, 0.35, 1e-12);
}
