// Balance: how many consecutive layers each stage gets. Torch-free; the runtime feeds it per-layer
// numbers (parameter counts now, measured times and memory with the profiler later).
//
// A balance is a vector (n_0, ..., n_{p-1}) with every n_s >= 1 and sum n_s = L (the layer count).
#pragma once

#include <string>
#include <vector>

namespace pipetrain {

// Throws UsageError with the numbers and the fix when `balance` is not a valid split of `layers`
// layers (a zero or negative entry, a sum other than `layers`, more stages than layers, no stages).
void check_balance(const std::vector<int>& balance, int layers);

// Layer counts as equal as possible; the first L mod p stages get one layer more.
std::vector<int> balance_uniform(int layers, int stages);

// Optimal contiguous min-max partition (ALGORITHMS.md §3.3): minimises the largest per-stage sum of
// `cost` over splits into `stages` non-empty parts. Dynamic programme, O(L^2 p). Among optimal splits
// it returns the one whose earlier stages are as long as possible.
std::vector<int> balance_min_max(const std::vector<double>& cost, int stages);

// The largest per-stage sum of `cost` under `balance`.
double bottleneck(const std::vector<double>& cost, const std::vector<int>& balance);

// Parses "3,2,2" into {3, 2, 2}; throws UsageError naming the text on anything else.
std::vector<int> parse_balance(const std::string& text);

}  // namespace pipetrain
