#include "pipetrain/plan/balance.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <sstream>

#include "pipetrain/core/error.h"

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
    if (!(c >= 0)) throw UsageError("layer costs must be >= 0 to balance by them");
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + cost[static_cast<std::size_t>(i)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[q][j]: minimal bottleneck of the first j layers in q parts; cut[q][j]: start of the last part.
  std::vector<std::vector<double>> best(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> cut(best.size(), std::vector<int>(static_cast<std::size_t>(n) + 1, 0));
  best[0][0] = 0;
  for (int q = 1; q <= stages; ++q)
    for (int j = q; j <= n - (stages - q); ++j)
      for (int i = j - 1; i >= q - 1; --i) {  // last part is [i, j); prefer the longest earlier parts
        const double v = std::max(best[static_cast<std::size_t>(q) - 1][static_cast<std::size_t>(i)],
                                  prefix[static_cast<std::size_t>(j)] - prefix[static_cast<std::size_t>(i)]);
        if (v < best[static_cast<std::size_t>(q)][static_cast<std::size_t>(j)] - 1e-12 * (1 + std::abs(v))) {
          best[static_cast<std::size_t>(q)][static_cast<std::size_t>(j)] = v;
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

}  // namespace pipetrain
