// Checks core/heap.h, the heap model: weight gradients appear at the first backward of a step that makes
// them (gradient_b at B or BW, gradient_w at W or BW) and last until the stage's Step; the runtime's
// transfer buffers follow the executor's policy (receives posted ahead, sends in flight) on lowered 1F1B
// and ZB-V lists, worked out by hand action by action; without gradients and messages the model is the
// simulator's activation count; and plan/costs.h fills the model's inputs from a profile.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/heap.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/plan/costs.h"

using namespace pipetrain;

namespace {

std::vector<double> totals(const std::vector<HeapParts>& samples) {
  std::vector<double> out;
  for (const HeapParts& h : samples) out.push_back(h.total());
  return out;
}

std::vector<double> transfers(const std::vector<HeapParts>& samples) {
  std::vector<double> out;
  for (const HeapParts& h : samples) out.push_back(h.transfers);
  return out;
}

// Stages of activation 4 (B frees half, W the rest), no time.
CostModel memory_costs(int stages) {
  CostModel c = CostModel::uniform(stages, StageCost{1, 1, 1, 4});
  c.b_release_fraction = 0.5;
  return c;
}

// Only transfer buffers: stage s sends messages of `message[s]`.
CostModel message_costs(const std::vector<double>& message) {
  CostModel c = CostModel::uniform(static_cast<int>(message.size()), StageCost{1, 1, 1, 0});
  for (std::size_t s = 0; s < message.size(); ++s) c.stage[s].message = message[s];
  return c;
}

Schedule generated(const std::string& name, int p, int m) {
  GeneratorOptions g;
  g.ranks = p;
  g.microbatches = m;
  return generate(name, g);
}

}  // namespace

// One rank holds stages 0 and 1 (a V folded onto one rank). Activations: 4, 8 after the two forwards,
// then 6, 4, 2, 0 as B and W release. Stage 1's weight gradients (3) appear at 1W0, stage 0's (7) at 0W0,
// and each Step frees its own: totals 4 8 6 4+3 2+3 0+10 7 0, a peak of 10 after 0W0 made of gradients
// only. Counting both stages' gradients for the whole step would have put 8 + 10 = 18 after 1F0.
TEST(HeapModel, GradientsAppearAtTheFirstWeightPassAndLastUntilTheStep) {
  const Schedule s = from_csv("0F0,1F0,1B0,1W0,0B0,0W0,1S0,0S0\n");
  ASSERT_EQ(s.ranks, 1);
  CostModel c = memory_costs(2);
  c.stage[0].gradient_w = 7;
  c.stage[1].gradient_w = 3;
  const HeapWalk walk = heap_walk(s, c);
  EXPECT_EQ(totals(walk.samples[0]), (std::vector<double>{4, 8, 6, 7, 5, 10, 7, 0}));
  const HeapPeak peak = predict_heap(s, c)[0];
  EXPECT_DOUBLE_EQ(peak.total(), 10);
  EXPECT_DOUBLE_EQ(peak.gradients, 10);
  EXPECT_DOUBLE_EQ(peak.activations, 0);
  EXPECT_EQ(peak.position, 5);
  EXPECT_EQ(to_string(peak.after), "0W0");
  // With smaller gradients the peak is the activations' after 1F0, before any gradient exists (V-Min's
  // first rank in docs/BENCHMARKS.md).
  c.stage[0].gradient_w = 4;
  const HeapPeak early = predict_heap(s, c)[0];
  EXPECT_DOUBLE_EQ(early.total(), 8);
  EXPECT_DOUBLE_EQ(early.gradients, 0);
  EXPECT_EQ(to_string(early.after), "1F0");
}

// gradient_b comes with B, gradient_w with W, both with a fused BW; a step's second backward adds nothing
// and the Step frees them, so the next step starts again from its own first backward.
TEST(HeapModel, GradientsOncePerStepFromBOrBW) {
  CostModel c = memory_costs(1);
  c.stage[0].gradient_b = 1;
  c.stage[0].gradient_w = 6;
  // Split backward: F 4; B releases 2 and makes gradient_b; W releases 2 and makes gradient_w.
  EXPECT_EQ(totals(heap_walk(from_csv("0F0,0B0,0W0,0S0\n"), c).samples[0]), (std::vector<double>{4, 3, 7, 0}));
  // Two micro-batches in one step: the gradients (7) are made once.
  EXPECT_EQ(totals(heap_walk(from_csv("0F0,0F1,0BW0,0BW1,0S0\n"), c).samples[0]),
            (std::vector<double>{4, 8, 11, 7, 0}));
  // Two steps of one micro-batch: freed by each Step, made again by the next step's BW.
  const Schedule two = from_csv(
      "# pipetrain schedule name=custom ranks=1 stages=1 microbatches=2 microbatches_per_step=1 synchronous=1\n"
      "0F0,0BW0,0S0,0F1,0BW1,0S1\n");
  ASSERT_EQ(two.steps(), 2);
  const HeapWalk walk = heap_walk(two, c);
  EXPECT_EQ(totals(walk.samples[0]), (std::vector<double>{4, 7, 0, 4, 7, 0}));
  EXPECT_DOUBLE_EQ(walk.samples[0][1].gradients, 7);
}

// 1F1B, p = 2, m = 4, lowered with unit costs as the runtime lowers it:
//   rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0BW0 0F2 0RB1 0SF2 0BW1 0F3 0SF3 0RB2 0BW2 0RB3 0BW3 0S0
//   rank 1: 1RF0 1F0 1RF1 1BW0 1SB0 1F1 1BW1 1SB1 1RF2 1F2 1BW2 1RF3 1SB2 1F3 1BW3 1SB3 1S0
// Messages of 1, two receives posted ahead, one send in flight. Rank 1: RF0 and RF1 are posted at once
// (2); the walk posts RF2 once F0 has consumed RF0 (3, at RF1), BW0 frees RF0's buffer and makes the
// input gradient SB0 sends (3); RF3 is posted before BW1 (4, the peak), whose SB1 releases SB0 (3); no
// receive is left to post, so the count falls as sends are released, and the Step's flush ends at 0.
// Rank 0 posts RB0 and RB1 (2), sends activations (which copy nothing), and BW frees a received gradient
// (1); the last, 0BW3, frees the output while 0SF3 is still in flight, which keeps it (1) until the flush.
TEST(HeapModel, OneFOneBTransferBuffersByHand) {
  const Schedule s = generated("1f1b", 2, 4);
  const CostModel c = message_costs({1, 1});
  const HeapWalk fast = heap_walk(s, c, HeapOptions{2, 1});
  ASSERT_EQ(rank_line(fast.lowered, 1),
            "1RF0 1F0 1RF1 1BW0 1SB0 1F1 1BW1 1SB1 1RF2 1F2 1BW2 1RF3 1SB2 1F3 1BW3 1SB3 1S0");
  ASSERT_EQ(rank_line(fast.lowered, 0),
            "0F0 0SF0 0F1 0SF1 0RB0 0BW0 0F2 0RB1 0SF2 0BW1 0F3 0SF3 0RB2 0BW2 0RB3 0BW3 0S0");
  EXPECT_EQ(transfers(fast.samples[1]), (std::vector<double>{2, 2, 3, 3, 3, 3, 4, 3, 3, 3, 3, 3, 2, 2, 2, 1, 0}));
  EXPECT_EQ(transfers(fast.samples[0]), (std::vector<double>{2, 2, 2, 2, 2, 1, 2, 2, 2, 1, 2, 2, 2, 1, 1, 1, 0}));
  // The reference path: each receive allocates at its own action and each send completes in place, so
  // rank 1 holds at most the input it received plus the next one (2, at 1RF1 and 1RF3).
  const HeapWalk ref = heap_walk(s, c, HeapOptions::reference());
  EXPECT_EQ(transfers(ref.samples[1]), (std::vector<double>{1, 1, 2, 2, 1, 1, 1, 0, 1, 1, 1, 2, 1, 1, 1, 0, 0}));
  // The runtime's default (4 ahead, 4 in flight): every receive is posted at the start, and each buffer
  // a backward frees is replaced by an input gradient or an output kept by its send: 4 throughout.
  std::vector<double> four(16, 4.0);
  four.push_back(0.0);  // after the Step's flush
  const HeapWalk dflt = heap_walk(s, c);
  EXPECT_EQ(transfers(dflt.samples[0]), four);
  EXPECT_EQ(transfers(dflt.samples[1]), four);
}

// ZB-V, p = 2, m = 2 (stages 0 and 3 on rank 0, 1 and 2 on rank 1), one receive ahead and one send in
// flight (the fast path with prefetch 1). Messages: stage 0's 1, stage 1's 10 (handed to stage 2 on the
// same rank, so only its gradient counts: from 2B until 1B takes it), stage 2's 100.
//   rank 0: 0F0 0SF0 0F1 0SF1 3RF0 3F0 3B0 3RF1 3SB0 3W0 3F1 3B1 3SB1 3W1 0RB0 0B0 0W0 0RB1 0B1 0W1 0S0 3S0
//   rank 1: 1RF0 1F0 1RF1 2F0 2SF0 1F1 2F1 2SF1 2RB0 2B0 2W0 1B0 2RB1 1SB0 1W0 2B1 2W1 1B1 1SB1 1W1 1S0 2S0
// Rank 0: 3RF0 is posted first (100); 3B0 frees it and makes stage 3's input gradient (100) while 3RF1 is
// posted (200); 0RB0 joins before 3B1 (201, the peak); 3SB1 releases 3SB0 (101); the flush releases 3SB1.
// Rank 1: 2RB0 (100) is posted before 2F1 (102 with 1RF0 and 1RF1 held); 2B0 frees it and makes a
// gradient of 10 (12); 2RB1 is posted before 2W0 (112, the peak); 1B0 frees its input (1), takes 2B0's
// gradient (10) and makes its own (1) for 1SB0.
TEST(HeapModel, ZbVTransferBuffersByHand) {
  const Schedule s = generated("zb-v", 2, 2);
  const CostModel c = message_costs({1, 10, 100, 1000});
  const HeapWalk walk = heap_walk(s, c, HeapOptions::fast_path(1));
  ASSERT_EQ(rank_line(walk.lowered, 0), "0F0 0SF0 0F1 0SF1 3RF0 3F0 3B0 3RF1 3SB0 3W0 3F1 3B1 3SB1 3W1 0RB0 0B0 "
                                        "0W0 0RB1 0B1 0W1 0S0 3S0");
  ASSERT_EQ(rank_line(walk.lowered, 1), "1RF0 1F0 1RF1 2F0 2SF0 1F1 2F1 2SF1 2RB0 2B0 2W0 1B0 2RB1 1SB0 1W0 2B1 "
                                        "2W1 1B1 1SB1 1W1 1S0 2S0");
  EXPECT_EQ(transfers(walk.samples[0]), (std::vector<double>{100, 100, 100, 100, 100, 100, 200, 200, 200, 200, 200,
                                                             201, 101, 101, 101, 100, 101, 101, 100, 100, 0, 0}));
  EXPECT_EQ(transfers(walk.samples[1]), (std::vector<double>{1, 1, 2, 2, 2, 2, 102, 102, 102, 12, 112, 102, 102, 102,
                                                             102, 12, 12, 2, 1, 1, 0, 0}));
  const std::vector<HeapPeak> peaks = predict_heap(s, c, HeapOptions::fast_path(1));
  EXPECT_DOUBLE_EQ(peaks[0].transfers, 201);
  EXPECT_EQ(to_string(peaks[0].after), "3B1");
  EXPECT_DOUBLE_EQ(peaks[1].transfers, 112);
  EXPECT_EQ(to_string(peaks[1].after), "2W0");
  // An already lowered schedule is walked as given.
  EXPECT_EQ(totals(heap_walk(walk.lowered, c, HeapOptions::fast_path(1)).samples[1]), totals(walk.samples[1]));
}

// Without gradient or message bytes the model is the simulator's activation count (§1.5), for every
// placement the generators make.
TEST(HeapModel, WithoutGradientsOrMessagesItIsTheActivationPeak) {
  for (const std::string name : {"gpipe", "1f1b", "zb-h1", "zb-v", "v-half", "v-min", "dualpipev"}) {
    const Schedule s = generated(name, 3, 6);
    CostModel c = CostModel::uniform(s.stages, StageCost{1, 1, 1, 1}, s.virtual_stages_per_rank());
    c.b_release_fraction = 0.25;
    const SimResult sim = simulate(s, c);
    const std::vector<HeapPeak> heap = predict_heap(s, c);
    ASSERT_EQ(heap.size(), sim.metrics.per_rank.size());
    for (std::size_t r = 0; r < heap.size(); ++r) {
      EXPECT_DOUBLE_EQ(heap[r].total(), sim.metrics.per_rank[r].peak_memory) << name << " rank " << r;
      EXPECT_DOUBLE_EQ(heap[r].gradients + heap[r].transfers, 0.0) << name;
    }
  }
}

TEST(HeapModel, BadInputIsAUsageError) {
  const Schedule s = generated("1f1b", 2, 2);
  CostModel c = message_costs({1, 1});
  EXPECT_THROW(heap_walk(s, c, HeapOptions{-1, 4}), UsageError);
  c.stage[1].gradient_w = -3;
  try {
    predict_heap(s, c);
    FAIL() << "a negative gradient passed";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("gradient_w = -3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(predict_heap(s, message_costs({1})), UsageError);  // one stage entry for two stages
}

// stage_costs: a split layer's parameters are gradient_w, the others' gradient_b (they do not scale with
// the micro-batch); message is the stage's last output at the asked micro-batch size.
TEST(HeapModel, StageCostsFillTheModelFromAProfile) {
  Profile p;
  p.micro_batch_size = 2;
  for (int k = 0; k < 3; ++k) {
    LayerProfile l;
    l.name = "l" + std::to_string(k);
    l.type = "Linear";
    l.forward_ms = l.backward_ms = 1;
    l.activation_bytes = 100 * (k + 1);
    l.parameter_bytes = 1000 * (k + 1);
    l.bw_split = k != 0;
    if (l.bw_split) l.input_grad_ms = l.weight_grad_ms = 0.5;
    p.layers.push_back(l);
  }
  StageCostOptions o;
  o.micro_batch = 4;
  const CostModel c = stage_costs(p, {2, 1}, o);
  EXPECT_DOUBLE_EQ(c.stage[0].gradient_b, 1000);
  EXPECT_DOUBLE_EQ(c.stage[0].gradient_w, 2000);
  EXPECT_DOUBLE_EQ(c.stage[1].gradient_b, 0);
  EXPECT_DOUBLE_EQ(c.stage[1].gradient_w, 3000);
  EXPECT_DOUBLE_EQ(c.stage[0].message, 2 * 200);
  EXPECT_DOUBLE_EQ(c.stage[1].message, 2 * 300);
}

// A stage whose split layers keep more after B than their forward saved (autograd's split keeps output
// gradients for W): with w_held the heap model holds exactly that between B and W, where the single
// b_release_fraction (clamped to [0, 1]) could only free something at B. The simulator's activation count
// does not read w_held.
TEST(HeapModel, WHeldIsWhatAMicroBatchHoldsBetweenItsBAndItsW) {
  CostModel c = memory_costs(1);  // activation 4, B frees half
  const Schedule s = from_csv("0F0,0F1,0B0,0B1,0W0,0W1,0S0\n");
  EXPECT_EQ(totals(heap_walk(s, c).samples[0]), (std::vector<double>{4, 8, 6, 4, 2, 0, 0}));
  c.stage[0].w_held = 5;
  EXPECT_EQ(totals(heap_walk(s, c).samples[0]), (std::vector<double>{4, 8, 9, 10, 5, 0, 0}));
  EXPECT_DOUBLE_EQ(predict_heap(s, c)[0].activations, 10);
  EXPECT_EQ(to_string(predict_heap(s, c)[0].after), "0B1");
  EXPECT_DOUBLE_EQ(simulate(s, c).metrics.per_rank[0].peak_memory, 8);  // the activation count: F's alone
  // A fused BW frees everything at once, whatever w_held says.
  EXPECT_EQ(totals(heap_walk(from_csv("0F0,0BW0,0S0\n"), c).samples[0]), (std::vector<double>{4, 0, 0}));
  c.stage[0].w_held = std::numeric_limits<double>::infinity();
  EXPECT_THROW(predict_heap(s, c), UsageError);
}

// stage_costs' w_held: per stage, the measured w_held_bytes of its split layers at the asked micro-batch
// size (0 where no layer splits); unset (< 0) where a split layer was not measured.
TEST(HeapModel, StageCostsTakeWHeldFromTheProfile) {
  Profile p;
  p.micro_batch_size = 2;
  for (int k = 0; k < 4; ++k) {
    LayerProfile l;
    l.name = "l" + std::to_string(k);
    l.type = "Block";
    l.forward_ms = l.backward_ms = 1;
    l.activation_bytes = 100;
    l.saved_bytes = 400;
    l.bw_split = k != 0;
    if (l.bw_split) {
      l.input_grad_ms = l.weight_grad_ms = 0.5;
      l.w_held_bytes = 500;  // more than it saved
    }
    p.layers.push_back(l);
  }
  StageCostOptions o;
  o.micro_batch = 4;  // twice the profiled size
  const CostModel c = stage_costs(p, {1, 3}, o);
  EXPECT_DOUBLE_EQ(c.stage[0].w_held, 0);  // nothing splits
  EXPECT_DOUBLE_EQ(c.stage[1].w_held, 2 * 3 * 500);
  EXPECT_DOUBLE_EQ(c.stage[1].activation, 2 * 3 * 400);
  // The one fraction: 1 - (3 x min(500, 400)) / (4 x 400), the unsplit layer counted as freed.
  EXPECT_DOUBLE_EQ(c.b_release_fraction, 0.25);
  p.layers[2].w_held_bytes = -1;  // not measured
  const CostModel partial = stage_costs(p, {1, 3}, o);
  EXPECT_LT(partial.stage[1].w_held, 0);
}
