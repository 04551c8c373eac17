// Checks stage replication from the command line (issue 6, PipeDream's 1F1B-RR): `train --replication`
// runs a stage on several ranks, micro-batches round robin, over gloo processes, with the per-step losses
// of the unreplicated pipeline; `train --plan FILE --plan-use pipedream` runs the PipeDream planner's
// plan with its unequal replication; bad counts and combinations exit 2 naming the fix.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::log_losses;
using pipetrain::testing::run_pipetrain;

static fs::path temp_dir(const std::string& name) { return pipetrain::testing::fresh_temp_dir("rr", name); }

namespace {

const std::string kModel = " --data synthetic --d-model 32 --heads 2 --seq-len 16 --vocab 32 --layers 4";
const std::string kRun = kModel + " --batch-size 12 --steps 4 --lr-schedule constant --progress quiet --log ";

void expect_same_losses(const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (std::size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k], b[k], 1e-5 * std::abs(b[k])) << "step " << k + 1;
}

}  // namespace

TEST(ReplicationCli, RoundRobinRunsWithTheUnreplicatedLosses) {
  SKIP_WITHOUT_GLOO();
  const fs::path dir = temp_dir("losses");
  CommandResult r = run_pipetrain("train --transport gloo --stages 2 --balance 3,3 -m 6" + kRun + (dir / "one.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain("train --transport gloo --replication 1,2 --balance 3,3 -m 6 --save " + (dir / "ck").string() + kRun +
                    (dir / "rr.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("checkpoint written to")) << r.out;
  EXPECT_TRUE(r.has("2 stages replicated 1,2 (1F1B-RR, 3 ranks) over gloo")) << r.out;
  EXPECT_TRUE(r.has("rank 2 (stage 1 replica 1)")) << r.out;
  // Every rank joined the checkpoint; an unreplicated pipeline resumes from it.
  r = run_pipetrain("train --transport gloo --stages 2 --balance 3,3 -m 6 --resume " + (dir / "ck").string() + kModel +
                    " --batch-size 12 --steps 5 --lr-schedule constant --progress quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("resuming at step 4")) << r.out;
  expect_same_losses(log_losses(dir / "rr.jsonl"), log_losses(dir / "one.jsonl"));
  fs::remove_all(dir);
}

TEST(ReplicationCli, RunsThePipeDreamPlansReplication) {
  SKIP_WITHOUT_GLOO();
  const fs::path dir = temp_dir("plan");
  CommandResult r = run_pipetrain("profile" + kModel + " --microbatch-size 4 --repeats 2 --out " +
                                  (dir / "profile.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_pipetrain("plan --profile " + (dir / "profile.json").string() + " --ranks 3 --batch-size 12 --out " +
                    (dir / "plan.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  // What the PipeDream planner chooses depends on the measured profile; pin an unequal plan in the file's
  // PipeDream section (its fields as the planner wrote them) so the run is known.
  nlohmann::json plan;
  {
    std::ifstream in(dir / "plan.json");
    plan = nlohmann::json::parse(in);
  }
  ASSERT_TRUE(plan.contains("pipedream")) << plan.dump(2);
  plan["pipedream"]["balance"] = {4, 2};
  plan["pipedream"]["replication"] = {2, 1};
  plan["pipedream"]["stage_time_ms"] = {1.0, 1.0};
  plan["pipedream"]["stage_memory_bytes"] = {1.0, 1.0};
  plan["pipedream"]["stage_in_flight"] = {1, 1};
  plan["pipedream"].erase("microbatches");  // what plan chose for its own replication; the default is tested here
  plan["pipedream"].erase("schedule");
  std::ofstream(dir / "rr-plan.json") << plan.dump(2);

  r = run_pipetrain("train --transport gloo --plan " + (dir / "rr-plan.json").string() + " --plan-use pipedream" + kRun +
                    (dir / "rr.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("2 stages replicated 2,1 (1F1B-RR, 3 ranks)")) << r.out;
  EXPECT_TRUE(r.has("schedule 1f1b, m=6")) << r.out;  // a multiple of 2 and at least twice the 3 workers
  EXPECT_TRUE(r.has("balance 4,2")) << r.out;
  r = run_pipetrain("train --transport gloo --stages 2 --balance 4,2 -m 6" + kRun + (dir / "one.jsonl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_losses(log_losses(dir / "rr.jsonl"), log_losses(dir / "one.jsonl"));
  fs::remove_all(dir);
}

TEST(ReplicationCli, BadCountsAndCombinationsAreRefused) {
  CommandResult r = run_pipetrain("train --replication 2,x" + kModel + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("'x' is not a replica count >= 1")) << r.out;
  r = run_pipetrain("train --stages 3 --replication 2,1" + kModel + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("names 2 stages but --stages is 3")) << r.out;
  r = run_pipetrain("train --transport local --replication 2,1 --schedule zb-h1" + kModel + " --steps 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("run with --schedule 1f1b or gpipe")) << r.out;
  r = run_pipetrain("train --transport local --replication 2,1 --replicas 2" + kModel + " --steps 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("do not combine")) << r.out;
}

// `simulate --replication` lays out 1F1B-RR: a 3x slower stage 0 with three replicas keeps pace with
// stage 1 (busy 3 per micro-batch), so 12 micro-batches take about 12 x 3 plus fill and drain, well
// under the unreplicated pipeline's 12 x 9.
TEST(ReplicationCli, SimulateLaysOutRoundRobin) {
  CommandResult r = run_pipetrain("simulate --schedule 1f1b --replication 3,1 -m 12 --cost 3:3:3,1:1:1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("schedule 1f1b-rr  p=4  m=12")) << r.out;
  const auto at = r.out.find("makespan ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const double makespan = std::stod(r.out.substr(at + 9));
  EXPECT_LE(makespan, 12 * 3 + 2 * (9 + 3)) << r.out;
  r = run_pipetrain("simulate --schedule 1f1b --stages 2 -m 12 --cost 3:3:3,1:1:1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_GE(std::stod(r.out.substr(r.out.find("makespan ") + 9)), 12 * 9) << r.out;
  r = run_pipetrain("simulate --schedule 1f1b --replication 3,1 --stages 3 -m 12");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("--replication lists 2 stages but --stages is 3")) << r.out;
  r = run_pipetrain("simulate --schedule zb-h1 --replication 3,1 -m 12");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("runs with --schedule gpipe or 1f1b")) << r.out;
}

// On PipeDream's VGG-16 profile at 1 GB/s, PipeDream's planner replicates the first stage (17,22 x 3,1);
// run synchronously as 1F1B-RR and simulated like the straight pipelines, it beats the best straight
// pipeline, so plan chooses it and writes the replication into the plan.
TEST(ReplicationCli, PlanChoosesTheReplicatedPlanWhenItIsFaster) {
  const fs::path dir = temp_dir("vgg");
  const std::string profile = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  ASSERT_TRUE(fs::exists(profile)) << profile << " is missing; it is part of the repository";
  CommandResult r = run_pipetrain("plan --profile " + profile + " --pipedream-batch 128 --ranks 4 --batch-size 512 "
                                  "--bandwidth 1 --out " + (dir / "plan.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("best straight:")) << r.out;
  EXPECT_TRUE(r.has("chosen: 2 stages replicated 3,1 (1F1B-RR), m=")) << r.out;
  nlohmann::json plan;
  {
    std::ifstream in(dir / "plan.json");
    plan = nlohmann::json::parse(in);
  }
  EXPECT_EQ(plan.at("replication"), nlohmann::json({3, 1}));
  EXPECT_EQ(plan.at("balance"), nlohmann::json({17, 22}));
  EXPECT_EQ(plan.at("schedule"), "1f1b");
  EXPECT_EQ(plan.at("microbatches").get<int>() % 3, 0);
  EXPECT_EQ(plan.at("pipedream").at("microbatches"), plan.at("microbatches"));
  // simulate reads the graph at its profiled batch too, and lays the plan out as 1F1B-RR.
  r = run_pipetrain("simulate --profile " + profile + " --pipedream-batch 128 --balance 17,22 --replication 3,1 "
                    "--schedule 1f1b -m 32 --microbatch-size 16 --bandwidth 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("schedule 1f1b-rr  p=4  m=32")) << r.out;
  fs::remove_all(dir);
}
