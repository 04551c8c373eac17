// Internal to src/core: what the schedule generators (generators.cpp) share with zb-auto's exact search
// (zb_exact.cpp).
#pragma once

#include "pipetrain/core/cost.h"

namespace pipetrain::detail {

// `costs` for p stages: unit costs when empty, one StageCost repeated when it gives one; checked.
CostModel costs_or_unit(const CostModel& costs, int p);

}  // namespace pipetrain::detail
