// Schedule generators: pure functions from sizes (and, for cost-aware schedules, per-stage costs) to a
// Schedule. Every schedule the runtime can run is made here; a new schedule is a new generator, never a
// new executor. Each generator below is drawn for p = 4 ranks and m = 8 micro-batches with F = B = W = 1
// (two characters per time unit; `f` forward, `b` input-gradient backward, `w` weight gradient, `B` fused
// backward (B+W, so twice as long), `S` optimizer step, digits are micro-batches, `.` is idle). The
// figures are `pipetrain simulate --ascii` output.
//
// All generators lay out `steps` optimizer steps back to back; micro-batch numbers continue across steps.
// They throw UsageError naming the bad value and the valid range on bad sizes.
#pragma once

#include <string>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

struct GeneratorOptions {
  int ranks = 1;             // p: ranks (devices); one stage each, v stages for interleaved
  int microbatches = 1;      // m: micro-batches per optimizer step
  int virtual_stages = 1;    // v: virtual stages (chunks) per rank; the looped schedules (interleaved,
                             // interleaved-zb, looped-bfs) only; the V shapes always hold 2 (1 or 2 accepted)
  int steps = 1;             // optimizer steps to lay out back to back
  double memory_limit = 0;   // zb-auto: activation memory limit per rank in micro-batches; 0 = p (1F1B's)
  CostModel costs;           // per-stage costs for zb-h2 / zb-auto; empty = F = B = W = 1
};

// GPipe fill-drain (torchgpipe order): all forwards, then backwards in reverse micro-batch order.
//   rank 0  f0f1f2f3f4f5f6f7..................B7--B6--B5--B4--B3--B2--B1--B0--S
//   rank 1  ..f0f1f2f3f4f5f6f7............B7--B6--B5--B4--B3--B2--B1--B0--S...
//   rank 2  ....f0f1f2f3f4f5f6f7......B7--B6--B5--B4--B3--B2--B1--B0--S.......
//   rank 3  ......f0f1f2f3f4f5f6f7B7--B6--B5--B4--B3--B2--B1--B0--S...........
// makespan (m+p-1)(F+B+W); every rank holds m micro-batches at its peak.
Schedule gpipe(int p, int m, int steps = 1);

// 1F1B with flush (PipeDream-Flush, DAPPLE, Megatron, DeepSpeed TrainSchedule). Stage s runs
// w = min(p-1-s, m) warm-up forwards, then alternates one forward and one backward, then drains.
//   rank 0  f0f1f2f3............B0--f4B1--f5B2--f6B3--f7B4--..B5--..B6--..B7--S
//   rank 1  ..f0f1f2........B0--f3B1--f4B2--f5B3--f6B4--f7B5--..B6--..B7--S...
//   rank 2  ....f0f1....B0--f2B1--f3B2--f4B3--f5B4--f6B5--f7B6--..B7--S.......
//   rank 3  ......f0B0--f1B1--f2B2--f3B3--f4B4--f5B5--f6B6--f7B7--S...........
// makespan (m+p-1)(F+B+W) as GPipe, but stage s holds
// at most min(p-s, m) micro-batches.
Schedule one_f_one_b(int p, int m, int steps = 1);

// Interleaved 1F1B (Megatron SC21): rank r holds virtual stages r, r+p, ..., r+(v-1)p, each 1/v of the
// model slice; forwards go round the ranks v times. Needs m % p == 0. Warm-up on rank r is
// min(2(p-1-r) + (v-1)p, m v) chunk forwards (all of them when m == p). Bubble ratio
// (Megatron's t_bubble / t_ideal) is (p-1)/(v m) instead of (p-1)/m.
//   p=4, m=8, v=2, a chunk costs 1/2 of a stage (F=B=W=1 per stage; the figure uses 2:2:2, so one
//   chunk forward is one unit; chunk 0 and chunk 1 both print as f/B, first pass is chunk 0):
//   rank 0  f0f1f2f3f0f1f2f3f4f5f6......B0--f7B1--..f4B2--f5B3--f6B0--f7B1--B2--..B3--..B4--..B5--..B6--..B7--B4--B5--B6--B7--S
//   rank 1  ..f0f1f2f3f0f1f2f3f4....B0--f5B1--f6B2--f7B3--f4B0--f5B1--f6B2--f7B3--..B4--..B5--..B6--..B7--B4--B5--B6--B7--S...
//   rank 2  ....f0f1f2f3f0f1f2..B0--f3B1--f4B2--f5B3--f6B0--f7B1--f4B2--f5B3--f6B4--f7B5--..B6--..B7--B4--B5--B6--B7--S.......
//   rank 3  ......f0f1f2f3f0B0--f1B1--f2B2--f3B3--f4B0--f5B1--f6B2--f7B3--f4B4--f5B5--f6B6--f7B7--B4--B5--B6--B7--S...........
Schedule interleaved(int p, int m, int v, int steps = 1);

// ZB-H1 (zero bubble, same memory as 1F1B): the backward is split into B (input gradient, on the
// critical path) and W (weight gradient, off it). Stage s postpones its first s W passes into the
// cool-down, filling the drain bubble. Idle per rank (span - busy): (p-1)(F+B-W), against
// 1F1B's (p-1)(F+B+W), i.e. one third when F = B = W.
//   rank 0  f0f1f2f3......b0w0f4b1w1f5b2w2f6b3w3f7b4w4b5w5b6w6b7w7S
//   rank 1  ..f0f1f2....b0f3b1w1f4b2w2f5b3w3f6b4w4f7b5w5b6w6b7w7w0S
//   rank 2  ....f0f1..b0f2b1f3b2w2f4b3w3f5b4w4f6b5w5f7b6w6b7w7w1w0S
//   rank 3  ......f0b0f1b1f2b2f3b3w3f4b4w4f5b5w5f6b6w6f7b7w7w2w1w0S
Schedule zb_h1(int p, int m, int steps = 1);

// ZB-H2 (zero bubble, more memory): a greedy list schedule (B first, then F while memory allows, then
// W to fill gaps) under a limit of 2p-1 micro-batches of activations. Stage s warms up with
// 2(p-s)-1 forwards; with F = B = W and m >= 2p-1 no rank idles between its first and last action.
//   rank 0  f0f1f2f3f4f5f6b0w0b1f7b2w1b3w2b4w3b5w4b6w5w6b7w7S.....
//   rank 1  ..f0f1f2f3f4b0f5b1f6b2w0b3f7b4w1b5w2b6w3w4b7w5w6w7S...
//   rank 2  ....f0f1f2b0f3b1f4b2f5b3f6b4w0b5f7b6w1w2b7w3w4w5w6w7S.
//   rank 3  ......f0b0f1b1f2b2f3b3f4b4f5b5f6b6w0f7b7w1w2w3w4w5w6w7S
Schedule zb_h2(int p, int m, const CostModel& costs, int steps = 1);

// Automatic zero-bubble heuristic: the greedy list schedule under `memory_limit` micro-batches of
// activation memory per rank, trying several priority rules and keeping the one with the smallest
// max-span (docs/ALGORITHMS.md §4.4.4, simplified: a greedy, not the ILP).
Schedule zb_auto(int p, int m, const CostModel& costs, double memory_limit, int steps = 1);

// PipeDream asynchronous 1F1B: no flush; every micro-batch is its own mini-batch and each stage
// applies an optimizer step after every backward. `m * steps` mini-batches stream through; after the
// warm-up no rank idles.
//   rank 0  f0f1f2f3............B0--f4B1--f5B2--f6B3--f7B4--S.B5--S.B6--S.B7--S
//   rank 1  ..f0f1f2........B0--f3B1--f4B2--f5B3--f6B4--f7B5--S.B6--S.B7--S...
//   rank 2  ....f0f1....B0--f2B1--f3B2--f4B3--f5B4--f6B5--f7B6--S.B7--S.......
//   rank 3  ......f0B0--f1B1--f2B2--f3B3--f4B4--f5B5--f6B6--f7B7--S...........
Schedule pipedream(int p, int m, int steps = 1);

// PipeDream-2BW: 1F1B without flush over m micro-batches per step; each stage steps after the last
// backward of each step's micro-batches while the next step's forwards are already running (two
// weight versions). Needs m >= p. Makespan over K steps: (K m + p - 1)(F+B+W) instead of
// K (m + p - 1)(F+B+W) for 1F1B with flushes. p=4, m=4, 2 steps (step 0 lands after B3, hidden
// under the next forward because it takes no time):
//   rank 0  f0f1f2f3............B0--f4B1--f5B2--f6B3--f7B4--..B5--..B6--..B7--S
//   rank 1  ..f0f1f2........B0--f3B1--f4B2--f5B3--f6B4--f7B5--..B6--..B7--S...
//   rank 2  ....f0f1....B0--f2B1--f3B2--f4B3--f5B4--f6B5--f7B6--..B7--S.......
//   rank 3  ......f0B0--f1B1--f2B2--f3B3--f4B4--f5B5--f6B6--f7B7--S...........
Schedule two_bw(int p, int m, int steps = 1);

// "spectrain" (generate() only) is pipedream's action list under its own name: SpecTrain and PipeOptim
// differ from PipeDream in the weights each pass uses (runtime/weights.h), not in the order of work.

// Stage replication with round-robin micro-batches (PipeDream's 1F1B-RR, synchronous: one flush per
// step). Stage s gets replication[s] ranks, numbered stage by stage (stage 0's replicas are ranks
// 0..r0-1, then stage 1's, ...); micro-batch i of stage s runs on its replica i mod r_s (see
// Schedule::stage_replicas), and every replica runs the stage's optimizer step, after which the runtime
// sums the replicas' gradients. Each replica orders its own micro-batches like `base`:
//   gpipe: all its forwards, then all its backwards;
//   1f1b:  at most ceil(W_s / r_s) micro-batches in flight, W_s = the ranks of stages s..S-1 (PipeDream's
//          NOAM, which is p - s, plain 1F1B, when nothing is replicated).
// Deadlock-free (checked by validate() in the tests over random replications). Throws UsageError on an
// empty replication, a count < 1, or another base.
Schedule round_robin(const std::string& base, const std::vector<int>& replication, int m, int steps = 1);

// ---- stage-to-rank placements ------------------------------------------------------------------------
// Looped: stage s on rank s mod p, so rank r holds r, r+p, ..., r+(v-1)p and forwards go round the ranks v
// times (interleaved, interleaved-zb, looped-bfs). Throws UsageError on p < 1 or v < 1.
std::vector<int> looped_placement(int p, int v);
// V-shaped: rank r holds stages r and 2p-1-r, so forwards go down the ranks and come back up; rank p-1
// holds stages p-1 and p and passes the activation between them without a transfer, and rank 0 holds
// both the first and the last stage (zb-v, v-half, v-min, dualpipev). Throws UsageError on p < 1.
std::vector<int> v_placement(int p);

// ---- schedules on a V placement (2p stages, 2 per rank) ---------------------------------------------
// In the figures of the schedules with two or more stages per rank (here and below, p = 4, m = 8) a chunk
// costs its share of the rank's slice (F = B = W = 1 per rank, so 1/2 per chunk of two), drawn at 4
// characters per unit: one chunk pass is two characters, and a rank's chunks print alike. Memory is
// counted in micro-batches of a whole rank's activations (both chunks), the unit in which 1F1B peaks at p
// on rank 0, and is released by W (the zero-bubble convention; docs/ALGORITHMS.md §4.6).
//
// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §6; PyTorch's ScheduleZBVZeroBubble):
// rank r warms up with 2(p-r)-1 forwards of its first chunk, then r pairs (second chunk, first chunk),
// then p-r rounds of (F, B, W) on its second chunk; the steady state alternates F B W of chunk 0 and of
// chunk 1; the cool-down runs the input gradients first and the deferred W last. Peak activation memory
// p micro-batches (1F1B's); with F = B = W and m >= 2p no rank idles in the steady state.
//   rank 0  f0f1f2f3f4f5f6f0b0w0f1b1w1f2b2w2f3b3w3f7b0w0f4b4w4b1w1f5b5w5b2w2f6b6w6b3w3f7b7w7b4w4b5w5b6w6b7w7S.....
//   rank 1  ..f0f1f2f3f4f0f5f1b0w0f2b1w1f3b2w2f6b0w0f4b3w3f7b1w1f5b4w4b2w2f6b5w5b3w3f7b6w6b4b7b5w4b6w5b7w6w7w7S...
//   rank 2  ....f0f1f2f0f3f1f4f2b0w0f3b1w1f5b0w0f4b2w2f6b1w1f5b3w3f7b2w2f6b4w4b3w3f7b5w5b4b6b5b7b6w4b7w5w6w7w6w7S.
//   rank 3  ......f0f0f1f1f2f2f3f3b0w0f4b0w0f4b1w1f5b1w1f5b2w2f6b2w2f6b3w3f7b3w3f7b4w4b4b5b5b6b6b7b7w4w5w6w7w5w6w7S
Schedule zb_v(int p, int m, int steps = 1);

// V-Half and V-Min (Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362):
// every micro-batch repeats one building block, shifted by 6 chunk passes per micro-batch. Rank r runs
// micro-batch i's passes at slots 6i + t with
//   V-Half: t(F chunk 0) = 2r,  t(F chunk 1) = 3p-r-2,  t(B chunk 1) = 3p+g+2r-1,  t(B chunk 0) = 6p+g-r-2,
//           g = 3 if p is even, else 0;
//   V-Min:  t(F chunk 0) = r,   t(F chunk 1) = 2p-1-r,  t(B chunk 1) = 2p+g+r,     t(B chunk 0) = 4p+g-r-1,
//           g = 2 if p is a multiple of 3, else 0;
// and each W fills the first free slot after its B (oldest first). The order of the slots is the
// schedule; the simulator then runs every pass as early as its inputs allow. A micro-batch stays on a
// rank about 6p (V-Half) or 4p (V-Min) slots, so the peak activation memory is (p+2)/2, resp. (p+4)/3
// micro-batches (integer division) instead of 1F1B's p, for a bubble of about p/(2m), resp. 2p/(3m),
// of the step (1F1B: p/m). Both then run the authors' "squeeze" (docs/ALGORITHMS.md §4.6.2): passes
// of the warm-up and the cool-down move to the earliest free slot their inputs allow without raising the
// memory peak (kept unless it lengthens the unit-time step, which it can with m < 2p), so its idle per
// rank stays within the paper's 1.5p (V-Half) and 2p (V-Min) units once m >= 2p. V-Half:
//   rank 0  f0f1f2f3f4....f0b0w0f1b1w1f2....b0b2w0f3w2f5b1b3w1f4w3f6b2b4w2f5w4f7b3b5w3f6b6w5b4w6w4f7b7b5w7b6w5w6..b7w7S
//   rank 1  ..f0f1f2f3..f0..f1b0w0f2b1w1..b0w0f4f3b2w2b1w1f5f4b3w3b2w2f6f5b4w4b3f7w3f6b5w5b4b6w4f7w6b5b7b6w5w7w6b7w7S.
//   rank 2  ....f0f1f2f0..f1..f2b0w0f3b1b0w1w0f3f4..b1b2w1f4w2f5b2b3w2f5w3f6b3b4w3f6w4f7b4b5w4f7b6b5w5b6b7w6w5b7w6w7w7S
//   rank 3  ......f0f0f1f1f2f2....b0w0b0w0f3f3b1w1b1w1f4f4b2w2b2w2f5f5b3w3b3f6w3f6b4b4w4f7w4f7b5b5b6b6w5w5b7b7w6w6w7w7S
Schedule v_half(int p, int m, int steps = 1);
// V-Min:
//   rank 0  f0f1..........f0b0w0f2....f1b1b0w1w0f3f2b2b1w2w1f4f3b3b2w3w2f5f4b4b3w4w3f6f5b5b4w5w4f7f6b6b5w6w5..f7b7b6w7w6......b7w7S
//   rank 1  ..f0........f0f1..b0w0..f1f2b0b1w0w1f2f3b1b2w1w2f3f4b2b3w2w3f4f5b3b4w3w4f5f6b4b5w4w5f6f7b5b6w5w6f7..b6b7w6w7....b7w7S.
//   rank 2  ....f0....f0....f1..b0f1w0b0f2w0b1f2w1b1f3w1b2f3w2b2f4w2b3f4w3b3f5w3b4f5w4b4f6w4b5f6w5b5f7w5b6f7w6b6w6..b7w7..b7w7S...
//   rank 3  ......f0f0........f1f1b0b0w0w0f2f2b1b1w1w1f3f3b2b2w2w2f4f4b3b3w3w3f5f5b4b4w4w4f6f6b5b5w5w5f7f7b6b6w6w6....b7b7w7w7S...
Schedule v_min(int p, int m, int steps = 1);

// DualPipeV (DeepSeek-AI, DeepSeek-V3 technical report, arXiv 2412.19437; the "cut-in-half" DualPipe of
// deepseek-ai/DualPipe): on the V placement, rank r runs 2(p-r-1) forwards of chunk 0, r+1 pairs of
// forwards (chunk 0, chunk 1), p-r-1 rounds (B chunk 1, its W, F chunk 1), then the steady state of
// m-2p+r+1 rounds of two pairs (F chunk 0 with the full backward of chunk 1; F chunk 1 with the backward
// of chunk 0), p-r-1 rounds (backward chunk 1; F chunk 1 with backward chunk 0), r+1 rounds of backwards
// of both chunks of which the second half split off their W, p-r-1 rounds (a deferred W; B chunk 0),
// and the remaining W. Needs m >= 2p. Each pair is one paired slot (action.h), written (0F4;7BW0); the
// simulator charges both passes, one after the other (DeepSeek overlaps them). `B` is a fused backward:
//   rank 0  f0f1f2f3f4f5f6f0b0w0f1b1w1f2b2w2f3f7B3--f4B0--B4--f5..B1--B5--f6..B2--B6--f7..B3--B7--b4w4b5w5b6w6b7w7S
//   rank 1  ..f0f1f2f3f4f0f5f1b0w0f2b1w1f3f6B2--f4B0--f7B3--f5B1--B4--f6..B2--B5--f7..B3--B6--B4--b7b5w7b6w5b7w6w7S
//   rank 2  ....f0f1f2f0f3f1f4f2b0w0f3f5B1--f4B0--f6B2--f5B1--f7B3--f6B2--B4--f7..B3--B5--B4--B6--b5b7b6w5b7w7w6w7S
//   rank 3  ......f0f0f1f1f2f2f3f3f4B0--f4B0--f5B1--f5B1--f6B2--f6B2--f7B3--f7B3--B4--B4--B5--B5--b6b6b7b7w6w6w7w7S
Schedule dualpipev(int p, int m, int steps = 1);

// ---- more schedules on a looped placement (p v stages) -----------------------------------------------
// Interleaved zero bubble (PyTorch's ScheduleInterleavedZeroBubble, the ZB-H1 idea on interleaved 1F1B):
// the chunk order of `interleaved`, with the backward split into B and W; rank r warms up with
// (v-1)p + (p-1-r) chunk forwards (one per hop instead of interleaved's two, since B alone is on the
// critical path) and runs each W right after its B except for the first r, which it postpones to the
// cool-down. Needs m % p == 0. p=4, m=8, v=2:
//   rank 0  f0f1f2f3f0f1f2f3......b0w0f4b1w1f5b2w2f6b3w3f7b0w0f4b1w1f5b2w2f6b3w3f7b4w4b5w5b6w6b7w7b4w4b5w5b6w6b7w7S
//   rank 1  ..f0f1f2f3f0f1f2....b0f3b1w0f4b2w1f5b3w2f6b0w3f7b1w0f4b2w1f5b3w2f6b4w3f7b5w4b6w5b7w6b4w7b5w4b6w5b7w6w7S
//   rank 2  ....f0f1f2f3f0f1..b0f2b1f3b2w0f4b3w1f5b0w2f6b1w3f7b2w0f4b3w1f5b4w2f6b5w3f7b6w4b7w5b4w6b5w7b6w4b7w5w6w7S
//   rank 3  ......f0f1f2f3f0b0f1b1f2b2f3b3w0f4b0w1f5b1w2f6b2w3f7b3w0f4b4w1f5b5w2f6b6w3f7b7w4b4w5b5w6b6w7b7w4w5w6w7S
Schedule interleaved_zb(int p, int m, int v, int steps = 1);

// Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", arXiv 2211.05953; PyTorch's
// ScheduleLoopedBFS): GPipe per chunk on a looped placement. Rank r runs all m forwards of its first
// chunk, then of its next, ...; then the fused backwards chunk by chunk from the last, newest micro-batch
// first. Like GPipe it holds all m micro-batches at its peak; unlike interleaved it needs no m % p == 0.
//   p=4, m=8, v=2:
//   rank 0  f0f1f2f3f4f5f6f7f0f1f2f3f4f5f6f7..................B7--B6--B5--B4--B3--B2--B1--B0--B7--B6--B5--B4--B3--B2--B1--B0--S
//   rank 1  ..f0f1f2f3f4f5f6f7f0f1f2f3f4f5f6f7............B7--B6--B5--B4--B3--B2--B1--B0--B7--B6--B5--B4--B3--B2--B1--B0--S...
//   rank 2  ....f0f1f2f3f4f5f6f7f0f1f2f3f4f5f6f7......B7--B6--B5--B4--B3--B2--B1--B0--B7--B6--B5--B4--B3--B2--B1--B0--S.......
//   rank 3  ......f0f1f2f3f4f5f6f7f0f1f2f3f4f5f6f7B7--B6--B5--B4--B3--B2--B1--B0--B7--B6--B5--B4--B3--B2--B1--B0--S...........
Schedule looped_bfs(int p, int m, int v, int steps = 1);

// Names accepted by generate(), in the order shown to users.
const std::vector<std::string>& schedule_names();

// What a schedule name promises, defined once here for the generators, the executor and the command
// line (none of them spells out lists of names).
struct ScheduleTraits {
  // Flushes after every step: each step's gradients are those of its own micro-batches, and the
  // reductions (loss, global norm, clipping) happen at the step. False: pipedream, 2bw, spectrain,
  // which step without a flush and use weight versions (runtime/weights.h).
  bool synchronous = true;
  // The mini-batch is one micro-batch and every stage steps after each backward (pipedream, spectrain).
  bool one_microbatch_per_step = false;
  // Several virtual stages (chunks) per rank (interleaved; --virtual V).
  bool virtual_stages = false;
  // The backward is split into B (input gradient) and W (weight gradient) actions (zb-*, v-*,
  // interleaved-zb; dualpipev in part).
  bool split_backward = false;
  // V-shaped placement: two stages per rank, r and 2p-1-r (zb-v, v-half, v-min, dualpipev); --virtual is 2 or
  // left out.
  bool v_shape = false;
};
// Throws UsageError for an unknown name, as generate() does.
ScheduleTraits schedule_traits(const std::string& name);

// Stages per rank that `name` lays out for the requested --virtual: 2 for the V shapes (which accept 1, the
// default, or 2), `virtual_stages` for the looped ones, 1 otherwise. Throws UsageError for --virtual on a
// schedule without virtual stages, naming the schedules that have them.
int stages_per_rank(const std::string& name, int virtual_stages);

// Builds the named schedule; throws UsageError for an unknown name (listing the valid ones) or bad
// sizes (naming the value and the fix).
Schedule generate(const std::string& name, const GeneratorOptions& options);
// Throws the UsageError generate(name, options) would throw, and nothing otherwise. Cheap for the V
// building blocks (v-half, v-min), whose checks come before their work (two unit-cost simulations to
// choose the squeeze); the others are generated (the plan search caches what it simulates).
void check_generator_options(const std::string& name, const GeneratorOptions& options);

}  // namespace pipetrain
