// Schedule generators: pure functions from sizes (and, for cost-aware schedules, per-stage costs) to a
// Schedule. Every schedule the runtime can run is made here; a new schedule is a new generator, never a
// new executor. Each generator below is drawn for p = 4 ranks and m = 8 micro-batches with F = B = W = 1
// (one character per time unit; `f` forward, `b` fused or input-gradient backward, `w` weight gradient,
// digits are micro-batches, `.` is idle). The figures were produced by this code's simulator.
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
  int virtual_stages = 1;    // v: virtual stages (chunks) per rank; interleaved only
  int steps = 1;             // optimizer steps to lay out back to back
  double memory_limit = 0;   // zb-auto: activation memory limit per rank in micro-batches; 0 = p (1F1B's)
  CostModel costs;           // per-stage costs for zb-h2 / zb-auto; empty = F = B = W = 1
};

// GPipe fill-drain (torchgpipe order): all forwards, then backwards in reverse micro-batch order.
//   rank 0  F0 F1 ... F7 ........... BW7 BW6 ... BW0 S
//   rank 3  ... F0 ... F7 BW7 ... BW0 ...
// makespan (m+p-1)(F+B+W); every rank holds m micro-batches at its peak.
Schedule gpipe(int p, int m, int steps = 1);

// 1F1B with flush (PipeDream-Flush, DAPPLE, Megatron, DeepSpeed TrainSchedule). Stage s runs
// w = min(p-1-s, m) warm-up forwards, then alternates one forward and one backward, then drains.
//   rank 0  f0f1f2f3bb0.f4bb1.f5bb2.f6bb3.f7bb4...bb5...bb6...bb7
//   rank 1  .f0f1f2..bb0f3bb1f4bb2f5bb3f6bb4f7bb5..bb6..bb7..
//   rank 2  ..f0f1....bb0f2bb1f3bb2f4bb3f5bb4f6bb5f7bb6....bb7
//   rank 3  ...f0bb0f1bb1f2bb2f3bb3f4bb4f5bb5f6bb6f7bb7......
// (bb = one fused backward of length B+W = 2.) makespan (m+p-1)(F+B+W) as GPipe, but stage s holds
// at most min(p-s, m) micro-batches.
Schedule one_f_one_b(int p, int m, int steps = 1);

// Interleaved 1F1B (Megatron SC21): rank r holds virtual stages r, r+p, ..., r+(v-1)p, each 1/v of the
// model slice; forwards go round the ranks v times. Needs m % p == 0. Warm-up on rank r is
// min(2(p-1-r) + (v-1)p, m v) chunk forwards (all of them when m == p). Bubble ratio
// (Megatron's t_bubble / t_ideal) is (p-1)/(v m) instead of (p-1)/m.
//   p=4 m=8 v=2, chunk F=0.5 (f = chunk 0, g = chunk 1):
//   rank 0  f0f1f2f3g0g1g2g3f4f5 ... (v times more, shorter pieces; see `pipetrain schedule`)
Schedule interleaved(int p, int m, int v, int steps = 1);

// ZB-H1 (zero bubble, same memory as 1F1B): the backward is split into B (input gradient, on the
// critical path) and W (weight gradient, off it). Stage s postpones its first s W passes into the
// cool-down, filling the drain bubble. Idle per rank (span - busy): (p-1)(F+B-W), against
// 1F1B's (p-1)(F+B+W), i.e. one third when F = B = W.
//   rank 0  f0f1f2f3b0w0f4b1w1f5b2w2f6b3w3f7b4w4..b5w5..b6w6..b7w7
//   rank 3  ...f0b0f1b1f2b2f3b3w3f4b4w4f5b5w5f6b6w6f7b7w7w2w1w0
Schedule zb_h1(int p, int m, int steps = 1);

// ZB-H2 (zero bubble, more memory): a greedy list schedule (B first, then F while memory allows, then
// W to fill gaps) under a limit of 2p-1 micro-batches of activations. Stage s warms up with
// 2(p-s)-1 forwards; with F = B = W no rank idles between its first and last action.
Schedule zb_h2(int p, int m, const CostModel& costs, int steps = 1);

// Automatic zero-bubble heuristic: the greedy list schedule under `memory_limit` micro-batches of
// activation memory per rank, trying several priority rules and keeping the one with the smallest
// max-span (ALGORITHMS.md §4.4.4, simplified: a greedy, not the ILP).
Schedule zb_auto(int p, int m, const CostModel& costs, double memory_limit, int steps = 1);

// PipeDream asynchronous 1F1B: no flush; every micro-batch is its own mini-batch and each stage
// applies an optimizer step after every backward. `m * steps` mini-batches stream through; after the
// warm-up no rank idles.
//   rank 0  f0f1f2f3bb0S f4bb1S f5 ...
Schedule pipedream(int p, int m, int steps = 1);

// PipeDream-2BW: 1F1B without flush over m micro-batches per step; each stage steps after the last
// backward of each step's micro-batches while the next step's forwards are already running (two
// weight versions). Needs m >= p. Makespan over K steps: (K m + p - 1)(F+B+W) instead of
// K (m + p - 1)(F+B+W) for 1F1B with flushes.
Schedule two_bw(int p, int m, int steps = 1);

// Names accepted by generate(), in the order shown to users.
const std::vector<std::string>& schedule_names();

// Builds the named schedule; throws UsageError for an unknown name (listing the valid ones) or bad
// sizes (naming the value and the fix).
Schedule generate(const std::string& name, const GeneratorOptions& options);

}  // namespace pipetrain
