// Shared by the benchmark programs in bench/.
#pragma once

#include <algorithm>
#include <vector>

namespace pipetrain::bench {

// The median of `v` (0 when empty); the benchmarks report medians, as docs/BENCHMARKS.md asks.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace pipetrain::bench
