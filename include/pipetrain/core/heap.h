// The heap model (docs/ALGORITHMS.md §1.5.1): what one training step adds to each rank's heap, predicted
// from a schedule and its cost model, in three parts, so that a prediction can be checked against
// `pipetrain train --memory` part by part:
//
//   activations  the count of §1.5 (F adds StageCost::activation, B releases b_release_fraction of it, W
//                the rest, BW all), plus each skip activation (schedule.h) on its consumer's rank from its
//                arrival (its receive; the producer's F when both stages share the rank) until the
//                consumer's W or BW;
//   gradients    a stage's weight gradients exist from the first backward of the step that makes them
//                until the stage's Step frees them: StageCost::gradient_b appears at the stage's first B
//                or BW (layers whose backward does not split compute their weight gradients there),
//                gradient_w at its first W or BW (the split layers' deferred weight gradients);
//   transfers    the message buffers the runtime holds (src/runtime/executor.cpp), StageCost::message bytes
//                per activation of a stage's output and per gradient of it:
//                - a received activation or output gradient from its allocation until the backward (B or
//                  BW) of its stage and micro-batch frees the slot that holds it. The fast path allocates
//                  it when it posts the receive: it keeps `receives_ahead` receives posted and not yet
//                  consumed (a receive counts until the F, B or BW that needs it has waited for it),
//                  walking the list in order; a receive it has not posted is posted at its own action
//                  (the reference path blocks there instead) and fills the window the same way until
//                  consumed;
//                - an input gradient from the backward that makes it until the previous stage's backward
//                  takes it (that stage on the same rank) or its send is released;
//                - a sent activation whose send is still in flight when its stage's backward frees the
//                  output: from that backward until the send is released;
//                - sends are released oldest first once more than `sends_in_flight` are in flight after an
//                  action, and all at once at a synchronous step's flush (the rank's first Step of the
//                  step) and at the end of the call. sends_in_flight = 0: every send completes at its own
//                  action (the reference path's blocking sends).
//                Sending an activation copies nothing (a single-tensor message is the output itself), so
//                it adds bytes only once the output would otherwise be freed.
//
// The walk runs over each rank's action list in order and samples after every action, as the runtime
// samples the heap; times play no part. A schedule without transfers is lowered first, with unit costs,
// as the runtime lowers it (PipelineOptions::costs empty). Not modelled: re-materialisation
// (checkpointing), the optimizer's state (allocated once, before the measured steps), weight stashing
// (pipedream, 2bw), packed copies of messages of several tensors, and the first step's layout headers
// (before them the fast path posts no receive ahead). Pure function; any thread may call it.
#pragma once

#include <vector>

#include "pipetrain/core/action.h"
#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

// The runtime's transfer policy (PipelineOptions::prefetch and reference).
struct HeapOptions {
  int receives_ahead = 4;   // receives posted ahead and not yet consumed, at most (the fast path's prefetch)
  int sends_in_flight = 4;  // sends left unreleased after an action (fast path: max(1, prefetch)); 0: none
  // The fast path with PipelineOptions::prefetch = `prefetch`, and the blocking reference path.
  static HeapOptions fast_path(int prefetch);
  static HeapOptions reference();
};

// What a step has added to a rank's heap at one moment, in its three parts.
struct HeapParts {
  double activations = 0.0;
  double gradients = 0.0;
  double transfers = 0.0;
  double total() const { return activations + gradients + transfers; }
};

// One rank's largest predicted heap growth in a step, with its parts at that moment.
struct HeapPeak : HeapParts {
  int position = -1;  // index in the rank's walked list (heap_walk's lowered one, or the schedule's own
                      // when no transfer carries bytes) of the action after which the peak is first reached
  Action after;       // that action (meaningless when position < 0: the rank has no actions)
};

// The walk itself: the lowered schedule it ran on, and per rank the parts after each of its actions
// (samples[r][k] after lowered.actions[r][k]).
struct HeapWalk {
  Schedule lowered;
  std::vector<std::vector<HeapParts>> samples;
};

// Throws UsageError if the cost model does not fit the schedule or the options are negative.
HeapWalk heap_walk(const Schedule& schedule, const CostModel& costs, const HeapOptions& options = {});

// Per rank, the peak of activations + gradients + transfers over heap_walk's samples, found without
// keeping them; without skip routes and with every message 0 the walk skips lowering (its transfers would
// add nothing), so memory stays a few bytes per rank beyond the schedule.
std::vector<HeapPeak> predict_heap(const Schedule& schedule, const CostModel& costs, const HeapOptions& options = {});

}  // namespace pipetrain
