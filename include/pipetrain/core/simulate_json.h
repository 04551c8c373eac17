// The JSON form of a simulation: what `pipetrain simulate --json` prints and what the Python module's
// Simulation.to_dict() returns, one function for both so they cannot drift apart.
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

#include "pipetrain/core/heap.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/simulate.h"

namespace pipetrain {

// Keys: schedule, stages (ranks), virtual_stages, microbatches, steps, makespan, bubble_fraction,
// max_bubble, per_stage (busy, span, bubble, peak_inflight, peak_memory, heap {total, activations,
// gradients, transfers, after}), heap_policy, and skips when the schedule has any. `heap` holds one entry
// per rank (predict_heap).
nlohmann::json simulation_json(const Schedule& s, const SimResult& r, const std::vector<HeapPeak>& heap,
                               const HeapOptions& policy);

}  // namespace pipetrain
