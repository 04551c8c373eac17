#include "pipetrain/plan/balance.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <numeric>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>

#include "pipetrain/core/error.h"
#include "pipetrain/core/pattern.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain {
namespace {
std::string join(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
  return out;
}
}  // namespace

void check_balance(const std::vector<int>& balance, int layers) {
  const std::string given = "balance " + join(balance);
  if (balance.empty()) throw UsageError("the balance is empty: give one layer count per stage, e.g. --balance 2,2");
  if (static_cast<int>(balance.size()) > layers)
    throw UsageError(given + " has " + std::to_string(balance.size()) + " stages but the model has " +
                     std::to_string(layers) + " layers: use at most " + std::to_string(layers) + " stages");
  for (std::size_t s = 0; s < balance.size(); ++s)
    if (balance[s] < 1)
      throw UsageError(given + " gives stage " + std::to_string(s) + " " + std::to_string(balance[s]) +
                       " layers: every stage needs at least 1");
  const long sum = std::accumulate(balance.begin(), balance.end(), 0L);
  if (sum != layers)
    throw UsageError(given + " sums to " + std::to_string(sum) + " but the model has " + std::to_string(layers) +
                     " layers: the counts must add up to " + std::to_string(layers) +
                     " (no layer may be dropped or repeated)");
}

std::vector<int> balance_uniform(int layers, int stages) {
  if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
  if (stages > layers)
    throw UsageError(std::to_string(stages) + " stages but the model has " + std::to_string(layers) +
                     " layers: use --stages <= " + std::to_string(layers));
  std::vector<int> out(static_cast<std::size_t>(stages), layers / stages);
  for (int s = 0; s < layers % stages; ++s) ++out[static_cast<std::size_t>(s)];
  return out;
}

std::vector<int> balance_min_max(const std::vector<double>& cost, int stages) {
  const int n = static_cast<int>(cost.size());
  if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
  if (stages > n)
    throw UsageError(std::to_string(stages) + " stages but the model has " + std::to_string(n) +
                     " layers: use --stages <= " + std::to_string(n));
  for (double c : cost)
    if (!(c >= 0) || !std::isfinite(c)) throw UsageError("layer costs must be finite and >= 0 to balance by them");
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + cost[static_cast<std::size_t>(i)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[q][j]: minimal bottleneck of the first j layers in q parts; cut[q][j]: start of the last part.
  // For the last part [i, j), v(i) = max(best[q-1][i], prefix[j] - prefix[i]): the first term never
  // falls as i grows (more layers in as many parts), the second never rises, so v falls then rises and
  // the best i is where they cross: a binary search, O(p L log L) in all (the scan over every i was
  // O(p L^2): 100k layers took minutes). Among i within the tolerance of the minimum the largest wins
  // (the earlier parts as long as possible), as the scan from i = j - 1 downwards chose.
  std::vector<std::vector<double>> best(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> cut(best.size(), std::vector<int>(static_cast<std::size_t>(n) + 1, 0));
  best[0][0] = 0;
  auto tol = [](double v) { return 1e-12 * (1 + std::abs(v)); };
  for (int q = 1; q <= stages; ++q) {
    const std::vector<double>& prev = best[static_cast<std::size_t>(q) - 1];
    for (int j = q; j <= n - (stages - q); ++j) {
      const double pj = prefix[static_cast<std::size_t>(j)];
      auto left = [&](int i) { return prev[static_cast<std::size_t>(i)]; };
      auto right = [&](int i) { return pj - prefix[static_cast<std::size_t>(i)]; };
      // The first i in [q-1, j-1] with left(i) >= right(i) (j if none).
      int lo = q - 1, hi = j;
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (left(mid) >= right(mid)) hi = mid;
        else lo = mid + 1;
      }
      const int cross = lo;
      double v = inf;
      if (cross < j) v = left(cross);                                   // v = left from cross on, rising
      if (cross > q - 1) v = std::min(v, right(cross - 1));             // v = right before cross, falling
      // The largest i with v(i) <= v + tol: past cross, v = left(i) rises, so the last such i there;
      // else the largest before cross (right falls towards cross, so cross - 1).
      int a = cross, z = j;  // last i in [cross, j) with left(i) <= v + tol
      while (a < z) {
        const int mid = a + (z - a) / 2;
        if (left(mid) <= v + tol(v)) a = mid + 1;
        else z = mid;
      }
      const int i = a > cross ? a - 1 : cross - 1;
      best[static_cast<std::size_t>(q)][static_cast<std::size_t>(j)] = std::max(left(i), right(i));
      cut[static_cast<std::size_t>(q)][static_cast<std::size_t>(j)] = i;
    }
  }
  std::vector<int> out(static_cast<std::size_t>(stages));
  for (int q = stages, j = n; q >= 1; --q) {
    const int i = cut[static_cast<std::size_t>(q)][static_cast<std::size_t>(j)];
    out[static_cast<std::size_t>(q) - 1] = j - i;
    j = i;
  }
  return out;
}

double bottleneck(const std::vector<double>& cost, const std::vector<int>& balance) {
  check_balance(balance, static_cast<int>(cost.size()));
  double worst = 0;
  std::size_t at = 0;
  for (int count : balance) {
    double sum = 0;
    for (int k = 0; k < count; ++k) sum += cost[at++];
    worst = std::max(worst, sum);
  }
  return worst;
}

std::vector<int> parse_balance(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      std::size_t used = 0;
      const int v = std::stoi(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw UsageError("balance '" + text + "' must be layer counts separated by commas, e.g. 3,2,2");
    }
  }
  if (out.empty()) throw UsageError("balance '" + text + "' is empty: give one layer count per stage, e.g. 3,2,2");
  return out;
}

std::vector<int> balance_block_partition(const std::vector<double>& cost, int stages) {
  const int n = static_cast<int>(cost.size());
  if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
  if (stages > n)
    throw UsageError(std::to_string(stages) + " stages but the model has " + std::to_string(n) +
                     " layers: use --stages <= " + std::to_string(n));
  for (double c : cost)
    if (!(c >= 0) || !std::isfinite(c)) throw UsageError("layer costs must be finite and >= 0 to balance by them");
  const double lo = *std::min_element(cost.begin(), cost.end());
  const double range = *std::max_element(cost.begin(), cost.end()) - lo;
  std::vector<double> y(cost.size(), 0.0);
  if (range != 0)
    for (std::size_t i = 0; i < cost.size(); ++i) y[i] = (cost[i] - lo) / range;
  const std::size_t k = static_cast<std::size_t>(stages);
  // ends[b] is one past the last layer of block b. The moves can push a boundary past its neighbour
  // or out of [0, L]; blocks are then read as torchgpipe's Python slices read them (clamped, empty when
  // reversed), so the walk is the same one torchgpipe takes.
  std::vector<long> ends(k);
  for (std::size_t b = 0; b + 1 < k; ++b) ends[b] = static_cast<long>(n / stages) * static_cast<long>(b + 1);
  ends.back() = n;
  std::vector<double> sums(k);
  auto clamp = [&](long i) { return std::min<long>(std::max<long>(i, 0), n); };
  auto update_sums = [&]() {
    for (std::size_t b = 0; b < k; ++b) {
      double sum = 0;  // left to right from 0, as Python's sum(), so ties compare exactly as there
      for (long i = clamp(b > 0 ? ends[b - 1] : 0); i < clamp(ends[b]); ++i) sum += y[static_cast<std::size_t>(i)];
      sums[b] = sum;
    }
  };
  // torchgpipe's loop does not always stop (e.g. [0,0,0,0,1,1] in 5 stages walks a boundary off the
  // end forever). Runs that stop take far fewer than L^2 k moves (in random tests at most 0.4 L k), so
  // that budget separates the two.
  long budget = static_cast<long>(n) * n * stages + 1000;
  update_sums();
  for (;;) {
    std::size_t p = 0;
    for (std::size_t b = 1; b < k; ++b)
      if (sums[b] >= sums[p]) p = b;  // ties: the highest index
    const double most = sums[p];
    for (;;) {
      std::size_t q = 0;
      for (std::size_t b = 1; b < k; ++b)
        if (sums[b] < sums[q]) q = b;  // ties: the lowest index
      if (most <= sums[q] + 1) {
        std::vector<int> out(k);
        for (std::size_t b = 0; b < k; ++b) {
          const long len = ends[b] - (b > 0 ? ends[b - 1] : 0);
          if (len < 1)
            throw UsageError("torchgpipe's block partition leaves stage " + std::to_string(b) +
                             " without layers for these costs (torchgpipe itself would return that balance and "
                             "fail); use the min-max solver");
          out[b] = static_cast<int>(len);
        }
        return out;
      }
      if (--budget < 0)
        throw UsageError(
            "torchgpipe's block partition does not terminate for these costs (its loop would run "
            "forever); use the min-max solver");
      std::size_t h;
      if (p < q) {
        h = q - 1;
        --ends[h];  // the last element of H joins Q
      } else {
        h = q + 1;
        ++ends[q];  // the first element of H joins Q
      }
      update_sums();
      if (h == p) break;
    }
  }
}

BalanceSolver parse_balance_solver(const std::string& name) {
  if (name == "min-max" || name == "optimal") return BalanceSolver::min_max;
  if (name == "block-partition" || name == "torchgpipe") return BalanceSolver::block_partition;
  throw UsageError("unknown balance solver '" + name +
                   "': use min-max (optimal, the default) or block-partition (torchgpipe's heuristic)");
}

const char* to_string(BalanceSolver solver) { return solver == BalanceSolver::min_max ? "min-max" : "block-partition"; }

std::vector<int> solve_balance(const std::vector<double>& cost, int stages, BalanceSolver solver) {
  return solver == BalanceSolver::min_max ? balance_min_max(cost, stages) : balance_block_partition(cost, stages);
}

std::vector<std::string> balance_kinds() {
  return {"uniform", "parameters", "type:REGEX", "time", "memory", "N,N,..."};
}

std::vector<double> balance_costs(const Profile& profile, const std::string& kind) {
  std::vector<double> out;
  out.reserve(profile.layers.size());
  if (kind == "uniform") {
    out.assign(profile.layers.size(), 1.0);
  } else if (kind == "parameters") {
    for (const LayerProfile& l : profile.layers) out.push_back(l.parameter_bytes);
  } else if (kind == "time") {
    for (const LayerProfile& l : profile.layers) out.push_back(l.forward_ms + l.backward_ms);
  } else if (kind == "memory") {
    for (const LayerProfile& l : profile.layers)
      out.push_back(l.held_bytes() + 2 * l.parameter_bytes + l.optimizer_bytes);
  } else if (kind.rfind("type:", 0) == 0) {
    const std::string pattern = kind.substr(5);
    if (pattern.empty()) throw UsageError("balance 'type:' needs a regular expression, e.g. type:Block");
    // Pattern never backtracks: linear in the type name for any pattern (std::regex took minutes on
    // type:(a*)*b against 18-character names).
    std::unique_ptr<Pattern> re;
    try {
      re = std::make_unique<Pattern>(pattern, true);
    } catch (const UsageError& e) {
      throw UsageError("balance '" + kind + "': not a valid regular expression: " + e.what() +
                       "; e.g. type:Block or type:^Linear$");
    }
    bool any = false;
    for (const LayerProfile& l : profile.layers) {
      const bool hit = re->search(l.type);
      any = any || hit;
      out.push_back(hit ? 1.0 : 0.0);
    }
    if (!any) {
      std::set<std::string> types;
      for (const LayerProfile& l : profile.layers) types.insert(l.type);
      std::string list;
      for (const std::string& t : types) list += (list.empty() ? "" : ", ") + t;
      throw UsageError("balance '" + kind + "' matches no layer type; the profile's types are: " + list);
    }
  } else {
    std::string list;
    for (const std::string& k : balance_kinds()) list += (list.empty() ? "" : ", ") + k;
    throw UsageError("unknown balance '" + kind + "': use one of " + list + " (e.g. 3,2,2 for manual counts)");
  }
  return out;
}

std::vector<int> plan_balance(const Profile& profile, int stages, const std::string& kind, BalanceSolver solver) {
  const int layers = static_cast<int>(profile.layers.size());
  if (!kind.empty() && std::isdigit(static_cast<unsigned char>(kind[0]))) {
    std::vector<int> balance = parse_balance(kind);
    if (static_cast<int>(balance.size()) != stages)
      throw UsageError("balance " + kind + " lists " + std::to_string(balance.size()) + " stages but " +
                       std::to_string(stages) + " are needed: give one layer count per stage");
    check_balance(balance, layers);
    return balance;
  }
  const std::vector<double> cost = balance_costs(profile, kind);  // unknown kinds fail before stage checks
  std::vector<int> balance = solve_balance(cost, stages, solver);
  check_balance(balance, layers);
  return balance;
}

}  // namespace pipetrain
