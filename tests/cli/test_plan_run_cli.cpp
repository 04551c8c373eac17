// Plans that run (issue 28, item 4): every kind of plan `pipetrain plan` chooses, written with --out and
// run with `pipetrain train --plan FILE` and no other pipeline flag: data-parallel copies, straight
// pipelines, stages x replicas, interleaved and zb-v virtual stages, PipeDream's replication, and a
// plan's placement across --levels. The run must be the plan's: its stages, replicas, schedule,
// micro-batches, balance, mini-batch and threads (what the prediction assumed). The profile is written
// here with fixed times, so the plans chosen do not depend on this machine's load.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::read_json_file;
using pipetrain::testing::run_pipetrain;

namespace {

// 6 pipeline layers: embedding, 4 blocks, head.
const std::string kModel = " --data synthetic --d-model 32 --heads 2 --seq-len 16 --vocab 32 --layers 4";
const std::string kRun = " --transport local --steps 2 --progress quiet --eval-every 0 --sample 0 --lr-schedule constant";

fs::path temp_dir(const std::string& name) { return pipetrain::testing::fresh_temp_dir("planrun", name); }

// A profile of kModel's 6 layers at micro-batch 2 with fixed times (ms) and sizes (bytes), measured with
// `threads` intra-op threads. `forward`: each layer's forward time (the backward takes twice as long);
// default 1 ms for the blocks, 0.05 ms for the embedding and the head. `embedding_params`: the
// embedding's parameter bytes (default: as the head's, 4096).
fs::path write_profile(const fs::path& dir, int threads = 1, double param_bytes = 50816,
                       const std::vector<double>& forward = {}, double embedding_params = 4096) {
  nlohmann::json layers = nlohmann::json::array();
  const char* types[] = {"Embedding", "Block", "Block", "Block", "Block", "Head"};
  for (int i = 0; i < 6; ++i) {
    const bool block = i >= 1 && i <= 4;
    const double f = forward.empty() ? (block ? 1.0 : 0.05) : forward[static_cast<std::size_t>(i)], b = 2 * f;
    const double params = block ? param_bytes : i == 0 ? embedding_params : 4096.0;
    layers.push_back({{"name", std::to_string(i) + ":" + types[i]},
                      {"type", types[i]},
                      {"forward_ms", f},
                      {"backward_ms", b},
                      {"bw_split", true},
                      {"input_grad_ms", b * 0.6},
                      {"weight_grad_ms", b * 0.4},
                      {"activation_bytes", 4096},
                      {"saved_bytes", 94912},
                      {"w_held_bytes", 83488},
                      {"parameter_bytes", params},
                      {"optimizer_bytes", 2 * params}});
  }
  const nlohmann::json prof = {{"format", "pipetrain-profile"}, {"version", 1},
                               {"model", "gpt (test)"},         {"source", "test_plan_run_cli"},
                               {"micro_batch_size", 2},         {"threads", threads},
                               {"layers", layers}};
  const fs::path path = dir / "profile.json";
  std::ofstream(path) << prof.dump(2);
  return path;
}

std::string join(const nlohmann::json& a) {
  std::string s;
  for (const auto& x : a) s += (s.empty() ? "" : ",") + std::to_string(x.get<int>());
  return s;
}

// Plans with `plan_args`, then trains the plan with no pipeline flags (only kModel, kRun and `train_args`)
// and checks the run is the plan's. Returns the plan file's JSON and the training output.
std::pair<nlohmann::json, CommandResult> round_trip(const fs::path& dir, const fs::path& profile,
                                                    const std::string& plan_args, const std::string& train_args = "") {
  const fs::path plan = dir / "plan.json";
  CommandResult r = run_pipetrain("plan --profile " + profile.string() + " " + plan_args + " --out " + plan.string());
  EXPECT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = read_json_file(plan);
  CommandResult t = run_pipetrain("train --plan " + plan.string() + kModel + kRun + train_args);
  EXPECT_EQ(t.code, 0) << "plan " << plan_args << ":\n" << j.dump(1) << "\n" << t.out;
  // The plan's shape, schedule, micro-batches, balance and mini-batch.
  const std::vector<int> rep = j.at("replication").get<std::vector<int>>();
  const bool unequal = std::any_of(rep.begin(), rep.end(), [&](int x) { return x != rep.front(); });
  const int v = j.value("virtual_stages", 1);
  const int p = static_cast<int>(j.at("balance").size()) / v;
  const std::string shape = unequal                ? std::to_string(p) + " stages replicated " + join(j.at("replication"))
                            : rep.front() > 1      ? std::to_string(p) + " stages x " + std::to_string(rep.front()) +
                                                    " replicas"
                                                   : std::to_string(p) + " stages over";
  EXPECT_TRUE(t.has(shape)) << "expected '" << shape << "'\n" << t.out;
  EXPECT_TRUE(t.has("schedule " + j.at("schedule").get<std::string>() + ", m=" +
                    std::to_string(j.at("microbatches").get<int>()) + ", batch " +
                    std::to_string(j.at("batch_size").get<int64_t>()) + ", balance " + join(j.at("balance"))))
      << j.dump(1) << "\n" << t.out;
  EXPECT_TRUE(t.has("(" + std::to_string(j.value("threads", 0)) + " threads per rank)")) << t.out;
  return {j, t};
}

// The training loss line's last value ("training loss A -> B over steps").
std::string final_loss(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(R"(training loss [0-9.]+ -> ([0-9.]+) over)"))) return "?";
  return m[1];
}

}  // namespace

// The default search on 3 ranks: a mini-batch of 16 does not split over 3 copies, so the plan must not
// give 3 replicas unequal shares (train --replicas refuses them); and train runs the plan's mini-batch.
TEST(PlanRunCli, ThreeRanksRunsThePlansMiniBatchAndReplicas) {
  const fs::path dir = temp_dir("three");
  const fs::path prof = write_profile(dir, 1, 256);  // small parameters: copies are cheap
  auto [j, t] = round_trip(dir, prof, "--ranks 3 --batch-size 16");
  EXPECT_EQ(16 % j.at("replication")[0].get<int>(), 0) << j.dump(1);
  // Data parallelism alone: the most copies (<= 3) that split 16 samples evenly.
  std::tie(j, t) = round_trip(dir, prof, "--ranks 3 --batch-size 16 --schedules gpipe --microbatch-counts 1");
  EXPECT_EQ(j.at("balance").size(), 1u) << j.dump(1);
  EXPECT_EQ(j.at("replication")[0], 2) << j.dump(1);
  // A plan's replicas that the mini-batch given does not split: refused naming the plan and the fix.
  const CommandResult r = run_pipetrain("train --plan " + (dir / "plan.json").string() + kModel + kRun +
                                        " --batch-size 15");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("--batch-size 15 does not split evenly over the 2 replicas of --plan")) << r.out;
  EXPECT_TRUE(r.has("drop --batch-size")) << r.out;
}

TEST(PlanRunCli, StraightInterleavedAndZbvPlansRun) {
  const fs::path dir = temp_dir("virtual");
  const fs::path prof = write_profile(dir);
  for (const char* s : {"1f1b", "zb-h1", "gpipe"}) {
    auto [j, t] = round_trip(dir, prof, std::string("--ranks 2 --no-hybrid --batch-size 8 --schedules ") + s);
    EXPECT_EQ(j.at("schedule"), s);
  }
  for (const char* s : {"interleaved", "zb-v"}) {
    auto [j, t] = round_trip(dir, prof, std::string("--ranks 2 --no-hybrid --batch-size 8 --schedules ") + s);
    EXPECT_EQ(j.at("schedule"), s);
    EXPECT_EQ(j.at("balance").size(), 4u) << j.dump(1);  // 2 ranks x 2 stages each
    EXPECT_EQ(j.at("virtual_stages"), 2) << j.dump(1);
  }
}

// The plan's threads (its profile's) are the run's: the times it predicts were measured with them.
TEST(PlanRunCli, ThePlansThreadsAreTheRuns) {
  const fs::path dir = temp_dir("threads");
  auto [j, t] = round_trip(dir, write_profile(dir, 2), "--ranks 2 --no-hybrid --batch-size 8 --schedules 1f1b");
  EXPECT_EQ(j.at("threads"), 2);
  EXPECT_TRUE(t.has("(2 threads per rank)")) << t.out;
  EXPECT_TRUE(t.has(", 2 intra-op thread(s),")) << t.out;  // the banner's LibTorch line: the ranks', not the default
  // --threads on the command line wins.
  const CommandResult r = run_pipetrain("train --plan " + (dir / "plan.json").string() + kModel + kRun + " --threads 1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("(1 threads per rank)")) << r.out;
}

// Stages x replicas across two levels: a slow outer link makes the plan keep each stage's copies on the
// fast inner level (replicas-inner). The run follows the placement, and it only renumbers the ranks: the
// losses equal those of the same run placed pipeline-inner.
TEST(PlanRunCli, StagesTimesReplicasWithThePlansPlacement) {
  const fs::path dir = temp_dir("placement");
  const fs::path prof = write_profile(dir, 1, 4e6);  // large parameters: the all-reduce must stay inside a level
  auto [j, t] = round_trip(dir, prof,
                           "--ranks 4 --batch-size 16 --level 2:100 --level 2:0.05 --schedules 1f1b "
                           "--microbatch-counts 2 4 --balances uniform");
  ASSERT_EQ(j.at("balance").size(), 2u) << j.dump(1);
  ASSERT_EQ(j.at("replication"), nlohmann::json::array({2, 2})) << j.dump(1);
  EXPECT_EQ(j.at("placement"), "replicas-inner") << j.dump(1);
  EXPECT_TRUE(t.has("2 stages x 2 replicas (replicas-inner")) << t.out;
  const CommandResult other = run_pipetrain("train --plan " + (dir / "plan.json").string() + kModel + kRun +
                                            " --placement pipeline-inner");
  ASSERT_EQ(other.code, 0) << other.out;
  EXPECT_FALSE(other.has("replicas-inner")) << other.out;
  EXPECT_EQ(final_loss(t.out), final_loss(other.out)) << t.out << "\n" << other.out;
  EXPECT_NE(final_loss(t.out), "?") << t.out;
}

// PipeDream's plan (stage replication as 1F1B-RR) as the chosen plan: a slow embedding with few
// parameters is worth two ranks, the blocks' large parameters over a slow link are not worth copying.
// And the same file's "pipedream" section with --plan-use pipedream.
TEST(PlanRunCli, PipeDreamsReplicatedPlanRuns) {
  const fs::path dir = temp_dir("pipedream");
  const fs::path prof = write_profile(dir, 1, 4e6, {6, 1, 1, 1, 1, 1}, 256);
  auto [j, t] = round_trip(dir, prof, "--ranks 3 --batch-size 12 --bandwidth 0.1");
  ASSERT_EQ(j.at("replication"), nlohmann::json::array({2, 1})) << j.dump(1);
  EXPECT_TRUE(t.has("2 stages replicated 2,1 (1F1B-RR, 3 ranks)")) << t.out;
  ASSERT_TRUE(j.contains("pipedream")) << j.dump(1);
  const CommandResult r = run_pipetrain("train --plan " + (dir / "plan.json").string() + " --plan-use pipedream" +
                                        kModel + kRun);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("2 stages replicated 2,1")) << r.out;
  EXPECT_TRUE(r.has("batch 12")) << r.out;
}

// PipeDream's plan for 3 ranks x 2 data-parallel copies as the chosen plan (its replication 2,1 times 2):
// one 1F1B-RR schedule over 6 ranks, as the file says. And replicated equally (three straight stages x 2
// copies, chosen when only interleaved pipelines compete), the file's 2,2,2 runs as 2 copies of the
// pipeline with m / 2 micro-batches each, the same schedule.
TEST(PlanRunCli, PipeDreamsPlanTimesCopiesRuns) {
  const fs::path dir = temp_dir("copies");
  auto [j, t] = round_trip(dir, write_profile(dir, 1, 4e6, {6, 1, 1, 1, 1, 1}, 256), "--ranks 6 --batch-size 16 --bandwidth 1");
  EXPECT_TRUE(t.has("2 stages replicated 4,2 (1F1B-RR, 6 ranks)")) << t.out;
  ASSERT_EQ(j.at("replication"), nlohmann::json::array({4, 2})) << j.dump(1);
  EXPECT_EQ(j.at("microbatches").get<int>() % 4, 0) << j.dump(1);
  std::tie(j, t) = round_trip(dir, write_profile(dir, 1, 4e6, {0.05, 1, 1, 1, 1, 0.05}, 256),
                              "--ranks 6 --batch-size 16 --bandwidth 1 --schedules 1f1b --microbatch-counts 8");
  ASSERT_EQ(j.at("replication"), nlohmann::json::array({2, 2, 2})) << j.dump(1);
  EXPECT_EQ(j.at("schedule"), "1f1b") << j.dump(1);
  EXPECT_TRUE(t.has("3 stages x 2 replicas")) << t.out;
}

// A plan file's new fields are checked like the others.
TEST(PlanRunCli, BadPlacementOrThreadsInAPlanAreRefused) {
  const fs::path dir = temp_dir("bad");
  const fs::path plan = dir / "plan.json";
  ASSERT_EQ(run_pipetrain("plan --profile " + write_profile(dir).string() + " --ranks 2 --out " + plan.string()).code, 0);
  nlohmann::json j = read_json_file(plan);
  for (const auto& [key, value, says] :
       {std::tuple<const char*, nlohmann::json, const char*>{"placement", "sideways", "write pipeline-inner"},
        {"threads", 0, "intra-op threads per rank"}}) {
    nlohmann::json bad = j;
    bad[key] = value;
    std::ofstream(dir / "bad.json") << bad.dump();
    const CommandResult r = run_pipetrain("train --plan " + (dir / "bad.json").string() + kModel + kRun);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(r.has(std::string("\"") + key + "\"")) << r.out;
    EXPECT_TRUE(r.has(says)) << r.out;
  }
}

// profile --concurrent N: N processes measure the layers at once (as N ranks of a run compute at once);
// rank 0's profile is written, once, and plans like any other.
TEST(PlanRunCli, ProfileConcurrentWritesRankZerosProfile) {
  const fs::path dir = temp_dir("concurrent");
  const fs::path prof = dir / "profile.json";
  CommandResult r = run_pipetrain("profile" + kModel + " --microbatch-size 2 --repeats 2 --warmup 1 --threads 1 "
                                  "--concurrent 2 --out " + prof.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("[rank 0] profile written to")) << r.out;
  EXPECT_FALSE(r.has("[rank 1] profile written")) << r.out;
  EXPECT_EQ(read_json_file(prof).at("layers").size(), 6u);
  r = run_pipetrain("plan --profile " + prof.string() + " --ranks 2");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_pipetrain("profile" + kModel + " --concurrent 0");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("--concurrent")) << r.out;
}

// A plan file whose schedule was edited to a name that does not exist: train said nothing and aborted
// (exit 134, an uncaught UsageError from the schedule's traits). Now: exit 2 naming the file, the name
// and the nearest schedule.
TEST(PlanRunCli, AnEditedScheduleNameIsAUsageError) {
  const fs::path dir = temp_dir("edited");
  const fs::path prof = write_profile(dir);
  const fs::path plan = dir / "plan.json";
  ASSERT_EQ(run_pipetrain("plan --profile " + prof.string() + " --ranks 2 --no-hybrid --batch-size 8 --schedules zb-v "
                          "--out " + plan.string()).code, 0);
  nlohmann::json j = read_json_file(plan);
  ASSERT_EQ(j.at("schedule"), "zb-v");
  j["schedule"] = "zb-q";
  std::ofstream(plan) << j.dump(1);
  for (const char* extra : {"", " -s 1f1b"}) {
    const CommandResult r = run_pipetrain("train --plan " + plan.string() + kModel + kRun + extra);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(r.has("unknown schedule 'zb-q' (did you mean 'zb-v'?)")) << r.out;
    EXPECT_TRUE(r.has(plan.string())) << r.out;
  }
}

// A plan (or a --profile) whose profile measured another of the zoo's models runs (its balance may be
// reused on purpose), and rank 0 says once that its times are that model's; the same model's runs
// without a word.
TEST(PlanRunCli, APlanForAnotherModelRunsWithOneWarning) {
  const fs::path dir = temp_dir("othermodel");
  const fs::path profile = write_profile(dir);
  for (const auto& [measured, warned] : {std::pair<std::string, bool>{"gpt: 4 blocks, d_model 64, 2 heads, vocab 32, "
                                                                      "context 16 on synthetic data", true},
                                         {"gpt: 4 blocks, d_model 32, 2 heads, vocab 32, context 16 on synthetic data",
                                          false}}) {
    nlohmann::json j = read_json_file(profile);
    j["model"] = measured;
    std::ofstream(profile) << j.dump(2);
    const fs::path plan = dir / "plan.json";
    CommandResult r = run_pipetrain("plan --profile " + profile.string() + " --ranks 2 --out " + plan.string());
    ASSERT_EQ(r.code, 0) << r.out;
    // Two processes over shared memory: the warning comes from rank 0 only, not from each process.
    r = run_pipetrain("train --plan " + plan.string() + kModel +
                      " --transport shm --steps 1 --progress quiet --eval-every 0 --sample 0");
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string warning = "was made from a profile of another model (gpt: 4 blocks, d_model 64";
    EXPECT_EQ(r.has(warning), warned) << r.out;
    if (warned) {
      EXPECT_EQ(r.out.find(warning), r.out.rfind(warning)) << "printed more than once:\n" << r.out;
      EXPECT_TRUE(r.has("this run's (gpt: 4 blocks, d_model 32, 2 heads, vocab 32, context 16)")) << r.out;
    }
    // The profile itself, balancing by its times: the same warning, naming --profile.
    r = run_pipetrain("train --profile " + profile.string() + " --balance time --stages 2" + kModel + kRun);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.has("warning: --profile " + profile.string() + " " + warning.substr(0, 10)), warned) << r.out;
  }
  fs::remove_all(dir);
}

// A plan written although it fits no rank's --memory (for inspection) still runs when asked, and says
// that it was planned not to fit.
TEST(PlanRunCli, APlanThatDoesNotFitItsMemoryWarnsWhenRun) {
  const fs::path dir = temp_dir("nofit");
  const fs::path profile = write_profile(dir), plan = dir / "plan.json";
  CommandResult r = run_pipetrain("plan --profile " + profile.string() + " --ranks 2 --memory 0.000001 --out " +
                                  plan.string());
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_FALSE(read_json_file(plan).at("fits_memory_limit").get<bool>()) << r.out;
  r = run_pipetrain("train --plan " + plan.string() + kModel + kRun);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("warning: --plan " + plan.string() + " does not fit the memory per rank it was planned for"))
      << r.out;
  fs::remove_all(dir);
}
