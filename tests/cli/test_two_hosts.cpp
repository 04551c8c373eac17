// Two hosts with faults: tests/cli/two_hosts.sh builds two network namespaces joined by a veth pair and
// trains 2 stages across them over gloo (see the script's header). Each test runs one of its modes; the
// script exits 77 with the reason when it cannot run here (not root, no namespaces, no tc netem), which
// is a skip, not a pass.
#include <gtest/gtest.h>

#include <string>

#include "run_command.h"

namespace {

void run_mode(const std::string& mode) {
  const auto r = pipetrain::testing::run_command("timeout 100 bash " PIPETRAIN_SOURCE_DIR "/tests/cli/two_hosts.sh " +
                                                 std::string(PIPETRAIN_BIN) + " " + mode);
  if (r.code == 77) GTEST_SKIP() << r.out;
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("PASS (" + mode + ")")) << r.out;
  EXPECT_LT(r.seconds, 60) << r.out;
}

TEST(TwoHosts, LossesEqualASingleHostRunAndTheStoreListensOnMasterAddrOnly) { SKIP_WITHOUT_GLOO(); run_mode("same"); }

TEST(TwoHosts, TrainsCorrectlyWith10msDelayAnd1PercentLoss) { SKIP_WITHOUT_GLOO(); run_mode("netem"); }

TEST(TwoHosts, ACutLinkStopsBothRanksNamingTheLostPeer) { SKIP_WITHOUT_GLOO(); run_mode("cut"); }

}  // namespace
