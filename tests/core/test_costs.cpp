// Checks plan/costs.h: a layer's time at another micro-batch size (proportional with one measurement,
// the least-squares line with several, exact on affine data), and per-stage cost models cut from a
// profile by a balance (sums, the B:W proportion, activation bytes, the transfer time).
#include <gtest/gtest.h>

#include <limits>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/costs.h"

using namespace pipetrain;

namespace {

LayerProfile layer(double f, double b, double act, double params) {
  LayerProfile l;
  l.name = "l";
  l.type = "Linear";
  l.forward_ms = f;
  l.backward_ms = b;
  l.activation_bytes = act;
  l.parameter_bytes = params;
  return l;
}

}  // namespace

TEST(Costs, LayerTimeScalesOrFitsALine) {
  LayerProfile l = layer(4.0, 8.0, 0, 0);  // at size 8
  EXPECT_DOUBLE_EQ(layer_time_at(l, 8, 2, true), 1.0);
  EXPECT_DOUBLE_EQ(layer_time_at(l, 8, 16, false), 16.0);
  // Affine data t(b) = 0.5 + 0.25 b at sizes 2, 8, 32: the fit is exact, including the fixed cost.
  l.forward_ms = 0.5 + 0.25 * 8;
  l.by_micro_batch = {{2, 0.5 + 0.25 * 2, 1.0 + 0.5 * 2}, {32, 0.5 + 0.25 * 32, 1.0 + 0.5 * 32}};
  l.backward_ms = 1.0 + 0.5 * 8;
  EXPECT_NEAR(layer_time_at(l, 8, 1, true), 0.75, 1e-12);
  EXPECT_NEAR(layer_time_at(l, 8, 64, true), 16.5, 1e-12);
  EXPECT_NEAR(layer_time_at(l, 8, 4, false), 3.0, 1e-12);
  // Inside the measured sizes the time follows the measurements (piecewise linear), not the line: a
  // layer with a bend at small sizes (1 -> 0.6, 4 -> 2, 16 -> 8) is 0.6 at 1, not the line's 0.45.
  l.forward_ms = 2.0;
  l.by_micro_batch = {{1, 0.6, 1.0}, {16, 8.0, 16.0}};
  l.backward_ms = 4.0;
  EXPECT_NEAR(layer_time_at(l, 4, 1, true), 0.6, 1e-12);
  EXPECT_NEAR(layer_time_at(l, 4, 2, true), 0.6 + (2.0 - 0.6) / 3, 1e-12);
  EXPECT_NEAR(layer_time_at(l, 4, 10, false), 4.0 + 12.0 / 12 * 6, 1e-12);
  EXPECT_NEAR(layer_time_at(l, 4, 16, true), 8.0, 1e-12);
  // A fit that would go negative is clamped at zero.
  l.by_micro_batch = {{16, 0.1, 0.1}};
  l.forward_ms = 10;
  EXPECT_GE(layer_time_at(l, 8, 64, true), 0.0);
}

TEST(Costs, StageCostsSumTheirLayers) {
  Profile p;
  p.model = "m";
  p.micro_batch_size = 4;
  p.layers = {layer(1, 2, 100, 10), layer(2, 4, 200, 20), layer(3, 6, 300, 30)};
  p.layers[1].bw_split = true;
  p.layers[1].input_grad_ms = 1;
  p.layers[1].weight_grad_ms = 3;  // 1:3, so its 4 ms backward splits 1 + 3
  p.layers[2].optimizer_bytes = 60;
  StageCostOptions o;
  o.micro_batch = 8;  // twice the profiled size
  o.bandwidth_bytes_per_ms = 100;
  o.latency_ms = 0.5;
  const CostModel c = stage_costs(p, {2, 1}, o);
  ASSERT_EQ(c.stage.size(), 2u);
  EXPECT_DOUBLE_EQ(c.stage[0].f, 2 * (1 + 2));
  EXPECT_DOUBLE_EQ(c.stage[0].b, 2 * (2 + 1));
  EXPECT_DOUBLE_EQ(c.stage[0].w, 2 * 3);
  EXPECT_DOUBLE_EQ(c.stage[0].activation, 2 * (100 + 200));
  EXPECT_DOUBLE_EQ(c.stage[1].f, 6);
  EXPECT_DOUBLE_EQ(c.stage[1].b, 12);
  EXPECT_DOUBLE_EQ(c.stage[1].w, 0);
  // The one boundary carries layer 1's output at 8 samples: 400 bytes at 100 bytes/ms, plus latency.
  EXPECT_DOUBLE_EQ(c.comm, 0.5 + 400.0 / 100);
  EXPECT_EQ(stage_static_bytes(p, {2, 1}), (std::vector<double>{2 * 30.0, 2 * 30.0 + 60}));
  EXPECT_DOUBLE_EQ(stage_costs(p, {3}, o).comm, 0.0);  // one stage: nothing crosses
  EXPECT_THROW(stage_costs(p, {2, 2}, o), UsageError);
}

// A stage's optimizer step costs its layers' measured step times (the runtime steps once per stage and
// mini-batch, whatever the micro-batch); a profile without them leaves the step free. What replicas add
// (their all-reduce) comes on top.
TEST(Costs, StageStepsAreTheirLayersOptimizerTimes) {
  Profile p;
  p.model = "m";
  p.micro_batch_size = 4;
  p.layers = {layer(1, 2, 100, 10), layer(2, 4, 200, 20), layer(3, 6, 300, 30)};
  StageCostOptions o;
  o.micro_batch = 8;
  EXPECT_TRUE(stage_costs(p, {2, 1}, o).stage_step.empty());
  p.layers[0].optimizer_ms = 0.25;
  p.layers[2].optimizer_ms = 1.5;
  CostModel c = stage_costs(p, {2, 1}, o);
  EXPECT_EQ(c.stage_step, (std::vector<double>{0.25, 1.5}));
  o.micro_batch = 2;  // the step does not scale with the micro-batch
  EXPECT_EQ(stage_costs(p, {1, 2}, o).stage_step, (std::vector<double>{0.25, 1.5}));
  add_stage_step(c, {1.0, 2.0});
  EXPECT_EQ(c.stage_step, (std::vector<double>{1.25, 3.5}));
  EXPECT_THROW(add_stage_step(c, {1.0}), std::logic_error);
  CostModel none = stage_costs(p, {3}, o);
  none.stage_step.clear();
  add_stage_step(none, {0.5});
  EXPECT_EQ(none.stage_step, (std::vector<double>{0.5}));
  // The simulator charges it to each stage's Step.
  EXPECT_DOUBLE_EQ(c.duration(Action{ActionKind::Step, 1, 0}), 3.5);
}

// A measured all-reduce: piecewise linear between the measured sizes (a cliff between two of them is
// kept, as a transport's large-message path may have one), the samples' line below them, the two largest
// samples' slope above; at other replica counts each member sends 2 (d-1)/d of the bytes, so the time is
// the measured one at the bytes scaled by that share over the measured one.
TEST(Costs, MeasuredAllReduceInterpolatesTheSamples) {
  const std::vector<TransferSample> s{{4e6, 5.0}, {2.5e5, 0.05}, {1e6, 0.2}};  // any order
  EXPECT_DOUBLE_EQ(measured_allreduce_ms(s, 2, 1e6, 2), 0.2);
  EXPECT_DOUBLE_EQ(measured_allreduce_ms(s, 2, 2.5e6, 2), 0.2 + 0.5 * 4.8);  // halfway up the cliff
  EXPECT_DOUBLE_EQ(measured_allreduce_ms(s, 2, 8e6, 2), 5.0 + 4e6 * (4.8 / 3e6));
  const double small = measured_allreduce_ms(s, 2, 16, 2);  // the loss's 16 bytes: the line's latency
  EXPECT_GE(small, 0.0);
  EXPECT_LE(small, 0.05);
  // 4 replicas send 3/4 of the bytes where 2 send 1/2: 1e6 bytes over 4 cost what 1.5e6 cost over 2.
  EXPECT_DOUBLE_EQ(measured_allreduce_ms(s, 2, 1e6, 4), measured_allreduce_ms(s, 2, 1.5e6, 2));
  EXPECT_EQ(measured_allreduce_ms(s, 2, 1e6, 1), 0.0);
  EXPECT_DOUBLE_EQ(measured_allreduce_ms({{1e6, 2.0}}, 3, 2e6, 3), 4.0);  // one sample: scaled with the bytes
  EXPECT_THROW(measured_allreduce_ms({}, 2, 1e6, 2), UsageError);
  EXPECT_THROW(measured_allreduce_ms(s, 1, 1e6, 2), UsageError);
}

// Ring all-reduce: r ranks move 2 (r-1)/r of the bytes through each link in 2 (r-1) messages. 3 ranks,
// 3e6 bytes at 1e6 bytes/ms and 0.05 ms per message: 4/3 x 3 ms + 4 x 0.05 ms = 4.2 ms. Per stage of a
// replicated plan, over the stage's own parameters; one replica costs nothing.
TEST(Costs, RingAllReduceOverAStagesReplicas) {
  EXPECT_DOUBLE_EQ(ring_allreduce_ms(3e6, 3, 1e6, 0.05), 4.0 + 0.2);
  EXPECT_DOUBLE_EQ(ring_allreduce_ms(3e6, 1, 1e6, 0.05), 0.0);
  EXPECT_DOUBLE_EQ(ring_allreduce_ms(3e6, 2, 0.0, 0.05), 0.1);  // no bandwidth given: the latency only
  Profile p;
  p.micro_batch_size = 1;
  p.layers = {layer(1, 1, 4, 1e6), layer(1, 1, 4, 2e6), layer(1, 1, 4, 5e6)};
  const std::vector<double> ms = replica_allreduce_ms(p, {2, 1}, {3, 1}, 1e6, 0.05);
  ASSERT_EQ(ms.size(), 2u);
  // layers 0 and 1: 3e6 bytes over 3 replicas, as the runtime's group all-reduce sends them (below)
  EXPECT_DOUBLE_EQ(ms[0], 4.1);
  EXPECT_DOUBLE_EQ(ms[1], 0.0);
  EXPECT_THROW(replica_allreduce_ms(p, {2, 1}, {3}, 1e6, 0.05), UsageError);
}

// The runtime's group all-reduce (make_group_transport): a reduce-scatter and an all-gather, each one
// round of concurrent messages. 3 members, 3e6 bytes at 1e6 bytes/ms, 0.05 ms latency: every member
// sends 2 x 2/3 x 3e6 = 4e6 bytes (4 ms) and waits 2 latencies.
TEST(Costs, GroupAllReduceSendsTwoShareOfTheBytesInTwoRounds) {
  EXPECT_DOUBLE_EQ(group_allreduce_ms(3e6, 3, 1e6, 0.05), 4.0 + 0.1);
  EXPECT_DOUBLE_EQ(group_allreduce_ms(4e6, 2, 1e6, 0.05), 4.0 + 0.1);  // 2 members: each sends half, twice
  EXPECT_DOUBLE_EQ(group_allreduce_ms(4e6, 4, 1e6, 0.0), 6.0);         // 2 x 3/4 x 4 ms
  EXPECT_DOUBLE_EQ(group_allreduce_ms(3e6, 1, 1e6, 0.05), 0.0);
  EXPECT_DOUBLE_EQ(group_allreduce_ms(3e6, 2, 0.0, 0.05), 0.1);  // no bandwidth given: the latency only
  EXPECT_DOUBLE_EQ(group_allreduce_ms(3e6, 2, std::numeric_limits<double>::infinity(), 0.05), 0.1);
  EXPECT_EQ(kReplicaLossBytes, 16.0);  // the step's loss and token count, as doubles
}
