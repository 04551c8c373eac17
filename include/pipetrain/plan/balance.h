// Balance: how many consecutive layers each stage gets. Torch-free; the runtime feeds it per-layer
// numbers (parameter counts), and plan_balance reads them from a profile (plan/profile.h).
//
// A balance is a vector (n_0, ..., n_{p-1}) with every n_s >= 1 and sum n_s = L (the layer count).
#pragma once

#include <string>
#include <vector>

namespace pipetrain {

struct Profile;

// Throws UsageError with the numbers and the fix when `balance` is not a valid split of `layers`
// layers (a zero or negative entry, a sum other than `layers`, more stages than layers, no stages).
void check_balance(const std::vector<int>& balance, int layers);

// Layer counts as equal as possible; the first L mod p stages get one layer more.
std::vector<int> balance_uniform(int layers, int stages);

// Optimal contiguous min-max partition (docs/ALGORITHMS.md §3.3): minimises the largest per-stage sum of
// `cost` over splits into `stages` non-empty parts. Dynamic programme, O(L^2 p). Among optimal splits
// it returns the one whose earlier stages are as long as possible.
std::vector<int> balance_min_max(const std::vector<double>& cost, int stages);

// The largest per-stage sum of `cost` under `balance`.
double bottleneck(const std::vector<double>& cost, const std::vector<int>& balance);

// Parses "3,2,2" into {3, 2, 2}; throws UsageError naming the text on anything else.
std::vector<int> parse_balance(const std::string& text);

// torchgpipe's block-partition heuristic (docs/ALGORITHMS.md §3.1, after Barany et al.), with its exact
// semantics so balances match torchgpipe's balance_by_time / balance_by_size on the same costs:
//  - costs are normalised to (x - min) / (max - min), all zeros when max = min;
//  - the start is boundaries at floor(L/k) * 1, ..., floor(L/k) * (k-1), so with equal costs the
//    remainder goes to the last stage;
//  - P is the block with the largest normalised sum (ties: the highest index), Q the one with the
//    smallest (ties: the lowest index); stop when sum(P) <= sum(Q) + 1; otherwise move one element
//    into Q from its neighbour H on P's side (the last element of H when P < Q, the first when Q < P),
//    and pick a new P only when H was P.
// The stopping rule holds for normalised sums, so the result is not min-max optimal (e.g. [5,1,...,1,9]
// with 10 layers in 3 stages gives 3,3,4 with bottleneck 12 where 9 is possible). Costs must be finite
// and >= 0; 1 <= stages <= L.
// torchgpipe's loop can end with an empty stage ([0,0,1,1] in 3 stages gives 3,0,1) or never end
// ([0,0,0,0,1,1] in 5 stages); both happen mostly with many tied costs. Where torchgpipe would return
// such a balance or hang, this throws UsageError saying so and pointing to the min-max solver: every
// returned balance passes check_balance.
std::vector<int> balance_block_partition(const std::vector<double>& cost, int stages);

// The two solvers for a per-layer cost vector. min_max (balance_min_max, docs/ALGORITHMS.md §3.3) is the
// default: it is never worse than block_partition in the largest stage sum.
enum class BalanceSolver { min_max, block_partition };

// "min-max" (also "optimal") or "block-partition" (also "torchgpipe"); UsageError lists them otherwise.
BalanceSolver parse_balance_solver(const std::string& name);
const char* to_string(BalanceSolver solver);
std::vector<int> solve_balance(const std::vector<double>& cost, int stages, BalanceSolver solver);

// The per-layer cost that balance `kind` minimises the largest stage sum of:
//   uniform      1 per layer (DeepSpeed "uniform": balances layer counts)
//   parameters   parameter_bytes (DeepSpeed's default "parameters"; bytes are proportional to the
//                count when the weights share one dtype)
//   type:REGEX   1 if the layer's type matches REGEX, else 0 (DeepSpeed "type:..."): stages get equal
//                numbers of matching layers, e.g. type:Block for transformer blocks. As DeepSpeed does,
//                the match is a case-insensitive search (anywhere in the name); the ECMAScript subset of
//                core/pattern.h, matched without backtracking (linear in the name). No
//                matching layer is an error listing the types present.
//   time         forward_ms + backward_ms (torchgpipe balance_by_time)
//   memory       activation_bytes + 2 * parameter_bytes + optimizer_bytes: one micro-batch's output
//                activations plus weights, their gradients and the optimizer state. torchgpipe's
//                balance_by_size counts activations plus param_scale x parameters, with param_scale 2
//                for plain SGD (weights and gradients) and more for stateful optimizers; here the
//                optimizer's share comes from the profile instead of a guessed scale.
// Throws UsageError for an unknown kind, listing the valid ones.
std::vector<double> balance_costs(const Profile& profile, const std::string& kind);

// The balance for `stages` stages: `kind` is one of balance_costs' kinds, solved by `solver`, or a
// manual list such as "3,2,2" (which must have `stages` entries and sum to the layer count; the solver
// is not used). Every result passes check_balance. Throws UsageError on stages < 1 or > layers.
std::vector<int> plan_balance(const Profile& profile, int stages, const std::string& kind,
                              BalanceSolver solver = BalanceSolver::min_max);

// The kinds plan_balance accepts, for help texts: "uniform", "parameters", "type:REGEX", "time",
// "memory", "N,N,...".
std::vector<std::string> balance_kinds();

}  // namespace pipetrain
