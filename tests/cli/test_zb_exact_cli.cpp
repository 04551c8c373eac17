// `--exact` on `pipetrain schedule` and `simulate` (issue 14): zb-auto's exact search from the command line,
// its report of the greedy's gap, its JSON, and its errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using Result = pipetrain::testing::CommandResult;

const std::string bin = PIPETRAIN_BIN;

}  // namespace

// p=4, m=6, room for 3 micro-batches, F = B = W: the greedy takes 25, the optimum 24 (4.17% shorter).
TEST(ZbExactCli, SimulateReportsTheGapAndTheOptimalTimeline) {
  const Result r = pipetrain::testing::run_command(bin + " simulate -s zb-auto -p 4 -m 6 --memory-limit 3 --exact");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("zb-auto greedy 25.000, exact 24.000 (optimal")) << r.out;
  EXPECT_TRUE(r.has("the greedy is 4.17% longer")) << r.out;
  EXPECT_TRUE(r.has("makespan 24.000")) << r.out;
  const Result greedy = pipetrain::testing::run_command(bin + " simulate -s zb-auto -p 4 -m 6 --memory-limit 3");
  EXPECT_TRUE(greedy.has("makespan 25.000")) << greedy.out;

  const Result j = pipetrain::testing::run_command(
      bin + " simulate -s zb-auto -p 4 -m 6 --memory-limit 3 --exact --exact-nodes 100 --json", false);
  ASSERT_EQ(j.code, 0) << j.out;
  const nlohmann::json doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["exact"]["proven"], false);
  EXPECT_LE(doc["exact"]["nodes"].get<long long>(), 100);
  EXPECT_LE(doc["exact"]["lower_bound"].get<double>(), 24.0);
  EXPECT_LE(doc["exact"]["makespan"].get<double>(), 25.0);
  EXPECT_DOUBLE_EQ(doc["exact"]["greedy_makespan"].get<double>(), 25.0);
}

// `schedule --exact` keeps stdout the schedule (loadable CSV) and puts the report on stderr.
TEST(ZbExactCli, ScheduleKeepsStdoutTheSchedule) {
  const Result csv = pipetrain::testing::run_command(
      bin + " schedule -s zb-auto -p 2 -m 3 --cost 2:2:1 --comm 0.25 --memory-limit 2.5 --exact --format csv", false);
  ASSERT_EQ(csv.code, 0) << csv.out;
  EXPECT_EQ(csv.out.find("greedy"), std::string::npos) << csv.out;
  const Result both =
      pipetrain::testing::run_command(bin + " schedule -s zb-auto -p 2 -m 3 --cost 2:2:1 --comm 0.25 --memory-limit 2.5 --exact");
  // (zb-auto weighs ZB-H1's order too: at unit costs and limit 2 it is optimal now, 10 against 10.)
  EXPECT_TRUE(both.has("zb-auto greedy 18.500, exact 18.000 (optimal")) << both.out;
  EXPECT_TRUE(both.has("rank 1: ")) << both.out;
}

TEST(ZbExactCli, MisuseIsAUsageError) {
  const Result other = pipetrain::testing::run_command(bin + " simulate -s zb-h1 -p 2 -m 3 --exact");
  EXPECT_EQ(other.code, 2) << other.out;
  EXPECT_TRUE(other.has("use --schedule zb-auto")) << other.out;
  const Result nodes = pipetrain::testing::run_command(bin + " schedule -s zb-auto -p 2 -m 3 --exact-nodes 9");
  EXPECT_EQ(nodes.code, 2) << nodes.out;
  EXPECT_TRUE(nodes.has("add --exact")) << nodes.out;
  const Result big = pipetrain::testing::run_command(bin + " simulate -s zb-auto -p 8 -m 16 --exact");
  EXPECT_EQ(big.code, 2) << big.out;
  EXPECT_TRUE(big.has("small cases only")) << big.out;
  const Result zero = pipetrain::testing::run_command(bin + " simulate -s zb-auto -p 2 -m 3 --exact --exact-nodes 0");
  EXPECT_EQ(zero.code, 2) << zero.out;
  EXPECT_TRUE(zero.has("node budget must be >= 1, got 0")) << zero.out;
}
