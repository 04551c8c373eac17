// The cost model that the simulator and the cost-aware generators read: per (virtual) stage times for
// F, B and W, the time of one hop between ranks, and activation memory per micro-batch.
//
// Units are the caller's: the command line uses milliseconds for measured profiles and plain "units"
// for synthetic costs. A fused backward (BW) costs B + W. Memory follows the zero-bubble convention
// (docs/ALGORITHMS.md §1.5): F adds `activation[s]`; B releases `b_release_fraction` of it, W the rest; BW
// releases all of it.
#pragma once

#include <string>
#include <vector>

#include "pipetrain/core/action.h"

namespace pipetrain {

struct StageCost {
  double f = 1.0;           // forward time per micro-batch
  double b = 1.0;           // input-gradient backward time per micro-batch
  double w = 1.0;           // weight-gradient backward time per micro-batch
  double activation = 1.0;  // activation memory one micro-batch holds from F until its backward ends
  // For the heap model (heap.h), in the same memory units; 0 by default (synthetic costs model none):
  double gradient_b = 0.0;  // weight-gradient memory the stage's first B (or BW) of a step makes
  double gradient_w = 0.0;  // weight-gradient memory its first W (or BW) of a step makes
  double message = 0.0;     // one micro-batch's output as sent to the next stage (and its gradient back)
  // The heap model only: what one micro-batch still holds after its B, for its W (a measured profile's
  // split layers' w_held_bytes; 0 for a stage none of whose layers split). It may exceed `activation`:
  // autograd's split keeps output gradients for W. < 0 (the default): activation x (1 -
  // b_release_fraction), as the simulator's activation count keeps it.
  double w_held = -1.0;
};

// The largest time of one action a cost model accepts: the simulator sums many of them, and costs such
// as 1e308 overflowed to infinity (reported as a deadlock).
inline constexpr double kMaxActionCost = 1e12;

struct CostModel {
  std::vector<StageCost> stage;     // one entry per virtual stage
  double comm = 0.0;                // time of one activation or gradient transfer between two ranks
  // Per stage boundary: boundary_comm[s] is the time of one transfer between stage s and stage s+1 (the
  // activation forward, its gradient back) when they sit on different ranks, e.g. from the bytes that
  // cross that cut and the link it crosses. Empty (the default): every transfer costs `comm`; otherwise
  // one entry per boundary (stages - 1). Send/receive actions of a lowered schedule still cost `comm`.
  std::vector<double> boundary_comm;
  double step = 0.0;                // time of an optimizer step
  // Memory units per time unit a skip transfer moves (skip.h): a skip of size x costs comm + x / bandwidth.
  // 0 (the default): unlimited, a skip costs `comm` like any other transfer.
  double bandwidth = 0.0;
  // Extra time of stage s's optimizer step, e.g. the all-reduce of its replicas' gradients (1F1B-RR).
  // Empty: none; otherwise one entry per stage.
  std::vector<double> stage_step;
  double b_release_fraction = 0.5;  // share of a micro-batch's activation memory that B frees
  // The runtime's own time per compute action (F, B, W, BW; a fused BW is one action): the interpreter's
  // work between actions, measured on empty layers (`pipetrain profile --transport`) or from a run's
  // timeline. Added to each compute action's duration; 0 (the default) leaves the compute times alone.
  double overhead = 0.0;

  // Every one of `stages` virtual stages costs `per_stage` split evenly over `virtual_per_rank` chunks
  // (an interleaved chunk holds 1/v of a rank's layers, so its times and memory are 1/v).
  static CostModel uniform(int stages, StageCost per_stage, int virtual_per_rank = 1, double comm = 0.0);

  // Time of one action on its stage (compute actions: their cost plus `overhead`); communication and
  // Step actions cost `comm` and `step`.
  double duration(const Action& a) const;
  // Change of the rank's activation memory when the action runs (positive for F).
  double memory_delta(const Action& a) const;
  // Time for a token made on stage `from` to reach stage `to` on another rank: boundary_comm of the cut
  // between them when they are neighbours and boundary_comm is given, else `comm`.
  double transfer(int from, int to) const {
    if (boundary_comm.empty()) return comm;
    const int lo = from < to ? from : to;
    if (from - to != 1 && to - from != 1) return comm;
    return boundary_comm[static_cast<std::size_t>(lo)];
  }

  // Throws UsageError if any value is negative or not finite, or the stage count differs from `stages`.
  void check(int stages) const;
};

// Parses "F:B:W" (one triple for every stage) or "F:B:W,F:B:W,..." (one per stage, in stage order).
// Throws UsageError naming the text and the expected form; negative values are rejected.
std::vector<StageCost> parse_stage_costs(const std::string& text);

struct Schedule;
// The cost model of schedule `s` from triples a user gave (parse_stage_costs) and `comm` per transfer: one
// triple for every stage, one per stage, or one per rank (each of a rank's v stages then costs 1/v of it;
// not for replicated stages, which share their stage's cost). `what` names the setting in messages
// ("--cost" on the command line). Throws UsageError naming the count given and the counts that fit.
CostModel costs_from_triples(const Schedule& s, const std::vector<StageCost>& given, double comm,
                             const std::string& what);

}  // namespace pipetrain
