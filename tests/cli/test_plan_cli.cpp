// Checks planning as a user runs it (issue 6): `pipetrain profile` writes a profile of the model it
// measures; `pipetrain plan` reads it (or PipeDream's VGG-16 graph) and writes a plan whose balance,
// schedule and micro-batches `pipetrain train --plan` runs; measured balance kinds (time, memory) and
// type:REGEX in train; usage errors exit 2 with the fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <vector>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::read_json_file;
using pipetrain::testing::run_pipetrain;

static fs::path temp_dir(const std::string& name) { return pipetrain::testing::fresh_temp_dir("plan", name); }

namespace {

const std::string kModel = " --data synthetic --d-model 32 --heads 2 --seq-len 16 --vocab 32 --layers 4";

// The ms/mini-batch column of a row of plan's table.
double row_time(const std::string& out, const std::string& row_start) {
  std::smatch m;
  const std::regex re(row_start + R"([^\n]*?\s([0-9]+\.[0-9]+)\s+[0-9.-]+\s+[0-9.]+\s)");
  if (!std::regex_search(out, m, re)) return -1;
  return std::stod(m[1]);
}

}  // namespace

TEST(PlanCli, ProfilePlanAndTrainFromThePlan) {
  const fs::path dir = temp_dir("flow");
  CommandResult r = run_pipetrain("profile" + kModel + " --microbatch-size 4 --repeats 2 --sizes 1 8 --out " +
                                  (dir / "profile.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json prof = read_json_file(dir / "profile.json");
  EXPECT_EQ(prof.at("format"), "pipetrain-profile");
  ASSERT_EQ(prof.at("layers").size(), 6u);  // embedding, 4 blocks, head
  EXPECT_EQ(prof.at("layers")[1].at("type"), "Block");
  EXPECT_EQ(prof.at("layers")[1].at("by_micro_batch").size(), 2u);

  r = run_pipetrain("plan --profile " + (dir / "profile.json").string() + " --ranks 3 --batch-size 16");
  ASSERT_EQ(r.code, 0) << r.out;
  const double chosen = row_time(r.out, "chosen:"), uniform = row_time(r.out, "uniform balance, 1f1b");
  ASSERT_GT(chosen, 0) << r.out;
  ASSERT_GT(uniform, 0) << r.out;
  EXPECT_LE(chosen, uniform) << "uniform 1f1b is among the candidates, so the choice cannot be slower\n" << r.out;
  EXPECT_TRUE(r.has("data parallelism")) << r.out;
  EXPECT_TRUE(r.has("PipeDream planner")) << r.out;
  // A straight pipeline over the 3 ranks (one stage per rank), for train --plan below.
  r = run_pipetrain("plan --profile " + (dir / "profile.json").string() + " --ranks 3 --batch-size 16 --no-hybrid "
                    "--schedules gpipe 1f1b zb-h1 --out " + (dir / "plan.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json plan = read_json_file(dir / "plan.json");
  ASSERT_EQ(plan.at("balance").size(), 3u);
  int layers = 0;
  std::string balance;
  for (const auto& n : plan.at("balance")) {
    layers += n.get<int>();
    balance += (balance.empty() ? "" : ",") + std::to_string(n.get<int>());
  }
  EXPECT_EQ(layers, 6);
  const std::string schedule = plan.at("schedule");
  const int m = plan.at("microbatches");

  r = run_pipetrain("train --transport local --plan " + (dir / "plan.json").string() + kModel +
                    " --batch-size 16 --steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("3 stages over local")) << r.out;
  EXPECT_TRUE(r.has("schedule " + schedule + ", m=" + std::to_string(m))) << r.out;
  EXPECT_TRUE(r.has("balance " + balance)) << r.out;
  // A flag on the command line beats the plan.
  r = run_pipetrain("train --transport local --plan " + (dir / "plan.json").string() + kModel +
                    " --batch-size 16 --steps 1 --schedule gpipe --microbatches 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("schedule gpipe, m=2")) << r.out;
  // Unequal replication runs as 1F1B-RR (tests/cli/test_replication_cli.cpp checks its losses), with
  // gpipe or 1f1b only.
  nlohmann::json replicated = plan;
  replicated["replication"] = {2, 1, 1};
  replicated["options"]["levels"][0]["machines"] = 4;
  replicated["schedule"] = "zb-h1";
  std::ofstream(dir / "replicated.json") << replicated.dump();
  r = run_pipetrain("train --transport local --plan " + (dir / "replicated.json").string() + kModel + " --steps 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("run with --schedule 1f1b or gpipe")) << r.out;
  r = run_pipetrain("train --transport local --plan " + (dir / "replicated.json").string() + kModel +
                    " --steps 1 --schedule 1f1b");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("3 stages replicated 2,1,1 (1F1B-RR, 4 ranks)")) << r.out;
  r = run_pipetrain("train --transport local --stages 2 --plan " + (dir / "plan.json").string() + kModel);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("has 3 stages but --stages is 2")) << r.out;
  // A plan made on a bigger machine (its profile's threads per rank) named a --threads nobody gave.
  nlohmann::json many = plan;
  many["threads"] = 4096;
  std::ofstream(dir / "many.json") << many.dump();
  r = run_pipetrain("train --transport local --plan " + (dir / "many.json").string() + kModel + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("the plan " + (dir / "many.json").string() + " runs 4096 threads per rank")) << r.out;
  EXPECT_TRUE(r.has("give --threads N")) << r.out;
  // A bad schedule in the file is the file's, not a --schedule nobody typed.
  nlohmann::json typo = plan;
  typo["schedule"] = "1f1bb";
  std::ofstream(dir / "typo.json") << typo.dump();
  r = run_pipetrain("train --transport local --plan " + (dir / "typo.json").string() + kModel + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has((dir / "typo.json").string() + ": its \"schedule\": unknown schedule '1f1bb'")) << r.out;
  fs::remove_all(dir);
}

TEST(PlanCli, PipeDreamVgg16Profile) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  ASSERT_TRUE(fs::exists(vgg)) << vgg << " is missing; it is part of the repository";
  const CommandResult r = run_pipetrain("plan --profile " + vgg.string() +
                                        " --pipedream-batch 128 --ranks 4 --bandwidth 1.25 --batch-size 128");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("(39 layers, profiled at micro-batch 128)")) << r.out;
  EXPECT_LE(row_time(r.out, "chosen:"), row_time(r.out, "uniform balance, 1f1b")) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(PipeDream planner[^\n]* x replication ([0-9,]+))"))) << r.out;
  int devices = 0;
  for (char c : std::string(m[1]))
    if (c != ',') devices += c - '0';
  EXPECT_LE(devices, 4) << r.out;
}

// With PipeDream's planner states and its activation compression ratio of 1, the PipeDream row is what
// PipeDream's own planner prints on this profile (data/pipedream/vgg16-planner-expected.json).
TEST(PlanCli, PipeDreamStatesReproducePipeDreamsPlanner) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  for (const auto& [ranks, row] : std::vector<std::pair<int, std::string>>{
           {4, "205.52 ms/mini-batch, peak 24.322 GiB, 17,23 x replication 3,1"},
           {8, "103.83 ms/mini-batch, peak 26.758 GiB, 24,16 x replication 7,1"}}) {
    const CommandResult r =
        run_pipetrain("plan --profile " + vgg.string() + " --pipedream-states --pipedream-batch 128 --ranks " +
                      std::to_string(ranks) + " --bandwidth 1 --cost-form reference --activation-compression 1 "
                      "--batch-size 128 --microbatch-counts 4");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(r.has("(40 layers, profiled at micro-batch 128)")) << r.out;
    EXPECT_TRUE(r.has(row)) << r.out;
  }
}

TEST(PlanCli, MeasuredAndTypeBalancesInTrain) {
  for (const std::string kind : {"time", "memory", "type:Block"}) {
    const CommandResult r =
        run_pipetrain("train --transport local --stages 2 --steps 1 --batch-size 8 --balance " + kind + kModel);
    ASSERT_EQ(r.code, 0) << kind << "\n" << r.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(balance ([0-9]+),([0-9]+))"))) << r.out;
    EXPECT_EQ(std::stoi(m[1]) + std::stoi(m[2]), 6) << r.out;
    // type:Block puts two of the four blocks on each stage (the embedding and head count zero).
    if (kind == "type:Block") {
      EXPECT_TRUE(m[0] == "balance 3,3" || m[0] == "balance 2,4") << r.out;
    }
  }
}

TEST(PlanCli, UsageErrors) {
  const fs::path dir = temp_dir("errors");
  std::ofstream(dir / "short.json") << R"({"format": "pipetrain-profile", "version": 1, "model": "x",
    "micro_batch_size": 1, "threads": 1, "layers": [{"name": "a", "type": "Linear", "forward_ms": 1,
    "backward_ms": 1, "activation_bytes": 4, "parameter_bytes": 4, "optimizer_bytes": 0}]})";
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"plan --profile /nonexistent.json", "/nonexistent.json"},
           {"plan --profile " + (dir / "short.json").string() + " --ranks 2 --no-hybrid",
            "2 ranks but the profile has 1 layers"},
           {"plan --profile " + (dir / "short.json").string() + " --ranks 0", "--ranks must be in 1..1048576"},
           {"plan --profile " + (dir / "short.json").string() + " --ranks 10000000", "got 10000000"},
           {"plan --profile " + (dir / "short.json").string() + " --pipedream-batch 4", "drop --pipedream-batch"},
           {"train --transport local --balance speed" + kModel, "unknown balance"},
           {"train --transport local --balance time --profile " + (dir / "short.json").string() + kModel,
            "has 1 layers but the model has 6"},
           {"train --transport local --balance time --balance-solver greedy" + kModel, "greedy"},
           {"train --transport local --plan /nonexistent/plan.json" + kModel, "/nonexistent/plan.json"},
       }) {
    const CommandResult r = run_pipetrain(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(r.has(c.message)) << c.args << "\n" << r.out;
  }
  fs::remove_all(dir);
}

TEST(PlanCli, SimulateFromAProfile) {
  const fs::path dir = temp_dir("simulate");
  std::ofstream(dir / "p.json") << R"({"format": "pipetrain-profile", "version": 1, "model": "x",
    "micro_batch_size": 2, "threads": 1, "layers": [
    {"name": "a", "type": "Linear", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 8, "parameter_bytes": 4, "optimizer_bytes": 0},
    {"name": "b", "type": "Linear", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 8, "parameter_bytes": 4, "optimizer_bytes": 0},
    {"name": "c", "type": "Linear", "forward_ms": 2, "backward_ms": 4, "activation_bytes": 8, "parameter_bytes": 4, "optimizer_bytes": 0}]})";
  // Time balance puts [a, b] and [c] on two stages: F = 2 each, backward 4 each (no split, so B = 4,
  // W = 0). GPipe with m = 3 and no transfer cost: (m + p - 1)(F + B) = 4 x 6 = 24.
  const CommandResult r = run_pipetrain("simulate --schedule gpipe --stages 2 --microbatches 3 --profile " +
                                        (dir / "p.json").string() + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_DOUBLE_EQ(j.at("makespan").get<double>(), 24.0);
  // At micro-batch 4 (twice the profiled size) every time doubles.
  const CommandResult r4 = run_pipetrain("simulate --schedule gpipe --stages 2 --microbatches 3 --microbatch-size 4 "
                                         "--profile " + (dir / "p.json").string() + " --json");
  ASSERT_EQ(r4.code, 0) << r4.out;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(r4.out).at("makespan").get<double>(), 48.0);
  fs::remove_all(dir);
}

TEST(PlanCli, UmpipePlannerWritesPartitionsPerStage) {
  const fs::path dir = temp_dir("umpipe");
  // Two layers with a large fixed cost per micro-batch on the first (it wants few, big micro-batches)
  // and a per-sample cost on the second: measured at sizes 1, 4 and 16, so the fits are affine.
  std::ofstream(dir / "p.json") << R"({"format": "pipetrain-profile", "version": 1, "model": "x",
    "micro_batch_size": 4, "threads": 1, "layers": [
    {"name": "a", "type": "Linear", "forward_ms": 2.4, "backward_ms": 4.8, "activation_bytes": 64, "parameter_bytes": 4,
     "optimizer_bytes": 0, "by_micro_batch": [{"micro_batch_size": 1, "forward_ms": 2.1, "backward_ms": 4.2},
                                              {"micro_batch_size": 16, "forward_ms": 3.6, "backward_ms": 7.2}]},
    {"name": "b", "type": "Linear", "forward_ms": 2.0, "backward_ms": 4.0, "activation_bytes": 64, "parameter_bytes": 4,
     "optimizer_bytes": 0, "by_micro_batch": [{"micro_batch_size": 1, "forward_ms": 0.5, "backward_ms": 1.0},
                                              {"micro_batch_size": 16, "forward_ms": 8.0, "backward_ms": 16.0}]}]})";
  const CommandResult r = run_pipetrain("plan --profile " + (dir / "p.json").string() +
                                        " --ranks 2 --batch-size 16 --planner umpipe --generations 100 --out " +
                                        (dir / "plan.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("dgap generation    0")) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(equal +([0-9.]+) ms)"))) << r.out;
  const double equal = std::stod(m[1]);
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(dgap +([0-9.]+) ms)"))) << r.out;
  EXPECT_LE(std::stod(m[1]), equal + 1e-9) << "DGAP is seeded with the best equal partition\n" << r.out;
  const nlohmann::json plan = read_json_file(dir / "plan.json");
  ASSERT_TRUE(plan.contains("umpipe")) << plan.dump();
  for (const char* dir_name : {"forward", "backward"}) {
    ASSERT_EQ(plan["umpipe"][dir_name].size(), 2u);
    for (const auto& row : plan["umpipe"][dir_name]) {
      int sum = 0;
      for (const auto& b : row) sum += b.get<int>();
      EXPECT_EQ(sum, 16) << "every stage's partition covers the mini-batch";
    }
  }
  fs::remove_all(dir);
}

TEST(PlanCli, ReplicatedPipelinesTrainLikeOne) {
  SKIP_WITHOUT_GLOO();
  // --replicas 2: two copies of a 2-stage pipeline, each on half of every mini-batch, average their
  // gradients; the losses equal one pipeline's on the whole batch with the same micro-batch size.
  const fs::path dir = temp_dir("replicas");
  const std::string common = kModel + " --batch-size 8 --steps 4 --lr-schedule constant --clip 0 --stages 2 --log ";
  CommandResult one = run_pipetrain("train --transport local -m 4" + common + (dir / "one.jsonl").string());
  ASSERT_EQ(one.code, 0) << one.out;
  CommandResult two = run_pipetrain("train --transport gloo --replicas 2 -m 2" + common + (dir / "two.jsonl").string());
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_TRUE(two.has("2 stages x 2 replicas over gloo")) << two.out;
  auto losses = [](const fs::path& p) {
    std::vector<double> out;
    std::ifstream in(p);
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    return out;
  };
  const auto a = losses(dir / "one.jsonl"), b = losses(dir / "two.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (std::size_t k = 0; k < 4; ++k) EXPECT_NEAR(a[k], b[k], 1e-5 * std::abs(a[k])) << "step " << k + 1;
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--replicas 3 --batch-size 8", "does not split evenly over --replicas 3"},
           {"--replicas 2 --schedule pipedream", "--replicas runs with the synchronous schedules"},
           {"--replicas 0", "--replicas must be >= 1"}}) {
    const CommandResult r = run_pipetrain("train --transport local --stages 2 " + args + kModel);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(r.has(message)) << args << "\n" << r.out;
  }
  fs::remove_all(dir);
}

// Issue 28: more ranks than layers give hybrid plans (replicas of a shorter pipeline), and the chosen
// plan is never slower than a row the output shows: data parallelism, uniform 1f1b, PipeDream's plan.
TEST(PlanCli, HybridPlansForMoreRanksThanLayers) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  for (const char* ranks : {"39", "256"}) {
    const CommandResult r = run_pipetrain("plan --profile " + vgg.string() + " --ranks " + ranks + " --bandwidth 1.25");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(r.has("why: fastest")) << r.out;
    const double chosen = row_time(r.out, "chosen:");
    ASSERT_GT(chosen, 0) << r.out;
    for (const char* row : {"data parallelism", "uniform balance, 1f1b", "PipeDream's plan as 1F1B-RR", "runner-up:"}) {
      const double t = row_time(r.out, row);
      if (t > 0) {
        EXPECT_LE(chosen, t) << row << "\n" << r.out;
      }
    }
    EXPECT_GT(row_time(r.out, "data parallelism"), 0) << r.out;
  }
}

// A per-rank memory limit: the chosen plan is within it where any simulated plan is (on VGG-16 x 8 ranks
// at 10 GiB no plain 1F1B-family pipeline is, but copies of PipeDream's plan and v-min plans are); a limit
// nothing meets says so, with the fix, and marks the rows over it.
TEST(PlanCli, AMemoryLimitIsMetOrSaidToBeUnmet) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  const std::string base = "plan --profile " + vgg.string() + " --ranks 8 --bandwidth 1.25 --memory ";
  const CommandResult fits = run_pipetrain(base + "10");
  ASSERT_EQ(fits.code, 0) << fits.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(fits.out, m, std::regex(R"(chosen: .* ([0-9.]+)  [0-9,]+\n)"))) << fits.out;
  EXPECT_LE(std::stod(m[1]), 10.0) << fits.out;  // the peak GiB column
  EXPECT_FALSE(m.str().find("over the memory limit") != std::string::npos) << fits.out;
  EXPECT_TRUE(fits.has("why: fastest within 10 GiB per rank")) << fits.out;
  const CommandResult tight = run_pipetrain(base + "8");
  ASSERT_EQ(tight.code, 0) << tight.out;
  EXPECT_TRUE(tight.has("fits 8 GiB per rank (raise --memory, give more --ranks or a smaller --batch-size)")) << tight.out;
  EXPECT_TRUE(tight.has("(over the memory limit)")) << tight.out;
  EXPECT_FALSE(tight.has("why: fastest within")) << tight.out;
}

// The torch-free front (`pipetrain`) runs plan, simulate and schedule itself and hands other commands to
// pipetrain-torch next to it with the same arguments.
TEST(PlanCli, TheFrontHandsTorchCommandsOn) {
  const fs::path front(PIPETRAIN_BIN);
  ASSERT_TRUE(fs::exists(front.parent_path() / "pipetrain-torch")) << "pipetrain-torch is built with pipetrain";
  CommandResult r = run_pipetrain("train --help");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("--schedule")) << r.out;
  r = run_pipetrain("--help");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("train")) << r.out;
  EXPECT_TRUE(r.has("profile")) << r.out;
  r = run_pipetrain("simulate -s 1f1b -p 4 -m 8");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("makespan 33.000")) << r.out;  // (m + p - 1) (F + B + W) at unit costs
}

namespace {

// The table's rows: (the row's text, its ms/mini-batch).
std::vector<std::pair<std::string, double>> table_rows(const std::string& out) {
  std::vector<std::pair<std::string, double>> rows;
  const std::regex re(R"(^  (\S[^\n]*?)\s+[0-9]+\s+([0-9]+\.[0-9]{2})\s+[0-9]+\.[0-9]\s+[0-9.]+\s+[0-9.]+  [0-9,]+[^\n]*$)");
  std::istringstream in(out);
  std::string line;
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_match(line, m, re)) rows.emplace_back(line, std::stod(m[2]));
  return rows;
}

// The chosen row is never slower than a row the options let be chosen (those not marked "not eligible").
void expect_chosen_is_fastest_eligible(const std::string& out) {
  const auto rows = table_rows(out);
  ASSERT_FALSE(rows.empty()) << out;
  ASSERT_NE(rows.front().first.find("chosen:"), std::string::npos) << out;
  EXPECT_EQ(rows.front().first.find("not eligible"), std::string::npos) << out;
  for (const auto& [row, ms] : rows)
    if (row.find("not eligible") == std::string::npos) {
      EXPECT_LE(rows.front().second, ms) << row << "\n" << out;
    }
}


}  // namespace

// The tester's --planner umpipe case (a 6-layer profile on 2 ranks): an interleaved pipeline and data
// parallelism are faster than every straight pipeline, but UMPIPE cuts one, so they are marked, and the
// chosen row is the fastest straight one. dgap's partitions (train --plan's default) are slower than
// it: plan says so, the file's umpipe section names the fastest ("off"), and the invitation to run
// the file passes --umpipe off.
TEST(PlanCli, UmpipeChoosesAmongTheRowsItCanRunAndSaysWhichIsFastest) {
  const fs::path dir = temp_dir("umpipe-choice");
  fs::copy_file(std::string(PIPETRAIN_SOURCE_DIR) + "/tests/data/toy-gpt6-profile.json", dir / "toy.json");
  const CommandResult r = run_pipetrain("plan --profile " + (dir / "toy.json").string() + " --ranks 2 --batch-size 16 "
                                        "--planner umpipe --generations 20 --out " + (dir / "u.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  expect_chosen_is_fastest_eligible(r.out);
  EXPECT_TRUE(r.has("(not eligible: UMPIPE cuts one straight pipeline over 2 ranks, one stage each)")) << r.out;
  bool faster_marked = false;
  const auto rows = table_rows(r.out);
  for (const auto& [row, ms] : rows) faster_marked = faster_marked || (ms < rows.front().second && row.find("not eligible") != std::string::npos);
  EXPECT_TRUE(faster_marked) << "the interleaved row is faster, and marked\n" << r.out;
  // The straight pipeline is faster than every planner's partitions: train --plan runs it by default.
  EXPECT_TRUE(r.has("runs by default: the straight pipeline chosen above")) << r.out;
  const nlohmann::json plan = read_json_file(dir / "u.json");
  EXPECT_EQ(plan.at("balance").size(), 2u);
  EXPECT_FALSE(plan.contains("virtual_stages"));
  EXPECT_EQ(plan.at("umpipe").at("fastest"), "off");
  EXPECT_EQ(plan.at("umpipe").at("runs_by_default"), "off");
  EXPECT_NEAR(plan.at("umpipe").at("straight_pipeline_ms").get<double>(), plan.at("time_ms").get<double>(), 1e-9);
  EXPECT_LT(plan.at("time_ms").get<double>(), plan.at("umpipe").at("planners").at("dgap").at("step_ms").get<double>());
  fs::remove_all(dir);
}

// The tester's --no-hybrid --schedules gpipe case on VGG-16 x 4 ranks: PipeDream's 1F1B-RR plan and data
// parallelism are faster but marked not eligible; the chosen and written plan is one gpipe pipeline over
// the 4 ranks, with straight_pipeline true and data parallelism's simulated time (not 0).
TEST(PlanCli, NoHybridNeverChoosesAReplicatedPlan) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  const fs::path dir = temp_dir("no-hybrid");
  const CommandResult r = run_pipetrain("plan --profile " + vgg.string() + " --pipedream-batch 128 --ranks 4 "
                                        "--bandwidth 1.25 --no-hybrid --schedules gpipe --out " + (dir / "p2.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  expect_chosen_is_fastest_eligible(r.out);
  EXPECT_TRUE(r.has("chosen: 4 stages x 1 replica, gpipe")) << r.out;
  EXPECT_TRUE(r.has("(not eligible: --no-hybrid: one pipeline over 4 ranks only)")) << r.out;
  const nlohmann::json plan = read_json_file(dir / "p2.json");
  EXPECT_EQ(plan.at("replication"), nlohmann::json::array({1, 1, 1, 1}));
  EXPECT_EQ(plan.at("schedule"), "gpipe");
  EXPECT_TRUE(plan.at("options").at("straight_pipeline").get<bool>());
  EXPECT_GT(plan.at("data_parallel_time_ms").get<double>(), 0.0);
  EXPECT_NEAR(plan.at("speedup_over_data_parallel").get<double>(),
              plan.at("data_parallel_time_ms").get<double>() / plan.at("time_ms").get<double>(), 1e-9);
  EXPECT_FALSE(plan.contains("stage_in_flight"));
  EXPECT_TRUE(plan.at("pipedream").contains("stage_in_flight"));
  // Replicas allowed but only gpipe asked for: 1F1B-RR (it runs 1f1b) is a reference too.
  const CommandResult g = run_pipetrain("plan --profile " + vgg.string() + " --pipedream-batch 128 --ranks 4 "
                                        "--bandwidth 1.25 --schedules gpipe");
  ASSERT_EQ(g.code, 0) << g.out;
  expect_chosen_is_fastest_eligible(g.out);
  EXPECT_TRUE(g.has("(not eligible: 1F1B-RR runs 1f1b, which --schedules leaves out)")) << g.out;
  fs::remove_all(dir);
}

// plan's predicted time for a pipeline is what simulate --profile gives for the same schedule, balance,
// m and micro-batch size: both price each cut by its own bytes (VGG-16's cuts differ by 8x).
TEST(PlanCli, PlanAndSimulateAgreeOnAPlansTime) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  const CommandResult p = run_pipetrain("plan --profile " + vgg.string() + " --pipedream-batch 128 --ranks 4 "
                                        "--bandwidth 1.25 --latency 0 --no-hybrid --schedules 1f1b --balances 5,7,7,20 "
                                        "--microbatch-counts 32");
  ASSERT_EQ(p.code, 0) << p.out;
  const double planned = row_time(p.out, "chosen: 4 stages");
  ASSERT_GT(planned, 0) << p.out;
  const CommandResult s = run_pipetrain("simulate -s 1f1b -p 4 -m 32 --profile " + vgg.string() +
                                        " --pipedream-batch 128 --microbatch-size 32 --bandwidth 1.25 --latency 0 "
                                        "--balance 5,7,7,20 --json");
  ASSERT_EQ(s.code, 0) << s.out;
  const double simulated = nlohmann::json::parse(s.out.substr(s.out.find('{'))).at("makespan").get<double>();
  EXPECT_NEAR(planned, simulated, 0.006) << p.out << "\n" << s.out;  // the table rounds to 0.01 ms
}

// Bad plan flags exit 2 naming the value and the fix: --level read whole (no prefixes) with a device
// product the search takes, --activation-compression, --batch-size, --overhead and --latency in range.
TEST(PlanCli, BadPlanFlagsNameTheValueAndTheFormat) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  const std::string base = "plan --profile " + vgg.string() + " --pipedream-batch 128 ";
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--level 4.5:100", "--level 4.5:100: MACHINES '4.5' is not a whole number"},
           {"--level 4:100abc", "--level 4:100abc: GB/s '100abc' is not a number; write MACHINES:GB/s"},
           {"--level 4:100:3", "--level 4:100:3: GB/s '100:3' is not a number"},
           {"--level 4", "no ':' between MACHINES and GB/s"},
           {"--level 0:100", "MACHINES is 0"},
           {"--level 4:0", "GB/s is 0"},
           {"--level 3:100 --level 1431655766:1 --ranks 2", "3 x 1431655766 = more than 1048576 devices"},
           {"--level 65536:1 --level 65536:1", "65536 x 65536 = more than 1048576 devices"},
           {"--level 2147483647:1 --level 2:1", "2147483647 = more than 1048576 devices"},
           {"--level 4:100 --level 2:10 --ranks 4", "--level describes 4 x 2 = 8 devices but --ranks is 4"},
           {"--activation-compression -1", "--activation-compression must be a finite ratio > 0"},
           {"--batch-size 0", "--batch-size must be >= 1 (samples per mini-batch), got 0"},
           {"--batch-size -5", "got -5"},
           {"--planner umpipe --overhead -1", "--overhead must be a finite number of ms >= 0"},
           {"--latency 1e308", "--latency must be at most 1e9 us"},
           {"--ranks 4 --no-hybrid --balances 4,35", "or drop --no-hybrid"},
       }) {
    const CommandResult r = run_pipetrain(base + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(r.has(c.message)) << c.args << "\n" << r.out;
    EXPECT_FALSE(r.has("latency_ms")) << c.args << "\n" << r.out;  // no internal field names
  }
  // A balance list with replicas allowed applies to its own stage count (it used to fail on one stage).
  const CommandResult b = run_pipetrain(base + "--ranks 4 --bandwidth 1.25 --balances 5,7,7,20");
  EXPECT_EQ(b.code, 0) << b.out;
  EXPECT_TRUE(b.has("5,7,7,20")) << b.out;
}

// A plan that fits no memory limit is written for inspection, said not to fit (with its peak), and not
// offered to train --plan; --exhaustive says every candidate was simulated; a PipeDream graph file
// without --pipedream-batch gets a warning.
TEST(PlanCli, NoFitExhaustiveAndGraphBatchAreSaidPlainly) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  const fs::path dir = temp_dir("nofit");
  const std::string base = "plan --profile " + vgg.string() + " --pipedream-batch 128 --ranks 4 --bandwidth 1.25 ";
  CommandResult r = run_pipetrain(base + "--memory 0.5 --out " + (dir / "nofit.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("but it does NOT fit 0.5 GiB per rank (its peak: ")) << r.out;
  EXPECT_FALSE(r.has("(run it with pipetrain train --plan")) << r.out;
  const nlohmann::json plan = read_json_file(dir / "nofit.json");
  EXPECT_FALSE(plan.at("fits_memory_limit").get<bool>());
  EXPECT_GT(plan.at("predicted_peak_bytes").get<double>(), 0.5 * 1073741824.0);
  r = run_pipetrain(base + "--memory 30 --out " + (dir / "fits.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("(run it with pipetrain train --plan")) << r.out;
  EXPECT_TRUE(read_json_file(dir / "fits.json").at("fits_memory_limit").get<bool>());
  r = run_pipetrain(base + "--exhaustive --microbatch-counts 4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("simulated every one (--exhaustive)")) << r.out;
  EXPECT_FALSE(r.has("lower bound could not beat")) << r.out;
  r = run_pipetrain("plan --profile " + vgg.string() + " --ranks 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("give --pipedream-batch N")) << r.out;
  fs::remove_all(dir);
}

// Asynchronous schedules in --schedules were dropped without a word (a tester's findings, 2026-11-28): a note
// names them beside synchronous ones, and alone they are refused saying why and what is searched.
TEST(PlanCli, AsynchronousSchedulesAreNamedNotDroppedSilently) {
  const std::string vgg = std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt";
  const std::string base = "plan --profile " + vgg + " --pipedream-batch 128 --ranks 2 --microbatch-counts 4 ";
  const CommandResult mixed = run_pipetrain(base + "--schedules 1f1b pipedream");
  EXPECT_EQ(mixed.code, 0) << mixed.out;
  EXPECT_TRUE(mixed.has("pipetrain plan: note: --schedules pipedream: the asynchronous schedules (pipedream, 2bw, "
                        "spectrain) are not searched")) << mixed.out;
  EXPECT_FALSE(run_pipetrain(base + "--schedules 1f1b").has("note: --schedules"));
  const CommandResult alone = run_pipetrain(base + "--schedules pipedream");
  EXPECT_EQ(alone.code, 2) << alone.out;
  EXPECT_TRUE(alone.has("--schedules pipedream names only asynchronous schedules")) << alone.out;
  EXPECT_TRUE(alone.has("PipeDream's own planner is run for every plan")) << alone.out;
}

// A tester's finding (2026-11-28): --memory 20 (20x what the unconstrained winner, PipeDream's plan as
// 1F1B-RR, peaks at) made plan choose a plan 2.2x slower: PipeDream's planner, given the limit, priced its
// plan by its asynchronous memory model and dropped it. A limit the winner meets now keeps it.
TEST(PlanCli, AGenerousMemoryLimitKeepsTheFastestPlan) {
  const fs::path vgg = fs::path(PIPETRAIN_SOURCE_DIR) / "data" / "pipedream" / "vgg16-graph.txt";
  const std::string args =
      "plan --profile " + vgg.string() + " --pipedream-batch 128 --batch-size 128 --ranks 8 --bandwidth 1.25";
  auto chosen = [](const std::string& out) {
    const auto at = out.find("chosen:");
    return at == std::string::npos ? std::string("(none)") : out.substr(at, out.find('\n', at) - at);
  };
  const CommandResult free = run_pipetrain(args, false), limited = run_pipetrain(args + " --memory 20", false);
  ASSERT_EQ(free.code, 0) << free.out;
  ASSERT_EQ(limited.code, 0) << limited.out;
  EXPECT_NE(chosen(free.out).find("1F1B-RR"), std::string::npos) << free.out;
  EXPECT_EQ(chosen(limited.out), chosen(free.out)) << limited.out;
}

// A plan's replicas given again on the command line, as the --plan help invites ("must agree with the
// file"), were compared with --replicas' default (--plan is read while the line is parsed): `--plan dp.json
// --replicas 2` for a plan of 2 replicas was refused with "--replicas is 1".
TEST(PlanCli, FlagsThatAgreeWithThePlanAreAccepted) {
  const fs::path dir = temp_dir("agree");
  const std::string plan = (dir / "dp.json").string();
  std::ofstream(plan) << R"({"balance":[4],"balance_kind":"uniform","balance_solver":"min-max","batch_size":32,)"
                         R"("data_parallel_fits":true,"data_parallel_time_ms":5.76,"format":"pipetrain-plan","layers":4,)"
                         R"("microbatches":1,"model":"mlp: 4 Linear layers, width 256, 64 inputs, 10 classes on synthetic )"
                         R"(data","options":{"activation_compression":0.0,"allow_fewer_machines":true,"cost_form":"paper",)"
                         R"("levels":[{"bandwidth_bytes_per_s":1e10,"machines":2}],"memory_limit_bytes":null,)"
                         R"("straight_pipeline":false,"weight_stashing":false},"planner":"pipedream",)"
                         R"("predicted_bubble_fraction":0.116,"predicted_peak_bytes":2474784.0,"replication":[2],)"
                         R"("schedule":"gpipe","speedup_over_data_parallel":1.0,"stage_memory_bytes":[2474784.0],)"
                         R"("stage_time_ms":[5.09],"threads":1,"time_ms":5.76,"version":1})";
  const std::string train = "train --model mlp --data synthetic --transport local --progress quiet --steps 1 --plan " + plan;
  for (const std::string agreeing : {"", " --replicas 2", " --replicas 2 --stages 1"}) {
    const CommandResult r = run_pipetrain(train + agreeing);
    EXPECT_EQ(r.code, 0) << agreeing << "\n" << r.out;
    EXPECT_TRUE(r.has("1 stages x 2 replicas")) << agreeing << "\n" << r.out;
  }
  const CommandResult three = run_pipetrain(train + " --replicas 3");
  EXPECT_EQ(three.code, 2) << three.out;
  EXPECT_TRUE(three.has("replicates every stage 2 times but --replicas is 3")) << three.out;
  fs::remove_all(dir);
}
