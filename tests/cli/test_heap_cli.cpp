// `pipetrain simulate --profile` reports the heap model (docs/ALGORITHMS.md §1.5.1) per rank: the
// activations, weight gradients and transfer buffers at the peak of their sum, in the table and in
// --json (per_stage[].heap, heap_policy); --reference predicts the blocking reference path.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

namespace fs = std::filesystem;
using pipetrain::testing::CommandResult;

CommandResult run_pipetrain(const std::string& args) {
  return pipetrain::testing::run_command(std::string(PIPETRAIN_BIN) + " " + args);
}

}  // namespace

// Two layers, one per stage, neither splits its backward: stage 0 keeps 1024 bytes per micro-batch and
// sends 1024, its gradients are 100 bytes; stage 1 keeps 512, gradients 300. 1F1B, p = 2, m = 2, lowered
//   rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0BW0 0RB1 0BW1 0S0
//   rank 1: 1RF0 1F0 1RF1 1BW0 1SB0 1F1 1BW1 1SB1 1S0
// Fast path: rank 0 posts both gradient receives at once (2048) and peaks after 0F1 with 2048 of
// activations and no gradients yet (4096); rank 1 posts both inputs (2048), each BW swaps a received
// input for the input gradient its send keeps, and peaks after 1F1 at 512 + 300 + 2048. Reference path:
// rank 0 receives 0RB0 at its action and peaks there (2048 + 1024).
TEST(HeapCli, SimulateReportsTheHeapParts) {
  const fs::path dir = fs::temp_directory_path() / ("pipetrain_heap_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "p.json") << R"({"format": "pipetrain-profile", "version": 1, "model": "x",
    "micro_batch_size": 2, "threads": 1, "layers": [
    {"name": "a", "type": "Linear", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 1024, "parameter_bytes": 100, "optimizer_bytes": 0},
    {"name": "b", "type": "Linear", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 512, "parameter_bytes": 300, "optimizer_bytes": 0}]})";
  const std::string args = "simulate -s 1f1b -p 2 -m 2 --balance 1,1 --profile " + (dir / "p.json").string();
  const CommandResult r = run_pipetrain(args + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("heap_policy").at("receives_ahead"), 4);
  EXPECT_EQ(j.at("heap_policy").at("sends_in_flight"), 4);
  const nlohmann::json& h0 = j.at("per_stage").at(0).at("heap");
  EXPECT_DOUBLE_EQ(h0.at("total").get<double>(), 4096);
  EXPECT_DOUBLE_EQ(h0.at("activations").get<double>(), 2048);
  EXPECT_DOUBLE_EQ(h0.at("gradients").get<double>(), 0);
  EXPECT_DOUBLE_EQ(h0.at("transfers").get<double>(), 2048);
  EXPECT_EQ(h0.at("after"), "0F1");
  const nlohmann::json& h1 = j.at("per_stage").at(1).at("heap");
  EXPECT_DOUBLE_EQ(h1.at("total").get<double>(), 512 + 300 + 2048);
  EXPECT_DOUBLE_EQ(h1.at("gradients").get<double>(), 300);
  EXPECT_EQ(h1.at("after"), "1F1");
  // peak_memory keeps its meaning: the activation peak.
  EXPECT_DOUBLE_EQ(j.at("per_stage").at(0).at("peak_memory").get<double>(), 2048);

  const CommandResult ref = run_pipetrain(args + " --reference --json");
  ASSERT_EQ(ref.code, 0) << ref.out;
  const nlohmann::json jr = nlohmann::json::parse(ref.out);
  EXPECT_EQ(jr.at("heap_policy").at("receives_ahead"), 0);
  const nlohmann::json& r0 = jr.at("per_stage").at(0).at("heap");
  EXPECT_DOUBLE_EQ(r0.at("total").get<double>(), 3072);
  EXPECT_DOUBLE_EQ(r0.at("transfers").get<double>(), 1024);
  EXPECT_EQ(r0.at("after"), "0RB0");

  const CommandResult text = run_pipetrain(args);
  ASSERT_EQ(text.code, 0) << text.out;
  EXPECT_TRUE(text.has("predicted heap growth in a step, MiB (4 receives posted ahead, 4 sends in flight)")) << text.out;
  EXPECT_TRUE(text.has("0F1")) << text.out;
  fs::remove_all(dir);
}

// Synthetic costs carry no gradient or message bytes: the heap is the activation peak, and the table
// is left out.
TEST(HeapCli, SyntheticCostsGiveTheActivationPeak) {
  const CommandResult r = run_pipetrain("simulate -s zb-h1 -p 3 -m 6 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const nlohmann::json& st : j.at("per_stage")) {
    EXPECT_DOUBLE_EQ(st.at("heap").at("total").get<double>(), st.at("peak_memory").get<double>());
    EXPECT_DOUBLE_EQ(st.at("heap").at("transfers").get<double>(), 0);
  }
  EXPECT_FALSE(run_pipetrain("simulate -s zb-h1 -p 3 -m 6").has("predicted heap growth"));
}
