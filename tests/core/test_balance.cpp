// Checks the balance helpers (plan/balance.h): rejection of bad balances with the numbers and the fix,
// the uniform split (remainder to the first stages), and the optimal min-max split against brute force
// over every contiguous split of random inputs (ALGORITHMS.md §3.3 properties: optimal, at least
// max(max cost, total/p), k = 1 gives the total and k = L the largest cost).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/balance.h"

using namespace pipetrain;

namespace {
std::string message(const std::vector<int>& b, int layers) {
  try {
    check_balance(b, layers);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "accepted";
}

// Smallest bottleneck over all splits of cost into k non-empty contiguous parts.
double brute_force(const std::vector<double>& cost, int k, std::size_t start = 0) {
  if (k == 1) return std::accumulate(cost.begin() + static_cast<long>(start), cost.end(), 0.0);
  double best = 1e300, sum = 0;
  for (std::size_t end = start + 1; end + static_cast<std::size_t>(k - 1) <= cost.size(); ++end) {
    sum += cost[end - 1];
    best = std::min(best, std::max(sum, brute_force(cost, k - 1, end)));
  }
  return best;
}
}  // namespace

TEST(Balance, BadBalancesNameTheNumbers) {
  EXPECT_EQ(message({2, 2}, 4), "accepted");
  EXPECT_NE(message({2, 1}, 4).find("sums to 3 but the model has 4 layers"), std::string::npos);
  EXPECT_NE(message({2, 0, 2}, 4).find("gives stage 1 0 layers"), std::string::npos);
  EXPECT_NE(message({1, 1, 1, 1, 1}, 4).find("use at most 4 stages"), std::string::npos);
  EXPECT_NE(message({}, 4).find("empty"), std::string::npos);
  EXPECT_THROW(parse_balance("3,x"), UsageError);
  EXPECT_EQ(parse_balance("3,2,2"), (std::vector<int>{3, 2, 2}));
}

TEST(Balance, UniformPutsTheRemainderFirst) {
  EXPECT_EQ(balance_uniform(10, 4), (std::vector<int>{3, 3, 2, 2}));
  EXPECT_EQ(balance_uniform(4, 4), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_THROW(balance_uniform(3, 4), UsageError);
}

TEST(Balance, MinMaxIsOptimalOnRandomInputs) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(n));
    std::vector<double> cost(static_cast<std::size_t>(n));
    for (double& c : cost) c = static_cast<double>(rng() % 20);
    const std::vector<int> b = balance_min_max(cost, k);
    ASSERT_NO_THROW(check_balance(b, n));
    const double got = bottleneck(cost, b);
    EXPECT_DOUBLE_EQ(got, brute_force(cost, k));
    const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
    EXPECT_GE(got + 1e-12, std::max(*std::max_element(cost.begin(), cost.end()), total / k));
  }
}

TEST(Balance, MinMaxEdgeCases) {
  const std::vector<double> cost{5, 1, 1, 1, 1, 1, 1, 1, 1, 9};
  EXPECT_DOUBLE_EQ(bottleneck(cost, balance_min_max(cost, 1)), 22.0);
  EXPECT_DOUBLE_EQ(bottleneck(cost, balance_min_max(cost, 10)), 9.0);
  // ALGORITHMS.md §3.1's example: [5,1,...,9] in 3 parts has bottleneck 9 (e.g. 7 | 6 | 9).
  EXPECT_DOUBLE_EQ(bottleneck(cost, balance_min_max(cost, 3)), 9.0);
}
