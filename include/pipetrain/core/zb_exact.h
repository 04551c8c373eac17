// Exact zero-bubble scheduling for small cases: a branch and bound over the per-rank orders of F, B and W
// that finds the order with the smallest simulated makespan under zb-auto's activation-memory limit and
// cost model, and says how far zb-auto's greedy schedule (generators.h) is from it (docs/ALGORITHMS.md
// §4.4.5).
//
// The search is deterministic: its budget counts search nodes, never time, so the same input gives the
// same schedule, bound and node count on every machine. Pure function; any thread may call it.
#pragma once

#include <functional>
#include <string>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

struct ZbExactOptions {
  double memory_limit = 0;           // activation memory per rank in micro-batches, as zb_auto's; 0 = p
  long long node_budget = 2'000'000;  // search nodes before giving up the proof (>= 1)
  int steps = 1;                     // optimizer steps: the best step is laid out this many times
  // Start from zb-auto's greedy schedule as the one to beat (prunes from the first node). false: the
  // search alone must find the optimum (the tests check it that way); the greedy is still the fallback.
  bool start_from_greedy = true;
  // Called every 4,096 search nodes, if set: it may throw to abandon the search (the exception reaches the
  // caller; the Python module raises KeyboardInterrupt on Ctrl-C this way). It never changes the result.
  std::function<void()> interrupt;
};

struct ZbExactResult {
  Schedule schedule;              // the best schedule found, named "zb-auto" (it runs as zb-auto does)
  double makespan = 0;            // simulated makespan of one step of `schedule`
  double lower_bound = 0;         // no schedule of one step is shorter; == makespan when proven
  bool proven = false;            // the search finished within the budget: `makespan` is the optimum
  long long nodes = 0;            // search nodes expanded
  double greedy_makespan = 0;     // simulated makespan of one step of zb_auto under the same limit
  // How much longer the greedy step is than the best found, in percent of the best (>= 0).
  double gap_percent() const;
  // One line: "zb-auto greedy 13.000, exact 12.000 (optimal, 5123 nodes): the greedy is 8.33% longer".
  std::string summary() const;
};

// The largest p * m the exact search accepts (it places 3 p m passes per step).
inline constexpr int kZbExactMaxRanksTimesMicrobatches = 64;

// The largest node budget the search accepts (--exact-nodes): 10 x the command's default of 5 million.
// The budget counts nodes, not time, so that a search gives the same answer on every machine; this bound
// keeps the longest search to tens of minutes (30,000-50,000 nodes a second on one core of the loaded
// 2-core test machine, p x m = 64: 5 million nodes took 2-3 minutes) instead of the days that
// 99999999999999 nodes would have run without a word. A search that stops at its budget still reports
// the best schedule found and a lower bound.
inline constexpr long long kZbExactMaxNodes = 50'000'000;

// Searches the orders in which every rank runs its forwards and input-gradient backwards in micro-batch
// order and its weight-gradient passes oldest first; on identical micro-batches this loses nothing (the
// tests check it against an enumeration of all orders on tiny cases). Memory as zb_auto counts it: F adds
// the stage's activation, B releases `b_release_fraction` of it, W the rest, and no rank may exceed the
// limit. The makespan includes the optimizer step. Starts from zb_auto's greedy schedule, so the result
// is never worse than it. Throws UsageError on bad sizes, p * m above the supported size, a limit below one
// micro-batch, a node budget < 1, or costs that make the search unsound (an input-gradient backward of
// zero time with free transfers).
ZbExactResult zb_exact(int p, int m, const CostModel& costs, const ZbExactOptions& options = {});

}  // namespace pipetrain
