// Lowering passes: Schedule -> Schedule transformations applied before execution.
//
// insert_communication adds a send after every action whose output another rank needs and a receive
// before every action that needs it, in an order that cannot deadlock even when every send blocks until
// its receive is posted (rendezvous). How: the simulator (with `costs`) gives every action a time; every
// transfer takes the time its data is made, and each rank's actions and transfers are sorted by time,
// with transfer ties broken the same way on both ranks. All ranks then meet their transfers in one
// global order, so the earliest unfinished transfer can always complete:
//
//   naive (each send right after its producer, each receive right before its consumer) deadlocks:
//     rank 0:  0F0 0SF0 0F1 [0SF1] 0RB0 0BW0 ...      rank 0 blocks sending activation 1 ...
//     rank 1:  1RF0 1F0 1BW0 [1SB0] 1RF1 1F1 ...      ... while rank 1 blocks sending gradient 0
//   lowered (p = 2, m = 2, 1F1B, unit costs):
//     rank 0:  0F0 0SF0 0F1 0SF1 0RB0 0BW0 0RB1 0BW1 0S0
//     rank 1:  1RF0 1F0 1RF1 1BW0 1SB0 1F1 1BW1 1SB1 1S0
//   activation 1 is made (t=2) before gradient 0 (t=4), so both ranks move it first.
//
// The costs only decide how early each transfer is posted (performance), never whether the result is
// deadlock-free. Skip routes (schedule.h, skip.h) get transfers the same way: a skip send after the
// producer's F (and of the gradient after the consumer's B or BW), its receive on the other rank at the
// same place in the global order, so before the action that needs it. Pure; any thread may call it.
#pragma once

#include "pipetrain/core/cost.h"
#include "pipetrain/core/schedule.h"

namespace pipetrain {

// Returns `schedule` with send and receive actions inserted. The input must hold no communication
// actions and should pass validate(). `costs` empty = F = B = W = 1 per stage.
Schedule insert_communication(const Schedule& schedule, const CostModel& costs = {});

// Returns `schedule` without its send and receive actions (the inverse of insert_communication).
Schedule strip_communication(const Schedule& schedule);

}  // namespace pipetrain
