// Checks `pipetrain train` and `pipetrain selftest` across real processes: the transparency check over
// Gloo (and Open MPI when mpirun is installed) for p in {1, 2, 4}; a short training run whose loss
// falls; and failures — a rank that throws in forward, a rank killed with SIGKILL, ranks started
// with different models (refused before training), a world size other than the stage count — each of which must stop every rank
// with a message naming the failed rank within 30 s. Bad input exits 2 with the fix.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>

#include "../runtime/mpi_env.h"
#include "run_command.h"

namespace {

using Result = pipetrain::testing::CommandResult;

Result run(const std::string& cmd_line) { return pipetrain::testing::run_command(cmd_line); }

const std::string bin = PIPETRAIN_BIN;
// A small GPT keeps each run to a second or two.
const std::string small = " --data synthetic --d-model 32 --heads 2 --seq-len 16 --vocab 32 --layers 2 --batch-size 8";

}  // namespace

TEST(TrainCli, SelftestOverGlooForOneTwoFourStages) {
  SKIP_WITHOUT_GLOO();
  for (int p : {1, 2, 4}) {
    const Result r = run(bin + " selftest --stages " + std::to_string(p) + " --transport gloo");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(r.has("selftest over gloo:")) << r.out;
    EXPECT_TRUE(r.has(" 0 failed")) << r.out;
    EXPECT_FALSE(r.has("MISMATCH")) << r.out;
  }
  const Result gpt = run(bin + " selftest --stages 2 --model gpt");
  EXPECT_EQ(gpt.code, 0) << gpt.out;
}

TEST(TrainCli, SelftestOverMpi) {
  if (run("command -v mpirun").code != 0) GTEST_SKIP() << "mpirun not installed";
  std::string mpirun = "mpirun";
  for (const std::string& f : pipetrain::testing::mpirun_local_flags("mpirun")) mpirun += " " + f;
  const Result r = run(pipetrain::testing::asan_mpi_env() + mpirun + " -n 2 " + bin + " selftest --stages 2 --transport mpi");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("selftest over mpi:") && r.has(" 0 failed")) << r.out;
}

TEST(TrainCli, SelftestCanFail) {
  // Tolerance 0 demands bitwise equality, which GPipe cannot give: it adds the micro-batches' gradients in
  // the reverse order of plain accumulation (error ~1e-7). The check must report the mismatch and exit 1.
  // (A negative or nan tolerance is refused as bad input: SelftestCli.)
  const Result r = run(bin + " selftest --stages 2 --transport local --schedules gpipe --microbatch-counts 3 "
                       "--tolerance 0");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(r.has("MISMATCH")) << r.out;
}

TEST(TrainCli, TrainingOverGlooLowersTheLoss) {
  const Result r = run(bin + " train --stages 2 --schedule zb-h1 --microbatches 4 --steps 8 --lr 3e-3" + small);
  ASSERT_EQ(r.code, 0) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(summary: training loss ([0-9.]+) -> ([0-9.]+))"))) << r.out;
  EXPECT_LT(std::stod(m[2]), std::stod(m[1]) - 0.1) << r.out;
  EXPECT_TRUE(r.has("simulated from measured stage costs")) << r.out;
}

TEST(TrainCli, TrainingWithThreadsWritesTraceAndSvg) {
  const std::string dir = ::testing::TempDir();
  const Result r = run(bin + " train --transport local --stages 2 --schedule interleaved --virtual 2 --steps 2 --trace " +
                       dir + "/t.json --svg " + dir + "/t.svg" + small);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("measured trace written to")) << r.out;
  EXPECT_EQ(run("grep -c '<svg' " + dir + "/t.svg").out, "1\n");
}

TEST(TrainCli, RankThatThrowsStopsEveryRank) {
  const Result r = run("PIPETRAIN_FAULT=1:1F2:throw " + bin + " train --stages 2 --steps 2" + small);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
  EXPECT_TRUE(r.has("rank 0: stopping: rank 1 failed: rank 1 at 1F2: injected fault")) << r.out;
}

TEST(TrainCli, RankKilledWithSigkillStopsEveryRank) {
  const Result r = run("PIPETRAIN_FAULT=1:1F2:kill " + bin + " train --stages 2 --steps 2" + small);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
  EXPECT_TRUE(r.has("rank 1 was killed by signal 9")) << r.out;
  EXPECT_TRUE(r.has("rank 0: stopping: rank 1 failed")) << r.out;
}

TEST(TrainCli, RanksWithDifferentModelsAreRefusedBeforeTraining) {
  // Rank 1 would build a wider model than rank 0, so the activations it receives would not fit it (the
  // executor's shape check catches that for library users: test_executor's DriftingShape test). The
  // command compares the ranks' settings first and refuses the run before any transfer.
  const Result r = run(bin + " launch -n 2 -- sh -c 'exec " + bin + " train --stages 2 --steps 2 --d-model $((32 + 32 * RANK))" +
                       " --heads 2 --seq-len 16 --vocab 32 --layers 2 --batch-size 8 --data synthetic'");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
  EXPECT_TRUE(r.has("rank 1 was started with other settings than rank 0: --model and its flags differs")) << r.out;
  EXPECT_FALSE(r.has("step 1/")) << r.out;
  EXPECT_FALSE(r.has("frame #")) << "backtraces leak into the message:\n" << r.out;
}

// Ranks resuming different checkpoints (one at step 2, one at step 3) hung in mismatched collectives, and
// two checkpoints at the same step silently trained a mixture of their stages (--profile files alike
// ran different balances). What each rank reads counts by its content, and the settings that differ
// are named.
TEST(TrainCli, RanksReadingDifferentCheckpointsOrProfilesAreRefused) {
  const std::string dir = "/tmp/pipetrain-diffck-" + std::to_string(::getpid());
  const std::string mlp = " train --model mlp --data synthetic --hidden 16 --batch-size 8 --eval-every 0 --progress quiet"
                          " --stages 2 --transport shm";
  ASSERT_EQ(run("rm -rf " + dir + " && mkdir -p " + dir).code, 0);
  ASSERT_EQ(run(bin + mlp + " --steps 2 --save " + dir + "/ck0").code, 0);
  ASSERT_EQ(run(bin + mlp + " --steps 3 --save " + dir + "/ck1").code, 0);
  const std::string by_hand = " --stages 2 --transport shm --steps 5";
  Result r = run("timeout 60 " + bin + " launch -n 2 -- sh -c 'exec " + bin + mlp.substr(0, mlp.find(" --stages")) +
                 by_hand + " --resume " + dir + "/ck$RANK'");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
  EXPECT_TRUE(r.has("rank 1 was started with other settings than rank 0: --resume (its checkpoint) differs")) << r.out;
  // The same checkpoint copied for each rank is the same checkpoint.
  ASSERT_EQ(run("cp -r " + dir + "/ck0 " + dir + "/ck1b").code, 0);
  r = run("timeout 60 " + bin + " launch -n 2 -- sh -c 'exec " + bin + mlp.substr(0, mlp.find(" --stages")) + by_hand +
          " --resume " + dir + "/ck$([ $RANK = 0 ] && echo 0 || echo 1b)'");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run("rm -rf " + dir);
}

// --transport nccl where it cannot run, before any rank starts: a build without NCCL names the reason and
// the alternatives; a build with it refuses CPU ranks (the default --device cpu). Exit 2 either way, at once.
TEST(TrainCli, NcclWhereItCannotRunExitsTwoAtOnce) {
  for (const std::string stages : {" --stages 1", " --stages 2"}) {
    const Result r = run(bin + " train --transport nccl" + small + stages);
    EXPECT_EQ(r.code, 2) << r.out;
    const bool absent = r.has("this pipetrain was built against a LibTorch without NCCL (") &&
                        r.has("use --transport gloo|shm|mpi, or rebuild against a CUDA LibTorch");
    const bool cpu = r.has("--transport nccl moves CUDA tensors, but --device is cpu: use --device cuda");
    EXPECT_TRUE(absent || cpu) << r.out;
    EXPECT_LT(r.seconds, 30) << r.out;
    EXPECT_FALSE(r.has("step 1/")) << r.out;
  }
}

TEST(TrainCli, WorldSizeOtherThanStagesIsAUsageError) {
  const Result r = run(bin + " launch -n 3 -- " + bin + " train --stages 2" + small);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("the launcher started 3 ranks (its world size in the environment; if no launcher started this "
                    "process, unset RANK and WORLD_SIZE")) << r.out;
  EXPECT_TRUE(r.has("but --stages is 2: launch 2 ranks or pass --stages 3")) << r.out;
  EXPECT_TRUE(r.has("rank 0 exited with code 2")) << r.out;
  // With replicas, the stages suggested are those that fit the ranks started (3 stages x 2 replicas would
  // need 6, not the 3 started), and none where the replicas do not divide them.
  const Result odd = run(bin + " launch -n 3 -- " + bin + " train --stages 3 --replicas 2" + small);
  EXPECT_TRUE(odd.has("--stages is 3 x --replicas 2: launch 6 ranks")) << odd.out;
  EXPECT_FALSE(odd.has("or pass --stages")) << odd.out;
  const Result six = run(bin + " launch -n 6 -- " + bin + " train --stages 2 --replicas 2" + small);
  EXPECT_TRUE(six.has("--stages is 2 x --replicas 2: launch 4 ranks or pass --stages 3")) << six.out;
}

TEST(TrainCli, BadInputExitsTwo) {
  SKIP_WITHOUT_GLOO();
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--microbatches 9 --batch-size 8", "use --microbatches <= 8"},
           {"--microbatches 0", "micro-batches must be >= 1"},
           {"--stages 0", "stages must be >= 1"},
           {"--stages 9", "--stages 9 but the gpt has 4 pipeline layers"},
           {"--balance 3,3", "sums to 6 but the model has 4 layers"},
           {"--transport tcp", "unknown transport 'tcp': use local, shm, gloo, mpi, nccl or auto"},
           {"--schedule pipedream --microbatches 2", "use --microbatches 1"},
           {"--optimizer lion", "unknown optimizer"},
           {"--checkpoint sometimes", "use always, except_last or never"},
           {"--heads 3", "not divisible by --heads 3"},
           {"--batch-size 0", "--batch-size must be >= 1"},
           {"--device tpu", "--device tpu is not a device: use cpu, cuda or cuda:N"},
       }) {
    const Result r = run(bin + " train --transport local" + small + " " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(r.has(c.message)) << c.args << "\n" << r.out;
  }
  if (run(bin + " info").has("CUDA: none")) {  // without CUDA, asking for it is a usage error with the fix
    const Result r = run(bin + " train --transport local --device cuda" + small);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(r.has("this LibTorch has no CUDA device")) << r.out;
    // selftest says it once, before starting its ranks (it said it from rank 1, after starting them).
    const Result s = run(bin + " selftest --stages 2 --device cuda");
    EXPECT_EQ(s.code, 2) << s.out;
    EXPECT_TRUE(s.has("pipetrain selftest: error: --device cuda: this LibTorch has no CUDA device")) << s.out;
    EXPECT_FALSE(s.has("[rank")) << s.out;
  }
}
