// Checks the rendezvous of multi-process runs as a user meets it (runtime/store.h, transport.h):
// - a rank of `pipetrain train` (which starts its own ranks) that dies at any phase — before it joined
//   the rendezvous, after joining but before Gloo connected, at its first transfer, mid-training — ends
//   the whole run non-zero within 5 s of its death, with a message naming the lost rank (it took the
//   launcher's 30 s grace before: rank 0's store waited for the missing rank);
// - a stray rank pointed at another run's MASTER_PORT with another PIPETRAIN_RUN_TOKEN is refused with
//   "... hosts another pipetrain run (its token differs)", and that run trains undisturbed;
// - torchrun (Debian's python3-torch) starts `pipetrain train` with --no_python: the ranks join the
//   agent's store instead of hosting one on its port.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "run_command.h"

namespace {

using pipetrain::testing::CommandResult;
using pipetrain::testing::run_command;

const std::string bin = PIPETRAIN_BIN;
const std::string mlp = " train --model mlp --data synthetic --stages 2";

// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Output lines with the second (since the start) each was read at.
struct TimedResult {
  int code = -1;
  double seconds = 0;
  std::vector<std::pair<double, std::string>> lines;
  std::string out;
  bool has(const std::string& t) const { return out.find(t) != std::string::npos; }
  double time_of(const std::string& t) const {
    for (const auto& [s, line] : lines)
      if (line.find(t) != std::string::npos) return s;
    return -1;
  }
};

TimedResult run_timed(const std::string& shell) {
  TimedResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* pipe = popen((shell + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buf[8192];
  while (std::fgets(buf, sizeof buf, pipe)) {
    const double at = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.lines.emplace_back(at, buf);
    r.out += buf;
  }
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// Runs the 2-stage mlp for 50 steps with `env` (a fault) and checks that it fails, names rank `lost` as
// the failed one, and ends within 5 s of the launcher seeing the rank die.
void expect_prompt_failure(const std::string& env, int lost, const std::string& lost_line) {
  const TimedResult r = run_timed("env " + env + " timeout 120 " + bin + mlp + " --steps 50");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "timed out\n" << r.out;
  const double died = r.time_of(lost_line);
  ASSERT_GE(died, 0) << "no '" << lost_line << "'\n" << r.out;
  EXPECT_LT(r.seconds - died, 5.0) << "the run ended " << r.seconds - died << " s after rank " << lost << " died\n"
                                   << r.out;
  EXPECT_TRUE(r.has("rank " + std::to_string(lost) + " failed")) << r.out;
  EXPECT_FALSE(r.has("did not stop within")) << r.out;  // nobody needed the launcher's kill
}

TEST(CliRendezvous, RankKilledBeforeJoiningEndsTheRunWithin5s) {
  SKIP_WITHOUT_GLOO();
  expect_prompt_failure("PIPETRAIN_RENDEZVOUS_FAULT=1:before-join:1", 1, "rank 1 was killed by signal 9");
}

TEST(CliRendezvous, RankKilledAfterJoiningBeforeGlooConnectsEndsTheRunWithin5s) {
  SKIP_WITHOUT_GLOO();
  expect_prompt_failure("PIPETRAIN_RENDEZVOUS_FAULT=1:after-join:1", 1, "rank 1 was killed by signal 9");
}

TEST(CliRendezvous, Rank0KilledDuringTheRendezvousEndsTheRunWithin5s) {
  SKIP_WITHOUT_GLOO();
  expect_prompt_failure("PIPETRAIN_RENDEZVOUS_FAULT=0:after-join:1", 0, "rank 0 was killed by signal 9");
}

TEST(CliRendezvous, RankKilledAtItsFirstTransferEndsTheRunWithin5s) {
  SKIP_WITHOUT_GLOO();
  expect_prompt_failure("PIPETRAIN_FAULT=1:1RF0:kill", 1, "rank 1 was killed by signal 9");
}

TEST(CliRendezvous, RankKilledMidTrainingEndsTheRunWithin5s) {
  SKIP_WITHOUT_GLOO();
  expect_prompt_failure("PIPETRAIN_FAULT=1:1F0:kill:20", 1, "rank 1 was killed by signal 9");
  expect_prompt_failure("PIPETRAIN_FAULT=0:0F0:kill:20", 0, "rank 0 was killed by signal 9");
}

TEST(CliRendezvous, StrayRankWithAnotherTokenIsRefusedAndTheRunIsUndisturbed) {
  SKIP_WITHOUT_GLOO();
  const auto dir = pipetrain::testing::fresh_temp_dir("rendezvous", "stray");
  const int port = free_port();
  const std::string common = "-u PIPETRAIN_LAUNCHER_STORE -u PIPETRAIN_SHM_PREFIX MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " WORLD_SIZE=2 PIPETRAIN_RENDEZVOUS_TIMEOUT=20 ";
  const std::string train = " timeout 60 " + bin + mlp + " --steps 5";
  const std::string d = dir.string();
  // Rank 0 of run A; then a stray rank 1 with run B's token (it must be refused, not join run A); then
  // run A's own rank 1. (Every rank gets --log: the ranks of one run must be given the same flags.)
  const std::string script = "env " + common + "RANK=0 PIPETRAIN_RUN_TOKEN=run-a" + train + " --log " + d +
                             "/log0.jsonl > " + d + "/rank0.txt 2>&1 & "
                             "env " + common + "RANK=1 PIPETRAIN_RUN_TOKEN=run-b" + train + " --log " + d + "/log-stray.jsonl > " + d +
                             "/stray.txt 2>&1; echo $? > " + d + "/stray.code; "
                             "env " + common + "RANK=1 PIPETRAIN_RUN_TOKEN=run-a" + train + " --log " + d +
                             "/log1.jsonl > " + d +
                             "/rank1.txt 2>&1; echo $? > " + d + "/rank1.code; "
                             "wait $!; echo $? > " + d + "/rank0.code";
  const CommandResult r = run_command(script);
  auto slurp = [&](const std::string& name) {
    std::ifstream in(dir / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string stray = slurp("stray.txt");
  EXPECT_EQ(slurp("stray.code"), "1\n") << stray;
  EXPECT_NE(stray.find("127.0.0.1:" + std::to_string(port) +
                       " (MASTER_ADDR:MASTER_PORT) hosts another pipetrain run (its token differs)"),
            std::string::npos)
      << stray;
  EXPECT_EQ(stray.find("gloo"), std::string::npos) << stray;  // refused before Gloo
  EXPECT_EQ(slurp("rank0.code"), "0\n") << slurp("rank0.txt");
  EXPECT_EQ(slurp("rank1.code"), "0\n") << slurp("rank1.txt");
  EXPECT_EQ(pipetrain::testing::log_losses(dir / "log0.jsonl").size(), 5u) << slurp("rank0.txt");
  // Ranks started by hand (no pipetrain launcher, so no shm segment prefix) meet over gloo under auto.
  EXPECT_NE(slurp("rank0.txt").find("2 stages over gloo"), std::string::npos) << slurp("rank0.txt");
  std::filesystem::remove_all(dir);
}

// torchrun's two ways: --standalone (a c10d rendezvous on port 29400; the workers get a free MASTER_PORT
// that nobody listens on, TORCHELASTIC_USE_AGENT_STORE=False, so rank 0 hosts pipetrain's store there),
// and the default static rendezvous (the agent hosts a TCPStore on MASTER_PORT and says
// TORCHELASTIC_USE_AGENT_STORE=True: the ranks must join it, not host another on its port).
void expect_torchrun_trains(const std::string& how, const std::string& name) {
  if (run_command("command -v torchrun").code != 0)
    GTEST_SKIP() << "torchrun not found (Debian: apt install python3-torch); the torchrun path is not tested";
  const auto dir = pipetrain::testing::fresh_temp_dir("rendezvous", name);
  // -r 1 -t 1 (stdout to a log file, teed to the console): without a redirect Debian's torchrun 1.13.1
  // stops with "AttributeError: 'NoneType' object has no attribute 'get'".
  const CommandResult r = run_command("cd " + dir.string() + " && timeout 120 torchrun " + how +
                                      " --nproc_per_node 2 --no_python -r 1 -t 1 --log_dir " + dir.string() +
                                      "/logs " + bin + mlp + " --steps 3 --log " + dir.string() + "/log.jsonl");
  // Debian 13's torchrun (2.6) cannot start its own store: its TCPStore asks for libuv by default, and the
  // package is built without it (USE_LIBUV=0 does not reach that store). Nothing of pipetrain ran.
  if (r.code != 0 && r.has("use_libuv was requested but PyTorch was build without libuv support"))
    GTEST_SKIP() << "this torchrun cannot start its TCPStore (built without libuv); the torchrun path is not tested";
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(r.has("Address already in use")) << r.out;
  EXPECT_EQ(pipetrain::testing::log_losses(dir / "log.jsonl").size(), 3u) << r.out;
  EXPECT_TRUE(r.has("loss")) << r.out;
  std::filesystem::remove_all(dir);
}

TEST(CliRendezvous, TorchrunStandaloneStartsTrainWithNoPython) { SKIP_WITHOUT_GLOO(); expect_torchrun_trains("--standalone", "standalone"); }

TEST(CliRendezvous, TorchrunWithItsAgentStoreStartsTrainWithNoPython) {
  SKIP_WITHOUT_GLOO();
  expect_torchrun_trains("--master_addr 127.0.0.1 --master_port " + std::to_string(free_port()), "static");
}

}  // namespace

// Ranks started by hand with different flags (here --log on rank 0 only, which adds collectives to
// every step) waited for each other in different collectives forever. Now the first collective compares
// the ranks' settings and both stop non-zero (2, or 1 when the other's report reaches it first), naming
// the rank. (Different output file names are fine: the stray-rank and two-host tests use them.)
TEST(CliRendezvous, RanksStartedWithDifferentArgumentsAreRefusedNotHung) {
  SKIP_WITHOUT_GLOO();
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) + " WORLD_SIZE=2 ";
  const std::string log = (std::filesystem::temp_directory_path() /
                           ("pipetrain-diffargs-" + std::to_string(::getpid()) + ".jsonl")).string();
  const std::string cmd = "timeout 60 sh -c '" + env + "RANK=0 " + bin + mlp + " --steps 3 --log " + log +
                          " & a=$!; " + env + "RANK=1 " + bin + mlp + " --steps 3; b=$?; wait $a; a=$?; echo codes $a $b'";
  const CommandResult r = run_command(cmd);
  std::smatch codes;
  ASSERT_TRUE(std::regex_search(r.out, codes, std::regex("codes ([0-9]+) ([0-9]+)"))) << r.out;
  EXPECT_NE(codes[1], "0") << r.out;
  EXPECT_NE(codes[2], "0") << r.out;
  EXPECT_TRUE(r.has("rank 1 was started with other settings than rank 0: --log (given) differs")) << r.out;
  EXPECT_LT(r.seconds, 30.0) << r.out;
  std::filesystem::remove(log);
}

// A rank whose peers never come waited in Gloo's connect for Gloo's own 30-minute timeout (the store
// waits took Gloo's timeout, not PIPETRAIN_RENDEZVOUS_TIMEOUT). Now it stops after the rendezvous
// timeout, naming what it waited for.
TEST(CliRendezvous, ALoneRankStopsAfterTheRendezvousTimeout) {
  SKIP_WITHOUT_GLOO();
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " RANK=0 WORLD_SIZE=2 PIPETRAIN_RENDEZVOUS_TIMEOUT=2 ";
  const CommandResult r = run_command("timeout 120 env " + env + bin + mlp + " --steps 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "still waiting after 120 s: " << r.out;
  EXPECT_LT(r.seconds, 30.0) << r.out;
  EXPECT_TRUE(r.has("timed out after 2 s")) << r.out;
}

// A hand-started shm rank 0 whose peer never came, interrupted (Ctrl-C) while it waits: it made its
// /dev/shm segment as soon as it joined the store, and the signal left it there for good (8 MiB for 2
// ranks). The segment is made once every rank has joined now, so nothing is left.
TEST(CliRendezvous, AnInterruptedLoneShmRankLeavesNothingInDevShm) {
  const std::string prefix = "pipetrain-lone-" + std::to_string(::getpid());
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " RANK=0 WORLD_SIZE=2 PIPETRAIN_SHM_PREFIX=" + prefix + " ";
  const CommandResult r = run_command("timeout -s INT 8 env " + env + bin + mlp + " --transport shm --steps 1");
  EXPECT_EQ(r.code, 124) << "the lone rank did not wait for its peer: " << r.out;
  int left = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind(prefix, 0) == 0) {
      ++left;
      std::filesystem::remove(e.path());
    }
  EXPECT_EQ(left, 0) << "segments named " << prefix << "* left in /dev/shm";
}

// A tester's finding (2026-11-28): a gloo rank whose store host (rank 0) was stopped during the rendezvous
// was told to set GLOO_SOCKET_IFNAME, on one host where the network was fine. It names the host now.
TEST(CliRendezvous, ALostStoreHostIsNotBlamedOnTheNetwork) {
  SKIP_WITHOUT_GLOO();
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) + " WORLD_SIZE=3 ";
  const std::string train = bin + " train --model mlp --data synthetic --stages 3 --transport gloo --steps 3";
  const CommandResult r = run_command("sh -c '" + env + "RANK=0 timeout -s INT 8 " + train +
                                      " > /dev/null 2>&1 & sleep 1; " + env + "RANK=1 timeout 60 " + train +
                                      "; echo rank1 $?; wait'");
  EXPECT_TRUE(r.has("lost the rendezvous store")) << r.out;
  // Seen while Gloo connects (this change's message) or by the failure board's watchdog first (its own):
  // either names the store's host, neither the network.
  EXPECT_TRUE(r.has("stopped or died") || r.has("(its host died?)")) << r.out;
  EXPECT_FALSE(r.has("GLOO_SOCKET_IFNAME")) << r.out;
  EXPECT_FALSE(r.has("rank1 124")) << r.out;
}

// A tester's finding (2026-11-28): PIPETRAIN_STORE_BIND on an address MASTER_ADDR does not reach made
// rank 0 wait the whole rendezvous timeout for its own store. It stops at once now, saying why.
TEST(CliRendezvous, AStoreBoundWhereMasterAddrDoesNotLeadIsRefusedAtOnce) {
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " PIPETRAIN_STORE_BIND=127.0.0.2 RANK=0 WORLD_SIZE=2 ";
  const CommandResult r = run_command("timeout 120 env " + env + bin + mlp + " --transport shm --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(r.has("MASTER_ADDR=127.0.0.1 does not reach it (connection refused)")) << r.out;
  EXPECT_LT(r.seconds, 30.0) << r.out;
}

// issue 23: without a token, a second run's rank 1 joined another run's store as a duplicate rank 1 and
// killed that run with a misleading Gloo message. The store refuses a second process claiming a rank
// that has joined, and the first run trains on undisturbed.
TEST(CliRendezvous, SecondProcessClaimingAJoinedRankIsRefused) {
  SKIP_WITHOUT_GLOO();  // ranks started by hand meet over gloo
  const auto dir = pipetrain::testing::fresh_temp_dir("rendezvous", "duplicate");
  const std::string d = dir.string();
  const std::string common = "env -u PIPETRAIN_LAUNCHER_STORE -u PIPETRAIN_SHM_PREFIX -u PIPETRAIN_RUN_TOKEN "
                             "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                             " WORLD_SIZE=2 PIPETRAIN_RENDEZVOUS_TIMEOUT=20 ";
  const std::string train = " timeout 90 " + bin + mlp + " --steps 1500 --progress quiet --log ";
  const std::string script =
      common + "RANK=0" + train + d + "/log0.jsonl > " + d + "/rank0.txt 2>&1 & p0=$!; " +
      common + "RANK=1" + train + d + "/log1.jsonl > " + d + "/rank1.txt 2>&1 & p1=$!; "
      "for i in $(seq 300); do [ -s " + d + "/log0.jsonl ] && break; sleep 0.1; done; " +
      common + "RANK=1" + train + d + "/logdup.jsonl > " + d + "/dup.txt 2>&1; echo $? > " + d + "/dup.code; "
      "wait $p0; echo $? > " + d + "/rank0.code; wait $p1; echo $? > " + d + "/rank1.code";
  run_command(script);
  auto slurp = [&](const std::string& name) {
    std::ifstream in(dir / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string dup = slurp("dup.txt");
  EXPECT_EQ(slurp("dup.code"), "1\n") << dup;
  EXPECT_NE(dup.find("whose rank 1 has already joined from another process"), std::string::npos) << dup;
  EXPECT_EQ(slurp("rank0.code"), "0\n") << slurp("rank0.txt");
  EXPECT_EQ(slurp("rank1.code"), "0\n") << slurp("rank1.txt");
  EXPECT_EQ(pipetrain::testing::log_losses(dir / "log0.jsonl").size(), 1500u) << slurp("rank0.txt");
  std::filesystem::remove_all(dir);
}

// issue 23: a rank whose peer never joined (it died first), or that found a silent listener on
// MASTER_PORT, said nothing for minutes. A long wait now says every 10 s what it waits for.
TEST(CliRendezvous, ALongWaitSaysWhatItWaitsFor) {
  SKIP_WITHOUT_GLOO();  // ranks started by hand meet over gloo
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " RANK=0 WORLD_SIZE=2 PIPETRAIN_RENDEZVOUS_TIMEOUT=12 ";
  CommandResult r = run_command("timeout 120 env " + env + bin + mlp + " --steps 1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("pipetrain: still waiting after 10 s (at most 12 s)")) << r.out;
  EXPECT_TRUE(r.has("has every rank started")) << r.out;
  // A listener that accepts and never answers.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string silent = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(ntohs(a.sin_port)) +
                             " RANK=1 WORLD_SIZE=2 PIPETRAIN_RENDEZVOUS_TIMEOUT=12 ";
  const auto started = std::chrono::steady_clock::now();
  r = run_command("timeout 120 env " + silent + bin + mlp + " --steps 1");
  const auto waited = std::chrono::steady_clock::now() - started;
  ::close(fd);
  // The answer's limit is 30 s here (three of the store's hello rounds); it was waited twice (61 s).
  EXPECT_LT(waited, std::chrono::seconds(50)) << r.out;
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(r.has("to answer as a pipetrain rendezvous store: another program may listen there")) << r.out;
}
