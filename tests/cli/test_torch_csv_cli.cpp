// `pipetrain simulate --load FILE --format torch` and `pipetrain schedule --format torch`: PyTorch's
// schedule CSV (core/torch_csv.h) at the command line, with the PyTorch-written files of data/pytorch/.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "run_command.h"

namespace {

using pipetrain::testing::run_pipetrain;

std::string pytorch_data(const std::string& file) { return std::string(PIPETRAIN_SOURCE_DIR) + "/data/pytorch/" + file; }

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() /
             ("pipetrain-torchcsv-" + std::to_string(::getpid()) + "-" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

// PyTorch's ZB1P dump, 2 ranks x 2 looped stages, 8 micro-batches: each rank runs 2 chunks x 8 x (F, I,
// W), a chunk costing half of --cost 1:1:1, so 24 time units of work per rank, in either file form.
TEST(TorchCsvCli, SimulatesAScheduleDumpedByPyTorch) {
  for (const std::string file : {"zb1p_2rank_2stagep_compute.csv", "zb1p_2rank_2stagep_comms_legacy.csv"}) {
    const auto r = run_pipetrain("simulate --load " + pytorch_data(file) + " --format torch --json", false);
    ASSERT_EQ(r.code, 0) << file << "\n" << r.out;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["stages"], 2);
    EXPECT_EQ(j["virtual_stages"], 2);
    EXPECT_EQ(j["microbatches"], 8);
    for (const auto& st : j["per_stage"]) EXPECT_DOUBLE_EQ(st["busy"].get<double>(), 24.0);
    const std::string notes = j["notes"].dump();
    EXPECT_NE(notes.find(file.find("legacy") != std::string::npos ? "legacy letters, with communication"
                                                                  : "current letters, compute only"),
              std::string::npos)
        << notes;
  }
  const auto table = run_pipetrain("simulate --load " + pytorch_data("zb1p_2rank_2stagep_compute.csv") +
                                   " --format torch --ascii");
  EXPECT_EQ(table.code, 0) << table.out;
  EXPECT_TRUE(table.has("note: read with PyTorch's current letters")) << table.out;
  EXPECT_TRUE(table.has("rank 1  .")) << table.out;  // rank 1 waits for stage 0's first forward
}

// What `schedule --format torch` writes, `simulate --format torch` reads back to the same timeline.
TEST(TorchCsvCli, WrittenScheduleSimulatesAsTheGeneratedOne) {
  const auto dir = temp_dir();
  auto ours = nlohmann::json::parse(run_pipetrain("simulate -s zb-h1 -p 3 -m 5 --json", false).out);
  ours.erase("schedule");
  for (const std::string extra : {"", " --lower", " --letters legacy"}) {
    const std::string file = (dir / "zb.csv").string();
    const auto w = run_pipetrain("schedule -s zb-h1 -p 3 -m 5 --format torch --out " + file + extra, false);
    ASSERT_EQ(w.code, 0) << w.out;
    std::ifstream in(file);
    std::string first;
    std::getline(in, first);
    EXPECT_EQ(w.out.substr(0, first.size()), first);  // --out holds what was printed
    auto back = nlohmann::json::parse(run_pipetrain("simulate --load " + file + " --format torch --json", false).out);
    back.erase("notes");
    back.erase("schedule");
    EXPECT_EQ(back, ours) << extra;
  }
  std::filesystem::remove_all(dir);
}

TEST(TorchCsvCli, BadFilesAndFlagsExitTwoWithTheCell) {
  // PyTorch's DualPipeV dump, with paired cells, loads, validates and simulates.
  auto r = run_pipetrain("simulate --load " + pytorch_data("dualpipev_4rank_10mb.csv") + " --format torch");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_pipetrain("simulate --load " + pytorch_data("zb1p_2rank_2stagep_compute.csv") +
                    " --format torch --letters legacy");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("uses I, which only the current letters have")) << r.out;
  r = run_pipetrain("simulate --format torch -s 1f1b -p 2 -m 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("add --load FILE.csv")) << r.out;
  r = run_pipetrain("simulate --load " + pytorch_data("zb1p_2rank_2stagep_compute.csv") +
                    " --format torch --stage-rank 0,0,1,1");
  EXPECT_EQ(r.code, 2) << r.out;  // stage 1 is on rank 1's row: the validator marks the cell
  EXPECT_TRUE(r.has("1F0")) << r.out;
  r = run_pipetrain("simulate --load " + pytorch_data("zb1p_2rank_2stagep_compute.csv") + " --format torch -p 4");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("has 2 rows (ranks)")) << r.out;
  r = run_pipetrain("schedule -s pipedream -p 2 -m 3 --format torch");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("one synchronous step")) << r.out;
  r = run_pipetrain("simulate -s 1f1b -p 2 -m 2 --letters legacy");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("apply to --format torch")) << r.out;
}

// `schedule --load FILE --load-format torch` reads PyTorch's CSV (the message for such a file without it
// named simulate's --format torch, which in `schedule` is the output format): converted to pipetrain's CSV
// and back to PyTorch's, the timeline is the file's. Flags the file gives are checked against it.
TEST(TorchCsvCli, ScheduleConvertsPyTorchsCsvBothWays) {
  const auto dir = temp_dir();
  const std::string in = pytorch_data("zb1p_2rank_2stagep_compute.csv");
  const auto plain = run_pipetrain("schedule --load " + in);
  EXPECT_EQ(plain.code, 2) << plain.out;
  EXPECT_TRUE(plain.has("pipetrain schedule --load-format torch")) << plain.out;
  const auto comms = run_pipetrain("schedule --load " + pytorch_data("dualpipev_4rank_10mb.csv"));
  EXPECT_EQ(comms.code, 2) << comms.out;
  EXPECT_TRUE(comms.has("this looks like PyTorch's schedule CSV")) << comms.out;

  const std::string ours = (dir / "ours.csv").string(), back = (dir / "back.csv").string();
  const auto conv = run_pipetrain("schedule --load " + in + " --load-format torch --format csv --out " + ours);
  ASSERT_EQ(conv.code, 0) << conv.out;
  EXPECT_TRUE(conv.has("note: read with PyTorch's current letters")) << conv.out;
  ASSERT_EQ(run_pipetrain("schedule --load " + ours + " --format torch --out " + back).code, 0);
  auto sim = [](const std::string& args) {
    auto j = nlohmann::json::parse(run_pipetrain("simulate --json " + args, false).out);
    return std::make_pair(j["makespan"].get<double>(), j["per_stage"].dump());
  };
  const auto original = sim("--load " + in + " --format torch");
  EXPECT_EQ(sim("--load " + ours), original);
  EXPECT_EQ(sim("--load " + back + " --format torch"), original);

  const auto stage_rank = run_pipetrain("schedule --load " + ours + " --stage-rank 0,1");
  EXPECT_EQ(stage_rank.code, 2);
  EXPECT_TRUE(stage_rank.has("--stage-rank applies to --load-format torch")) << stage_rank.out;
}

// simulate --format torch took --virtual and --steps without a word (steps=1 printed for --steps 2).
TEST(TorchCsvCli, FlagsTheFileGivesMustAgreeWithIt) {
  const std::string in = pytorch_data("zb1p_2rank_2stagep_compute.csv");
  for (const std::string flag : {"--virtual 3", "--steps 2"}) {
    const auto r = run_pipetrain("simulate --load " + in + " --format torch " + flag);
    EXPECT_EQ(r.code, 2) << flag << "\n" << r.out;
    EXPECT_TRUE(r.has("the file gives it")) << flag << "\n" << r.out;
  }
  EXPECT_EQ(run_pipetrain("simulate --load " + in + " --format torch --virtual 2 --steps 1").code, 0);
}
