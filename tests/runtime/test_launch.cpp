// Checks launch_local (launch.h) with small shell commands as ranks: the rendezvous environment each rank
// gets, "[rank R]" line routing, the exit code (0 only if every rank exited 0), the report of a rank
// that exits non-zero or is killed by a signal, the grace period after which the other ranks are killed
// (with what they started, leaving no process behind; a rank's leftovers go when it exits), SIGTERM to
// the launcher (once: passed on; twice: kill), the overall timeout, and the usage errors (no ranks, no
// command, no such command).
#include "pipetrain/runtime/launch.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "pipetrain/core/error.h"

namespace pipetrain {
namespace {

struct Line {
  int rank;
  int stream;
  std::string text;
};

struct Result {
  int code = -1;
  std::vector<Line> lines;
  double seconds = 0;
  std::string all() const {
    std::string s;
    for (const auto& l : lines)
      s += "[" + std::to_string(l.rank) + "/" + std::to_string(l.stream) + "] " + l.text + "\n";
    return s;
  }
  bool has(int rank, const std::string& text) const {
    for (const auto& l : lines)
      if (l.rank == rank && l.text.find(text) != std::string::npos) return true;
    return false;
  }
};

Result launch(int n, const std::vector<std::string>& argv, LaunchOptions o = {}) {
  Result r;
  if (!o.timeout.count()) o.timeout = std::chrono::seconds(60);
  o.on_line = [&r](int rank, int stream, const std::string& text) { r.lines.push_back({rank, stream, text}); };
  const auto begin = std::chrono::steady_clock::now();
  r.code = launch_local(n, argv, o);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return r;
}

// True while `pid` runs (a zombie waiting for its new parent to reap it does not count).
bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(") ");
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

TEST(Launch, EveryRankGetsTheRendezvousEnvironment) {
  LaunchOptions o;
  o.env = {{"EXTRA", "x"}};
  const std::string print = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $EXTRA";
  const Result r = launch(3, {"sh", "-c", print}, o);
  ASSERT_EQ(r.code, 0) << r.all();
  std::set<std::string> ports;
  for (int rank = 0; rank < 3; ++rank) {
    bool seen = false;
    for (const auto& l : r.lines) {
      if (l.rank != rank) continue;
      seen = true;
      EXPECT_EQ(l.stream, 1);
      const std::string expected = std::to_string(rank) + " 3 " + std::to_string(rank) + " 3 127.0.0.1 ";
      EXPECT_EQ(l.text.rfind(expected, 0), 0u) << l.text;
      EXPECT_EQ(l.text.substr(l.text.size() - 2), " x") << l.text;
      ports.insert(l.text.substr(expected.size(), l.text.size() - expected.size() - 2));
    }
    EXPECT_TRUE(seen) << "no line from rank " << rank << "\n" << r.all();
  }
  ASSERT_EQ(ports.size(), 1u) << r.all();  // one MASTER_PORT for all
  const int port = std::stoi(*ports.begin());
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
}

TEST(Launch, LinesKeepTheirStreamAndAPartialLastLineIsForwarded) {
  const Result r = launch(1, {"sh", "-c", "echo out; echo err >&2; printf tail"});
  ASSERT_EQ(r.code, 0) << r.all();
  EXPECT_TRUE(r.has(0, "out")) << r.all();
  bool err_on_2 = false, tail = false;
  for (const auto& l : r.lines) {
    if (l.text == "err") err_on_2 = l.stream == 2;
    if (l.text == "tail") tail = true;
  }
  EXPECT_TRUE(err_on_2) << r.all();
  EXPECT_TRUE(tail) << r.all();
}

TEST(Launch, ExitCodeOfOneRankFailsTheRunAndTheOthersAreKilledAfterTheGrace) {
  LaunchOptions o;
  o.grace = std::chrono::milliseconds(1500);
  // Rank 1 fails; ranks 0 and 2 would sleep for a minute (and start a grandchild that would too).
  const Result r = launch(3,
                          {"sh", "-c",
                           "if [ $RANK = 1 ]; then exit 3; fi; "
                           "sleep 60 & echo $! > /tmp/pipetrain-launch-test-$PPID-$RANK; exec sleep 60"},
                          o);
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 1 exited with code 3")) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 0 did not stop within 1.5 s after rank 1 failed; killing it")) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 2 did not stop within 1.5 s after rank 1 failed; killing it")) << r.all();
  EXPECT_GE(r.seconds, 1.4);
  EXPECT_LT(r.seconds, 10) << r.all();
  // The grandchildren went with their ranks' process groups.
  for (int rank : {0, 2}) {
    const std::string file = "/tmp/pipetrain-launch-test-" + std::to_string(::getpid()) + "-" + std::to_string(rank);
    std::ifstream in(file);
    pid_t pid = 0;
    ASSERT_TRUE(in >> pid) << file;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(process_alive(pid)) << "grandchild " << pid << " of rank " << rank << " survived";
    if (process_alive(pid)) ::kill(pid, SIGKILL);
    std::remove(file.c_str());
  }
}

TEST(Launch, RanksThatStopByThemselvesWithinTheGraceAreNotKilled) {
  LaunchOptions o;
  o.grace = std::chrono::seconds(20);
  const Result r = launch(2, {"sh", "-c", "if [ $RANK = 1 ]; then exit 5; fi; sleep 0.3; exit 1"}, o);
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 1 exited with code 5")) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 0 exited with code 1")) << r.all();
  EXPECT_FALSE(r.has(-1, "did not stop")) << r.all();
  EXPECT_LT(r.seconds, 10) << r.all();
}

TEST(Launch, WhatARankLeavesRunningIsKilledWhenItExits) {
  const std::string file = "/tmp/pipetrain-launch-left-" + std::to_string(::getpid());
  const Result r = launch(1, {"sh", "-c", "sleep 60 & echo $! > " + file + "; echo started"});
  EXPECT_EQ(r.code, 0) << r.all();
  EXPECT_LT(r.seconds, 1.5) << r.all();  // the sleep's copy of the output pipe did not hold the launcher
  std::ifstream in(file);
  pid_t pid = 0;
  ASSERT_TRUE(in >> pid) << file;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(process_alive(pid)) << "the rank's background process " << pid << " survived";
  if (process_alive(pid)) ::kill(pid, SIGKILL);
  std::remove(file.c_str());
}

TEST(Launch, AllZeroIsSuccess) {
  const Result r = launch(4, {"true"});
  EXPECT_EQ(r.code, 0) << r.all();
  EXPECT_TRUE(r.lines.empty()) << r.all();
}

TEST(Launch, RankKilledBySignalIsReported) {
  const Result r = launch(1, {"sh", "-c", "kill -KILL $$"});
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 0 was killed by signal 9 (SIGKILL)")) << r.all();
}

TEST(Launch, SigtermToTheLauncherStopsTheRanks) {
  LaunchOptions o;
  o.grace = std::chrono::seconds(5);
  // Rank 0 sends SIGTERM to the launcher (this test process), which passes it on to both ranks.
  const Result r = launch(2, {"sh", "-c", "if [ $RANK = 0 ]; then kill -TERM $PPID; fi; exec sleep 60"}, o);
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(-1, "got signal 15 (SIGTERM)")) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 0 was killed by signal 15")) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 1 was killed by signal 15")) << r.all();
  EXPECT_LT(r.seconds, 5) << r.all();
}

TEST(Launch, ASecondSignalKillsTheRanksAtOnce) {
  LaunchOptions o;
  o.grace = std::chrono::seconds(30);
  // Both ranks ignore SIGTERM; rank 0 sends the launcher two. Without the second the run would last 30 s.
  const Result r = launch(2, {"sh", "-c",
                              "trap '' TERM; if [ $RANK = 0 ]; then kill -TERM $PPID; sleep 1.5; kill -TERM $PPID; fi; "
                              "sleep 60"},
                          o);
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(-1, "got a second signal; killing the ranks")) << r.all();
  EXPECT_LT(r.seconds, 10) << r.all();
}

// `timeout` sends its SIGTERM to the launcher and then to the launcher's process group: two copies of one
// request microseconds apart. They are one signal: the ranks keep their grace period to stop by themselves
// (a rank saving its checkpoint on SIGTERM was killed half-way).
TEST(Launch, CopiesOfOneSignalKeepTheGracePeriod) {
  LaunchOptions o;
  o.grace = std::chrono::seconds(30);
  const Result r = launch(2, {"sh", "-c",
                              "trap 'sleep 1.5; echo stopped cleanly; exit 7' TERM; "
                              "if [ $RANK = 0 ]; then sleep 1; kill -TERM $PPID; kill -TERM $PPID; fi; "
                              "sleep 60 & wait"},
                          o);
  EXPECT_FALSE(r.has(-1, "got a second signal")) << r.all();
  EXPECT_TRUE(r.has(0, "stopped cleanly")) << r.all();
  EXPECT_TRUE(r.has(1, "stopped cleanly")) << r.all();
  EXPECT_LT(r.seconds, 20) << r.all();
}

TEST(Launch, TimeoutKillsEveryRank) {
  LaunchOptions o;
  o.timeout = std::chrono::milliseconds(500);
  const Result r = launch(2, {"sleep", "60"}, o);
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(-1, "longer than 0.5 s")) << r.all();
  EXPECT_LT(r.seconds, 5) << r.all();
}

TEST(Launch, ExecFailureIsReportedAsTheRanksExitCode) {
  const std::string script = "/tmp/pipetrain-launch-noexec-" + std::to_string(::getpid());
  {
    std::ofstream f(script);
    f << "#!/nonexistent/interpreter\n";
  }
  ::chmod(script.c_str(), 0755);
  const Result r = launch(1, {script});
  std::remove(script.c_str());
  EXPECT_EQ(r.code, 1) << r.all();
  EXPECT_TRUE(r.has(0, "cannot run")) << r.all();
  EXPECT_TRUE(r.has(-1, "rank 0 exited with code 127")) << r.all();
}

std::string usage_error(int n, const std::vector<std::string>& argv) {
  try {
    launch_local(n, argv);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no UsageError)";
}

TEST(Launch, UsageErrorsNameTheValueAndTheFix) {
  EXPECT_NE(usage_error(0, {"true"}).find("-n 0 is not a number of ranks: give -n P with P >= 1"), std::string::npos);
  EXPECT_NE(usage_error(2, {}).find("missing the command to run"), std::string::npos);
  EXPECT_NE(usage_error(kMaxLocalRanks + 1, {"true"}).find("-n 257 is more ranks than one host can serve: give -n P with P <= 256"),
            std::string::npos);
  EXPECT_NE(usage_error(2, {"no-such-command-pipetrain"}).find("command 'no-such-command-pipetrain' not found on PATH"),
            std::string::npos);
  EXPECT_NE(usage_error(2, {"/no/such/file"}).find("'/no/such/file' is not an executable file"), std::string::npos);
}

TEST(Launch, PickFreePortGivesABindablePort) {
  const int port = pick_free_port();
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
}

}  // namespace
}  // namespace pipetrain
