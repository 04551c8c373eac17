// Checks the runtime terms of the cost model as a user meets them (issue 15): `pipetrain profile
// --transport local` writes measured transfer and overhead costs into the profile; `simulate --profile`
// and `plan` add a profile's transfers (latency + boundary bytes / bandwidth) and per-action overhead to
// their predictions, exactly as worked out by hand, unless --latency/--bandwidth are given; the train
// summary prints the prediction with the run's own transfer and overhead terms beside today's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;
using pipetrain::testing::read_json_file;
using pipetrain::testing::run_pipetrain;

namespace {

const std::string kModel = " --data synthetic --d-model 16 --heads 2 --seq-len 8 --vocab 16 --layers 2";

fs::path temp_dir(const std::string& name) { return pipetrain::testing::fresh_temp_dir("runtime-costs", name); }

// Two layers at micro-batch 4; layer a's output (400 bytes) crosses the boundary of balance 1,1.
std::string two_layer_profile(const std::string& runtime) {
  return std::string(R"({"format": "pipetrain-profile", "version": )") + (runtime.empty() ? "1" : "2") +
         R"(, "model": "toy", "micro_batch_size": 4, "threads": 1,
  "layers": [{"name": "a", "type": "Linear", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 400,
              "parameter_bytes": 16, "optimizer_bytes": 32},
             {"name": "b", "type": "Linear", "forward_ms": 2, "backward_ms": 3, "activation_bytes": 100,
              "parameter_bytes": 16, "optimizer_bytes": 32}])" +
         (runtime.empty() ? "" : ",\n  \"runtime\": " + runtime) + "}\n";
}

const std::string kRuntime =
    R"({"transport": "shm", "latency_ms": 0.05, "bandwidth_bytes_per_ms": 200, "overhead_ms": 0.125})";

double makespan(const std::string& args) {
  const CommandResult r = run_pipetrain("simulate --schedule gpipe -p 2 -m 1 --balance 1,1 --json " + args);
  EXPECT_EQ(r.code, 0) << r.out;
  return nlohmann::json::parse(r.out.substr(r.out.find('{'))).at("makespan").get<double>();
}

}  // namespace

// GPipe p=2 m=1 runs F0, F1, BW1, BW0 in a chain: 1 + 2 + 3 + 2 = 8 of compute, two transfers of 400
// bytes at 0.05 ms + 400 / 200 ms each, and four compute actions of 0.125 ms overhead.
TEST(RuntimeCostsCli, SimulateAddsAProfilesTransfersAndOverhead) {
  const fs::path dir = temp_dir("simulate");
  std::ofstream(dir / "plain.json") << two_layer_profile("");
  std::ofstream(dir / "runtime.json") << two_layer_profile(kRuntime);
  EXPECT_DOUBLE_EQ(makespan("--profile " + (dir / "plain.json").string()), 8.0);
  EXPECT_NEAR(makespan("--profile " + (dir / "runtime.json").string()), 8.0 + 2 * (0.05 + 2.0) + 4 * 0.125, 1e-9);
  // --latency given: it sets the latency, the bandwidth stays the measured one (each flag replaces its own
  // term only), and so does the overhead; both given, the measured transfers are not used at all.
  EXPECT_NEAR(makespan("--profile " + (dir / "runtime.json").string() + " --latency 100"),
              8.0 + 2 * (0.1 + 2.0) + 0.5, 1e-9);
  EXPECT_NEAR(makespan("--profile " + (dir / "runtime.json").string() + " --bandwidth 0.0004"),
              8.0 + 2 * (0.05 + 1.0) + 0.5, 1e-9);
  EXPECT_NEAR(makespan("--profile " + (dir / "runtime.json").string() + " --latency 100 --bandwidth 0"),
              8.0 + 2 * 0.1 + 0.5, 1e-9);
}

TEST(RuntimeCostsCli, PlanUsesTheMeasuredTransfers) {
  const fs::path dir = temp_dir("plan");
  std::ofstream(dir / "runtime.json") << two_layer_profile(kRuntime);
  CommandResult r = run_pipetrain("plan --profile " + (dir / "runtime.json").string() +
                                  " --ranks 2 --batch-size 4 --microbatch-counts 1 --schedules gpipe --balances uniform");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("transfers and overhead as measured over shm: 50.00 us")) << r.out;
  EXPECT_TRUE(r.has("0.0002 GB/s")) << r.out;
  // The one candidate, costed as simulate does above: 12.6 ms per mini-batch.
  EXPECT_TRUE(r.has(" 12.60 ")) << r.out;
  r = run_pipetrain("plan --profile " + (dir / "runtime.json").string() +
                    " --ranks 2 --batch-size 4 --microbatch-counts 1 --schedules gpipe --balances uniform --latency 0");
  ASSERT_EQ(r.code, 0) << r.out;
  // --latency given: the measured bandwidth stays, and the line says which term is whose.
  EXPECT_TRUE(r.has("as measured over shm: 0.00 us (--latency) + bytes at 0.0002 GB/s, 125.00 us")) << r.out;
  EXPECT_TRUE(r.has(" 12.50 ")) << r.out;  // 12.6 less the two transfers' 0.05 ms latency
  // A fit that found no bandwidth term (latency only): the bytes cost nothing, and plan says so
  // instead of printing the largest double as GB/s.
  std::ofstream(dir / "latency-only.json")
      << two_layer_profile(R"({"transport": "shm", "latency_ms": 0.05, "bandwidth_bytes_per_ms": 0, "overhead_ms": 0})");
  r = run_pipetrain("plan --profile " + (dir / "latency-only.json").string() +
                    " --ranks 2 --batch-size 4 --microbatch-counts 1 --schedules gpipe --balances uniform");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("50.00 us + bytes at no bandwidth limit (latency only)")) << r.out;
  EXPECT_FALSE(r.has("e+")) << r.out;
  EXPECT_TRUE(r.has(" 8.10 ")) << r.out;  // 8 of compute and two transfers of 0.05 ms
}

TEST(RuntimeCostsCli, ProfileMeasuresTheLocalTransport) {
  const fs::path dir = temp_dir("profile");
  const CommandResult r = run_pipetrain("profile" + kModel + " --microbatch-size 2 --repeats 2 --threads 1 "
                                        "--transport local --out " + (dir / "p.json").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("runtime over local (2 ranks)")) << r.out;
  const nlohmann::json p = read_json_file(dir / "p.json");
  EXPECT_EQ(p.at("version"), 3);  // runtime costs (2) and the layers' optimizer step times (3)
  EXPECT_GT(p.at("layers").at(1).at("optimizer_ms").get<double>(), 0.0);
  const nlohmann::json& rt = p.at("runtime");
  // The data-parallel all-reduce over the 2 ranks, at the three default sizes, each taking some time.
  EXPECT_EQ(rt.at("allreduce").at("ranks"), 2);
  ASSERT_EQ(rt.at("allreduce").at("samples").size(), 3u);
  for (const auto& a : rt.at("allreduce").at("samples")) EXPECT_GT(a.at("ms").get<double>(), 0.0);
  EXPECT_TRUE(r.has("data-parallel all-reduce of float32 gradients over 2 ranks")) << r.out;
  EXPECT_EQ(rt.at("transport"), "local");
  EXPECT_GE(rt.at("latency_ms").get<double>(), 0.0);
  EXPECT_GE(rt.at("overhead_ms").get<double>(), 0.0);
  ASSERT_EQ(rt.at("transfers").size(), 4u);
  EXPECT_EQ(rt.at("transfers")[3].at("bytes"), 1048576);
  EXPECT_EQ(p.at("layers").size(), 4u);  // the layer profile is there as without --transport
  // The written profile feeds simulate.
  const CommandResult s = run_pipetrain("simulate --schedule 1f1b -p 2 -m 4 --profile " + (dir / "p.json").string());
  EXPECT_EQ(s.code, 0) << s.out;
}

TEST(RuntimeCostsCli, TrainSummaryPrintsBothPredictions) {
  const CommandResult r =
      run_pipetrain("train --transport local" + kModel + " --stages 2 --batch-size 8 --microbatches 2 --steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("simulated from measured stage costs")) << r.out;
  EXPECT_TRUE(r.has("with measured transfers")) << r.out;
  EXPECT_TRUE(r.has("per action and step")) << r.out;
}
