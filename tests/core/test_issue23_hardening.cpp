// Issue 23 ("nothing lost, nothing crashes, nothing lies"), the torch-free layers: output files whose
// write fails are reported, not "written" (and a device node is never replaced by a regular file);
// output paths are checked before work starts; profile numbers are bounded; a byte order mark opens any
// text input; the exact search's node budget has a maximum. Each test failed before its fix.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>
#include <sstream>

#include "error_of.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/core/torch_csv.h"
#include "pipetrain/core/zb_exact.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"

using namespace pipetrain;

namespace {
using pipetrain::testing::error_of;
std::string temp_dir() { return pipetrain::testing::temp_dir("pipetrain-issue23"); }

std::string profile_text(const std::string& forward_ms, const std::string& parameter_bytes, const std::string& backward_ms = "2") {
  return R"({"format": "pipetrain-profile", "version": 1, "model": "toy", "micro_batch_size": 4, "threads": 1,
    "layers": [{"name": "l0", "type": "Linear", "forward_ms": )" + forward_ms + R"(, "backward_ms": )" + backward_ms +
         R"(, "activation_bytes": 64, "parameter_bytes": )" + parameter_bytes + R"(, "optimizer_bytes": 0},
               {"name": "l1", "type": "Linear", "forward_ms": )" + forward_ms + R"(, "backward_ms": )" + backward_ms +
         R"(, "activation_bytes": 64, "parameter_bytes": 1000, "optimizer_bytes": 0}]})";
}
}  // namespace

// --- C: writes ---------------------------------------------------------------------------------------

TEST(WriteFileAtomicTargets, DevFullFailsWithTheSystemsReason) {
  // Was "written": the data went to /dev/full.tmp.PID, renamed over /dev/full (as root, replacing the
  // device node with a regular file).
  struct stat before {};
  ASSERT_EQ(::stat("/dev/full", &before), 0);
  ASSERT_TRUE(S_ISCHR(before.st_mode));
  const std::string e = error_of<std::runtime_error>([] { write_file_atomic("/dev/full", std::string(10000, 'x')); });
  EXPECT_NE(e.find("/dev/full"), std::string::npos) << e;
  EXPECT_NE(e.find("No space left on device"), std::string::npos) << e;
  struct stat after {};
  ASSERT_EQ(::stat("/dev/full", &after), 0);
  EXPECT_TRUE(S_ISCHR(after.st_mode)) << "/dev/full is no longer a character device";
  EXPECT_NE(::access(("/dev/full.tmp." + std::to_string(::getpid())).c_str(), F_OK), 0);
}

// A tester's finding (2026-11-28): the temporary file was PATH.tmp.PID, opened through links and
// reused: a symbolic link planted under that name in a shared folder made the write overwrite the file
// it led to. The name has a random part now, and the file is made exclusively, never through a link.
TEST(WriteFileAtomicTargets, ALinkPlantedAtTheTemporaryNameIsNotFollowed) {
  const std::string dir = temp_dir();
  const std::string victim = dir + "/victim.txt", target = dir + "/run.json";
  std::ofstream(victim) << "precious data";
  const std::string planted = target + ".tmp." + std::to_string(::getpid());
  ASSERT_EQ(::symlink(victim.c_str(), planted.c_str()), 0);
  write_file_atomic(target, "the trace");
  std::ifstream v(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(v), {}), "precious data");
  struct stat st {};
  ASSERT_EQ(::lstat(target.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the target became a link";
  std::ifstream t(target);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(t), {}), "the trace");
  // Only the three names: no temporary file left behind.
  int names = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++names;
  EXPECT_EQ(names, 3);
  std::filesystem::remove_all(dir);
}

TEST(WriteFileAtomicTargets, DevNullIsWrittenInPlace) {
  EXPECT_NO_THROW(write_file_atomic("/dev/null", "x"));
  struct stat st {};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST(WriteFileAtomicTargets, ProcSelfMemFailsClearly) {
  const std::string e = error_of<std::runtime_error>([] { write_file_atomic("/proc/self/mem", "x"); });
  EXPECT_NE(e.find("cannot write '/proc/self/mem'"), std::string::npos) << e;
}

TEST(CheckOutputPath, RefusesFoldersMissingFoldersAndUnwritablePaths) {
  const std::string d = temp_dir();
  const std::string root = error_of([] { check_output_path("/", "--trace"); });
  EXPECT_NE(root.find("--trace /"), std::string::npos) << root;
  EXPECT_NE(root.find("is a folder"), std::string::npos) << root;
  EXPECT_NE(root.find("give a file path"), std::string::npos) << root;
  const std::string missing = error_of([&] { check_output_path(d + "/no/such/t.json", "--svg"); });
  EXPECT_NE(missing.find("--svg"), std::string::npos) << missing;
  EXPECT_NE(missing.find("does not exist"), std::string::npos) << missing;
  EXPECT_NE(missing.find("mkdir -p " + d + "/no/such"), std::string::npos) << missing;
  std::ofstream(d + "/file") << "x";
  EXPECT_NE(error_of([&] { check_output_path(d + "/file/t.json", "--out"); }).find("is not a folder"), std::string::npos);
  EXPECT_NE(error_of([&] { check_output_path(d + "/new/", "--out"); }).find("give a file path"), std::string::npos);
  // Read-only file system: /proc refuses new files whoever asks.
  EXPECT_NE(error_of([] { check_output_path("/proc/pipetrain-out.json", "--out"); }).find("--out"), std::string::npos);
  // What can be written passes: a new file, an existing one, a device.
  EXPECT_NO_THROW(check_output_path(d + "/t.json", "--trace"));
  EXPECT_NO_THROW(check_output_path(d + "/file", "--trace"));
  EXPECT_NO_THROW(check_output_path("/dev/null", "--trace"));
  EXPECT_NO_THROW(check_output_path("", "--trace"));
}

// Every rank of a run checks its output flags at the same moment: with a probe of the target's own
// name, a rank whose create came second failed with "File exists" (seen as a failed --log in a 2-rank
// run). Many concurrent checks of one new path all pass and leave nothing.
TEST(CheckOutputPath, ConcurrentChecksOfOnePathAllPass) {
  const std::string d = temp_dir();
  const std::string path = d + "/log.jsonl";
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int k = 0; k < 100; ++k) {
        try {
          check_output_path(path, "--log");
        } catch (const std::exception&) {
          ++failures;
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_FALSE(std::ifstream(path).good());
  std::size_t left = 0;
  for (const auto& e : std::filesystem::directory_iterator(d)) left += e.path().filename().string().rfind("log.jsonl", 0) == 0;
  EXPECT_EQ(left, 0u);
}

// --- D: bad numbers ----------------------------------------------------------------------------------

TEST(ProfileBounds, HugeBytesAndTimesAreRefusedNamingTheFieldAndTheCap) {
  // parameter_bytes 2^63 was read, and the plan reported "18595431358.65x data parallelism".
  const std::string e = error_of([] { profile_from_json_text(profile_text("1", "9223372036854775808"), "p.json"); });
  EXPECT_NE(e.find("p.json"), std::string::npos) << e;
  EXPECT_NE(e.find("parameter_bytes"), std::string::npos) << e;
  EXPECT_NE(e.find("1125899906842624 bytes"), std::string::npos) << e;
  const std::string t = error_of([] { profile_from_json_text(profile_text("1e12", "1000"), "p.json"); });
  EXPECT_NE(t.find("forward_ms"), std::string::npos) << t;
  EXPECT_NE(t.find("1000000000 milliseconds"), std::string::npos) << t;
  EXPECT_NO_THROW(profile_from_json_text(profile_text("1e9", "1125899906842624"), "p.json"));
}

TEST(ProfileBounds, AllZeroCostProfileIsRefusedByThePlanner) {
  // Every candidate took 0 ms and the report printed "infx".
  const Profile p = profile_from_json_text(profile_text("0", "1000", "0"), "p.json");
  const std::string e = error_of([&] { search_plans(p, PlanSearchOptions{}); });
  EXPECT_NE(e.find("no compute time"), std::string::npos) << e;
  EXPECT_NE(e.find("pipetrain profile"), std::string::npos) << e;
}

TEST(ByteOrderMark, LeadingBomIsSkippedInEveryTextInput) {
  // Was "malformed action '\ufeff0F0'".
  const std::string bom = "\xEF\xBB\xBF";
  EXPECT_EQ(from_csv(bom + "0F0,0BW0\n").actions.at(0).size(), 2u);
  EXPECT_EQ(from_csv(bom + "# pipetrain schedule microbatches=1\n0F0,0BW0\n").actions.at(0).size(), 2u);
  EXPECT_EQ(from_torch_csv(bom + "0F0,0B0\n").schedule.ranks, 1);
  EXPECT_EQ(profile_from_json_text(bom + profile_text("1", "1000"), "p.json").layers.size(), 2u);
  const std::string d = temp_dir();
  std::ofstream(d + "/p.json", std::ios::binary) << bom + profile_text("1", "1000");
  EXPECT_EQ(load_profile(d + "/p.json").layers.size(), 2u);  // was read as a PipeDream graph
  // Only at the start: elsewhere it is still an error.
  EXPECT_NE(error_of([&] { from_csv("0F0," + bom + "0BW0\n"); }).find("malformed action"), std::string::npos);
}

TEST(ZbExact, NodeBudgetHasAMaximumNamedInTheError) {
  // --exact-nodes 99999999999999 searched for hours without a word.
  ZbExactOptions o;
  o.node_budget = 99999999999999LL;
  const std::string e = error_of([&] { zb_exact(2, 2, CostModel::uniform(2, StageCost{}), o); });
  EXPECT_NE(e.find("99999999999999"), std::string::npos) << e;
  EXPECT_NE(e.find(std::to_string(kZbExactMaxNodes)), std::string::npos) << e;
  EXPECT_NE(e.find("--exact-nodes"), std::string::npos) << e;
  o.node_budget = kZbExactMaxNodes;
  EXPECT_NO_THROW(zb_exact(2, 2, CostModel::uniform(2, StageCost{}), o));
}
