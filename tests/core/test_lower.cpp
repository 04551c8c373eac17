// Checks the communication-lowering pass: for every generator and a range of sizes and cost models,
// the lowered schedule passes validation under blocking (rendezvous) send/receive semantics, holds
// exactly one send and one receive per transfer between ranks, keeps each rank's compute order, and
// strips back to the original.
#include <gtest/gtest.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/validate.h"

using namespace pipetrain;

TEST(Lower, EveryGeneratorLowersWithoutDeadlock) {
  for (const std::string& name : schedule_names())
    for (int p : {1, 2, 3, 4, 8})
      for (int m : {1, 2, 4, 8, 12})
        for (int v : {1, 2}) {
          if ((v > 1) != schedule_traits(name).virtual_stages) continue;
          if ((name == "interleaved" || name == "interleaved-zb") && m % p != 0) continue;
          if (name == "2bw" && m < p) continue;
          if (name == "dualpipev" && m < 2 * p) continue;  // rejected by design
          GeneratorOptions o;
          o.ranks = p;
          o.microbatches = m;
          o.virtual_stages = v;
          o.steps = 2;
          const Schedule s = generate(name, o);
          for (const CostModel& costs :
               {CostModel{}, CostModel::uniform(s.stages, StageCost{1, 3, 0.5, 1}, s.virtual_stages_per_rank(), 0.7),
                CostModel::uniform(s.stages, StageCost{2, 1, 0, 1}, s.virtual_stages_per_rank(), 0.0)}) {
            const Schedule lowered = insert_communication(s, costs);
            ASSERT_NO_THROW(validate(lowered)) << name << " p=" << p << " m=" << m;
            EXPECT_EQ(strip_communication(lowered), s);
            // One send and one receive per micro-batch, direction and boundary between different ranks.
            int boundaries = 0;
            for (int st = 0; st + 1 < s.stages; ++st) boundaries += s.rank_of(st) != s.rank_of(st + 1);
            int comm = 0;
            for (const auto& row : lowered.actions)
              for (const Action& a : row) comm += is_comm(a.kind);
            EXPECT_EQ(comm, 4 * boundaries * s.microbatches) << name;
            // The simulated timeline does not change: transfers are latency on the edges.
            EXPECT_NEAR(simulate(lowered, costs.stage.empty() ? CostModel::uniform(s.stages, {}, v) : costs)
                            .metrics.makespan,
                        simulate(s, costs.stage.empty() ? CostModel::uniform(s.stages, {}, v) : costs).metrics.makespan,
                        1e-9);
          }
        }
}

TEST(Lower, OrderOfTheTwoRankExample) {
  const Schedule lowered = insert_communication(one_f_one_b(2, 2));
  EXPECT_EQ(rank_line(lowered, 0), "0F0 0SF0 0F1 0SF1 0RB0 0BW0 0RB1 0BW1 0S0");
  EXPECT_EQ(rank_line(lowered, 1), "1RF0 1F0 1RF1 1BW0 1SB0 1F1 1BW1 1SB1 1S0");
}

TEST(Lower, RejectsAlreadyLoweredInput) {
  const Schedule lowered = insert_communication(one_f_one_b(2, 2));
  EXPECT_THROW(insert_communication(lowered), UsageError);
}
