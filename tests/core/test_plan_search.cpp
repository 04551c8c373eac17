// The plan search and the plan file (plan/search.h): the chosen straight pipeline is the best of every
// candidate by the documented order, each candidate is what simulate_candidate gives for it, data
// parallelism's time is its formula, a memory limit excludes what does not fit, a skewed profile gets a
// skewed balance that beats uniform; plan files round-trip, read the files older versions wrote, and
// refuse bad fields by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "pipetrain/core/error.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/search.h"

using namespace pipetrain;

namespace {

// Eight layers, the last three four times as slow: a uniform balance leaves the last stage the bottleneck.
Profile skewed_profile() {
  Profile p;
  p.model = "skewed";
  p.micro_batch_size = 4;
  for (int i = 0; i < 8; ++i) {
    LayerProfile l;
    l.name = "layer" + std::to_string(i);
    l.type = "Linear";
    l.forward_ms = i >= 5 ? 4.0 : 1.0;
    l.backward_ms = 2 * l.forward_ms;
    l.activation_bytes = 1 << 16;
    l.parameter_bytes = 1 << 20;
    l.optimizer_bytes = 2 << 20;
    p.layers.push_back(l);
  }
  return p;
}

PlanSearchOptions options() {
  PlanSearchOptions o;
  o.ranks = 2;
  o.batch_size = 32;
  o.schedules = {"gpipe", "1f1b"};
  o.microbatch_counts = {1, 2, 4, 8};
  o.balance_kinds = {"uniform", "time"};
  return o;
}

}  // namespace

TEST(PlanSearch, ChoosesTheBestCandidateAndEachIsItsSimulation) {
  const Profile prof = skewed_profile();
  PlanSearchOptions o = options();
  o.exhaustive = true;
  const PlanSearchResult r = search_plans(prof, o);
  EXPECT_EQ(r.batch_size, 32);
  // Two stages: the distinct balances of uniform (min-max) and time (min-max, block-partition) x 2
  // schedules x 4 counts; one stage (one schedule: they are all the same on one stage) on 1 and 2
  // replicas x 4 counts.
  std::vector<std::vector<int>> balances{plan_balance(prof, 2, "uniform")};
  for (BalanceSolver solver : {BalanceSolver::min_max, BalanceSolver::block_partition}) {
    const std::vector<int> b = plan_balance(prof, 2, "time", solver);
    if (std::find(balances.begin(), balances.end(), b) == balances.end()) balances.push_back(b);
  }
  const int distinct = static_cast<int>(balances.size());
  EXPECT_EQ(r.considered, distinct * 2 * 4 + 2 * 4);
  ASSERT_EQ(r.candidates.size(), static_cast<std::size_t>(r.considered));
  int two_stage = 0;
  for (const PlanCandidate& c : r.candidates) {
    EXPECT_FALSE(better_candidate(c, r.chosen())) << c.kind << " " << c.schedule << " m=" << c.m;
    if (c.replicas != 1) continue;
    EXPECT_FALSE(better_candidate(c, r.best_straight)) << c.kind << " " << c.schedule << " m=" << c.m;
    const PlanCandidate again = simulate_candidate(prof, c.balance, c.schedule, c.m, 32.0 / c.m,
                                                   o.bandwidth_bytes_per_ms, o.latency_ms, 0);
    EXPECT_DOUBLE_EQ(again.makespan, c.makespan);
    two_stage += c.stages == 2;
  }
  EXPECT_EQ(two_stage, distinct * 2 * 4);
  ASSERT_TRUE(r.uniform_1f1b.has_value());
  EXPECT_EQ(r.uniform_1f1b->balance, (std::vector<int>{4, 4}));
  EXPECT_NE(r.best_straight.balance, (std::vector<int>{4, 4}));  // time balance moves layers off the slow end
  EXPECT_LT(r.best_straight.makespan, r.uniform_1f1b->makespan);
  EXPECT_EQ(r.best_straight.m, 8);  // more micro-batches, smaller bubble
  // Data parallelism: the whole model on 16 samples per rank (4x the profiled size), then the runtime's
  // group all-reduce of 8 MiB of gradients (with its messages' latency) and the one of the step's loss
  // and token count.
  double compute = 0;
  for (const LayerProfile& l : prof.layers) compute += 4 * (l.forward_ms + l.backward_ms);
  EXPECT_NEAR(r.data_parallel_ms,
              compute + group_allreduce_ms(8.0 * (1 << 20), 2, o.bandwidth_bytes_per_ms, o.latency_ms) +
                  group_allreduce_ms(kReplicaLossBytes, 2, o.bandwidth_bytes_per_ms, o.latency_ms),
              1e-9);
  // No bubble and a cheap all-reduce: data parallelism beats the two-stage pipeline here, and is chosen.
  EXPECT_FALSE(r.chose_replicated);
  EXPECT_EQ(r.chosen().replicas, 2);
  EXPECT_EQ(r.chosen().stages, 1);
  EXPECT_DOUBLE_EQ(r.chosen().makespan, r.data_parallel_ms);
}

TEST(PlanSearch, AMemoryLimitRulesOutWhatDoesNotFit) {
  const Profile prof = skewed_profile();
  PlanSearchOptions o = options();
  o.exhaustive = true;
  const PlanSearchResult free = search_plans(prof, o);
  double least = 1e300;
  for (const PlanCandidate& c : free.candidates) least = std::min(least, c.peak_bytes);
  o.memory_limit_bytes = least;  // only the leanest candidates fit
  const PlanSearchResult tight = search_plans(prof, o);
  EXPECT_TRUE(tight.best_straight.fits);
  EXPECT_LE(tight.best_straight.peak_bytes, least);
  int fitting = 0;
  for (const PlanCandidate& c : tight.candidates) fitting += c.fits;
  EXPECT_LT(fitting, static_cast<int>(tight.candidates.size()));
}

TEST(PlanSearch, RefusesImpossibleOptionsByName) {
  const Profile prof = skewed_profile();
  PlanSearchOptions o = options();
  o.ranks = 9;
  o.hybrid = false;  // a straight pipeline of 9 stages over 8 layers (hybrid plans use 8 of the 9 ranks)
  EXPECT_THROW(search_plans(prof, o), UsageError);
  o = options();
  o.microbatch_counts = {64};  // more micro-batches than samples: no candidate
  try {
    search_plans(prof, o);
    FAIL() << "no candidate was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--microbatch-counts"), std::string::npos) << e.what();
  }
  // Only asynchronous schedules: the refusal says they are not searched, and what is.
  o = options();
  o.schedules = {"pipedream", "2bw"};
  try {
    search_plans(prof, o);
    FAIL() << "only asynchronous schedules were accepted";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--schedules pipedream 2bw names only asynchronous schedules"), std::string::npos) << what;
    EXPECT_NE(what.find("(pipedream, 2bw, spectrain) are not searched"), std::string::npos) << what;
    EXPECT_NE(what.find("PipeDream's own planner"), std::string::npos) << what;
  }
  o = options();
  o.pipedream.levels = {NetworkLevel{3, 1e10}};
  try {
    search_plans(prof, o);
    FAIL() << "levels for 3 devices were accepted for 2 ranks";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--ranks is 2"), std::string::npos) << e.what();
  }
}

TEST(PlanFile, RoundTripsAndReadsWhatOlderVersionsWrote) {
  const Profile prof = skewed_profile();
  PlanSearchOptions o = options();
  o.replicated_may_win = false;  // one pipeline over both ranks
  const PlanSearchResult r = search_plans(prof, o);
  PlanFile f = plan_file_for(prof, r);
  f.umpipe = nlohmann::json{{"planner", "dgap"}};
  EXPECT_EQ(f.schedule, r.best_straight.schedule);
  EXPECT_EQ(f.microbatches, r.best_straight.m);
  EXPECT_EQ(f.plan.balance, r.best_straight.balance);
  EXPECT_EQ(f.plan.replication, (std::vector<int>{1, 1}));
  const PlanFile back = plan_file_from_json(plan_file_to_json(f), "test");
  EXPECT_EQ(back.plan.balance, f.plan.balance);
  EXPECT_EQ(back.schedule, f.schedule);
  EXPECT_EQ(back.microbatches, f.microbatches);
  EXPECT_EQ(back.batch_size, 32);
  EXPECT_EQ(back.balance_kind, f.balance_kind);
  EXPECT_EQ(back.umpipe, f.umpipe);
  EXPECT_EQ(back.pipedream.has_value(), f.pipedream.has_value());
  EXPECT_DOUBLE_EQ(back.predicted_bubble_fraction, f.predicted_bubble_fraction);
  // A bare plan (plan_to_json alone, as PipeDream-only files are) reads with nothing to run recorded.
  const PlanFile bare = plan_file_from_json(plan_to_json(f.plan), "bare");
  EXPECT_TRUE(bare.schedule.empty());
  EXPECT_EQ(bare.microbatches, 0);
  EXPECT_TRUE(bare.umpipe.is_null());
  // Through a file.
  const std::string path = (std::filesystem::temp_directory_path() / "pipetrain-plan-file-test.json").string();
  write_plan_file(path, f);
  EXPECT_EQ(read_plan_file(path).plan.balance, f.plan.balance);
  std::filesystem::remove(path);
}

TEST(PlanFile, RefusesBadFieldsByName) {
  const Profile prof = skewed_profile();
  const nlohmann::json good = plan_file_to_json(plan_file_for(prof, search_plans(prof, options())));
  auto refused = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[key] = value;
    try {
      plan_file_from_json(j, "bad.json");
    } catch (const UsageError& e) {
      return std::string(e.what()).find(std::string("\"") + key + "\"") != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(refused("microbatches", 0));
  EXPECT_TRUE(refused("microbatches", "four"));
  EXPECT_TRUE(refused("schedule", 3));
  EXPECT_TRUE(refused("batch_size", -8));
  EXPECT_TRUE(refused("umpipe", "dgap"));
  nlohmann::json j = good;
  j["pipedream"] = nlohmann::json{{"format", "nonsense"}};
  EXPECT_THROW(plan_file_from_json(j, "bad.json"), UsageError);
}
