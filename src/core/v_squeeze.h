// Slot plans of the controllable-memory V schedules (v-half, v-min; docs/ALGORITHMS.md §4.6.2) and the
// authors' "squeeze" that moves warm-up and cool-down passes into earlier free slots. Internal to
// src/core (generators.cpp).
#pragma once

#include <array>
#include <tuple>
#include <vector>

namespace pipetrain::detail {

// A plan gives every pass of a V rank a slot. Kinds: 0 F chunk 0, 1 F chunk 1, 2 B chunk 1, 3 B chunk 0
// and, while the W passes are placed explicitly, 4 the rank's k-th W (that of its k-th B in slot order).
// plan[r][kind][i] is micro-batch i's (or the k-th W's) slot on rank r; slots of a rank are distinct.
using VPlan = std::vector<std::array<std::vector<int>, 5>>;

struct VItem {
  int slot, rank, kind, index;
  bool operator<(const VItem& o) const {
    return std::tie(slot, rank, kind, index) < std::tie(o.slot, o.rank, o.kind, o.index);
  }
};

// Every pass of the plan, in slot order (ties: rank, kind, index).
std::vector<VItem> v_items(const VPlan& plan);

// Squeezes a plan without W passes (kinds 0-3 only) and returns it so, renumbered to compact slots.
void v_squeeze(VPlan& plan);

}  // namespace pipetrain::detail
