// The event simulator (docs/ALGORITHMS.md §1.6): runs a schedule's per-rank orders against a cost model and
// predicts when every action starts and ends, and the metrics of the run.
//
// Each rank executes its list in order; an action starts when the rank is free and its input tokens
// (dependencies.h) have arrived: a token made on another rank arrives `comm` after it was made.
// Send/receive actions in a lowered schedule are not timed separately: transfers are the `comm`
// latency on the data edge. Steps take `costs.step`. Skip routes (skip.h) add edges that cost
// comm + size / bandwidth between ranks, and peak memory counts each skip on its consumer's rank from
// its arrival until the consumer's W or BW of that micro-batch (docs/ALGORITHMS.md §1.10, P-BUNDLE-2).
// peak_memory counts activations only; what a step adds to a rank's heap besides them (weight gradients,
// the runtime's transfer buffers) is the heap model's (heap.h).
// Pure function; any thread may call it.
#pragma once

#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain {

struct SimResult {
  Timeline timeline;  // events in the order the simulator executed them (a topological order)
  Metrics metrics;    // with peak_memory filled from the cost model
};

// Throws ScheduleError (with the step x rank grid) if the schedule deadlocks, and UsageError if the
// cost model does not fit the schedule. The schedule should pass validate() first for clear messages
// about missing or misplaced actions.
SimResult simulate(const Schedule& schedule, const CostModel& costs);

// The metrics alone, as simulate(...).metrics gives them, without keeping a timeline: memory one time
// and one rank per token plus a byte per (stage, micro-batch), so planners and large p x m runs need
// little besides the schedule itself. Same errors as simulate().
Metrics simulate_metrics(const Schedule& schedule, const CostModel& costs);

struct CompactSimResult;

// The simulator's timeline in compact form: per rank the start of each of its actions other than
// transfers, in the rank's order (8 bytes per action where a TimedAction takes 48); ends are recomputed
// as the simulator computed them (start + duration). by_start runs the simulation again to learn the
// order it ran the events in (ties are drawn in that order), holding only the events not yet final. The
// writers (timeline.h) draw it as they draw simulate()'s Timeline, with the same output. It reads the
// schedule it was made from, which must outlive it.
class SimTimeline : public TimelineEvents {
 public:
  SimTimeline(const Schedule& schedule, const CostModel& costs);
  const Timeline& header() const override { return header_; }
  void by_rank(const Visit& visit) const override;
  void by_start(const Visit& visit) const override;
  void in_order(const Visit& visit) const override { by_rank(visit); }  // each rank's in its own order

 private:
  friend CompactSimResult simulate_compact(const Schedule& schedule, const CostModel& costs);
  Timeline header_;  // no events
  const Schedule* schedule_;
  CostModel costs_;
  std::vector<std::vector<double>> start_;  // [rank][k]: start of the rank's k-th action that is not a transfer
};

struct CompactSimResult {
  SimTimeline timeline;
  Metrics metrics;  // as simulate() gives them
};

// simulate() with the timeline kept compact (for drawing large p x m). Same errors as simulate().
CompactSimResult simulate_compact(const Schedule& schedule, const CostModel& costs);

}  // namespace pipetrain
