// Offline validation of a schedule, before anything runs (docs/ALGORITHMS.md §1.4):
//   1. sizes and owners: every action names an existing stage and micro-batch (or step) and sits on the
//      rank that owns its stage;
//   2. completeness: every F once; per (stage, micro-batch) either one BW or one B and one W; if the
//      schedule has optimizer steps, one per (stage, step);
//   3. local order: F before its backward, B before W, a step after every backward of its micro-batches,
//      and (synchronous schedules) the next step's forwards after the step;
//   4. no deadlock: a dry run in which every action waits for its inputs. In a lowered schedule (one with
//      send/receive actions) a send and its receive complete together (rendezvous), as on a blocking
//      transport, and a compute action may use data from another rank only after receiving it;
//   5. memory: the activation memory of each rank stays within `memory_limit`.
// A failure throws ScheduleError whose message says what is wrong and prints the step x rank grid with
// the offending cell marked. Pure; any thread may call it.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

struct ValidateOptions {
  // Activation memory limit per rank in micro-batches (one micro-batch of a whole stage = 1; a chunk of
  // an interleaved schedule holds 1/v). Infinity disables the check.
  double memory_limit = std::numeric_limits<double>::infinity();
  // Costs whose `activation` and `b_release_fraction` define memory; empty = uniform (1 per stage, 1/v
  // per chunk, B frees half).
  CostModel costs;
};

void validate(const Schedule& schedule, const ValidateOptions& options = {});

// What every consumer of a schedule needs before it reads one (simulate, insert_communication,
// predict_heap, to_csv call it): sizes that agree (ranks, stages, rows, owners, replicas), every action's
// stage, micro-batch (or step) and peer in range, and skip routes between existing stages. One pass over
// the actions; throws ScheduleError as validate() does. It does not check completeness, order or deadlock
// (validate() does): the simulator reports a deadlock, and an incomplete schedule simulates as written.
void check_ranges(const Schedule& schedule);

// A cell of the step x rank grid: rank r's action at position `pos` of its list.
struct GridCell {
  int rank = 0;
  int pos = 0;
};

// Renders the schedule as a grid (one row per rank, one column per position), marking the given cells
// as [..]. Long schedules show a window around the first marked cell.
std::string render_grid(const Schedule& schedule, const std::vector<GridCell>& marked);

}  // namespace pipetrain
