// Checks the process transports (gloo, mpi) of transport.h across real processes: the test binary
// starts itself as the ranks (launch_local for gloo, mpirun for mpi) with PIPETRAIN_TRANSPORT_CHILD naming
// a scenario, and TransportChild.Run plays it (it skips when run directly). Checked: float and int64
// messages both ways on several tags with per-tag order kept, non-contiguous and empty tensors;
// all_reduce_sum and barrier; a size (or, for gloo, dtype) mismatch fails the receive with both
// descriptions and later messages still arrive; a rank that calls abort() (and stays up), or is
// SIGKILLed mid-run (the store host, rank 0, or another; while the others idle or receive from it), or
// hangs (SIGSTOP: caught by the heartbeat) makes the others exit non-zero within 30 s with a message
// naming it. In-process: Rendezvous::from_environment()'s errors, make_process_transport's names, a
// one-rank gloo transport, and rank 0's error for a MASTER_PORT already in use.
#include "listening.h"
#include "pipetrain/runtime/transport.h"
#include "env_guard.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include "mpi_env.h"
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/launch.h"
#include "pipetrain/runtime/store.h"

namespace pipetrain {
namespace {

constexpr const char* kScenarioVar = "PIPETRAIN_TRANSPORT_CHILD";
constexpr const char* kKindVar = "PIPETRAIN_TRANSPORT_KIND";

// ---- the ranks' side ----------------------------------------------------------------------------

at::Tensor filled(at::ScalarType dtype, std::vector<int64_t> sizes, double value) {
  return at::full(sizes, value, at::TensorOptions().dtype(dtype));
}

// Each rank sends to the other, on tags 0, 1, 7 (float) and 2, 9 (int64), three messages per tag;
// receives are posted in another tag order than the sends. Values encode (sender, tag, index).
void scenario_exchange(Transport& t) {
  ASSERT_EQ(t.world_size(), 2);
  const int me = t.rank(), peer = 1 - me;
  struct Msg {
    int tag;
    at::ScalarType dtype;
    std::vector<int64_t> sizes;
  };
  const std::vector<Msg> plan = {{0, at::kFloat, {3, 5}}, {1, at::kFloat, {1000}}, {7, at::kFloat, {2, 2}},
                                 {2, at::kLong, {4}},     {9, at::kLong, {1, 3}}};
  auto value = [](int sender, int tag, int i) { return sender * 10000 + tag * 100 + i; };
  std::vector<std::unique_ptr<Work>> sends;
  std::vector<at::Tensor> sent;
  for (const auto& m : plan)
    for (int i = 0; i < 3; ++i) {
      sent.push_back(filled(m.dtype, m.sizes, value(me, m.tag, i)));
      sends.push_back(t.isend(sent.back(), peer, m.tag));
    }
  std::vector<std::pair<const Msg*, int>> order;
  for (auto it = plan.rbegin(); it != plan.rend(); ++it)
    for (int i = 0; i < 3; ++i) order.emplace_back(&*it, i);
  std::vector<at::Tensor> got;
  std::vector<std::unique_ptr<Work>> recvs;
  for (const auto& [m, i] : order) {
    got.push_back(at::zeros(m->sizes, at::TensorOptions().dtype(m->dtype)));
    recvs.push_back(t.irecv(got.back(), peer, m->tag));
  }
  for (auto& w : recvs) w->wait();
  for (auto& w : sends) w->wait();
  for (std::size_t k = 0; k < order.size(); ++k) {
    const auto& [m, i] = order[k];
    EXPECT_TRUE(at::equal(got[k], filled(m->dtype, m->sizes, value(peer, m->tag, i))))
        << "tag " << m->tag << " message " << i << " from rank " << peer << " arrived as " << got[k];
  }

  // A transposed (non-contiguous) tensor is sent as its values; a receive into a non-contiguous
  // tensor fills it; an empty tensor is a message too; 4 MiB goes through.
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor into = at::zeros({3, 4}, at::kFloat).t();
  at::Tensor empty = at::empty({0}, at::kFloat);
  at::Tensor big = at::arange(1 << 20, at::kFloat) + me;
  at::Tensor big_in = at::empty({1 << 20}, at::kFloat);
  auto s1 = t.isend(base.t(), peer, 20);
  auto s2 = t.isend(empty, peer, 21);
  auto s3 = t.isend(big, peer, 22);
  t.recv(into, peer, 20);
  at::Tensor empty_in = at::empty({0}, at::kFloat);
  t.recv(empty_in, peer, 21);
  t.recv(big_in, peer, 22);
  s1->wait();
  s2->wait();
  s3->wait();
  EXPECT_TRUE(at::equal(into, base.t()));
  EXPECT_TRUE(at::equal(big_in, at::arange(1 << 20, at::kFloat) + peer));
}

void scenario_allreduce(Transport& t) {
  const int n = t.world_size();
  const double total = n * (n + 1) / 2.0;  // sum of rank+1
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
    at::Tensor x = filled(dtype, {5, 3}, t.rank() + 1);
    t.all_reduce_sum(x);
    EXPECT_TRUE(at::equal(x, filled(dtype, {5, 3}, total))) << c10::toString(dtype) << ": " << x;
  }
  at::Tensor strided = at::ones({4, 6}, at::kFloat).t();  // non-contiguous: reduced in place all the same
  t.all_reduce_sum(strided);
  EXPECT_TRUE(at::equal(strided, at::full({6, 4}, static_cast<double>(n), at::kFloat)));
  t.barrier();
  // After the barrier point-to-point still works, in a ring.
  at::Tensor out = filled(at::kFloat, {2}, t.rank());
  at::Tensor in = at::empty({2}, at::kFloat);
  auto s = t.isend(out, (t.rank() + 1) % n, 5);
  t.recv(in, (t.rank() + n - 1) % n, 5);
  s->wait();
  EXPECT_TRUE(at::equal(in, filled(at::kFloat, {2}, (t.rank() + n - 1) % n)));
  t.barrier();
}

// Expects `w->wait()` to throw a runtime_error whose text holds every piece of `needles`.
void expect_wait_error(Work& w, const std::vector<std::string>& needles) {
  try {
    w.wait();
    ADD_FAILURE() << "wait() returned; expected an error mentioning " << needles.front();
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << "missing '" << n << "' in: " << what;
  }
}

void scenario_mismatch(Transport& t, bool check_dtype) {
  ASSERT_EQ(t.world_size(), 2);
  if (t.rank() == 0) {
    t.send(at::ones({100}, at::kFloat), 1, 3);  // 400 bytes where 200 are expected
    t.send(at::ones({10}, at::kFloat), 1, 3);   // 40 bytes where 80 are expected
    if (check_dtype) t.send(at::ones({4}, at::kInt), 1, 3);  // Int where Float is expected
    t.send(at::full({6}, 7.0, at::kFloat), 1, 3);            // then a good one
  } else {
    at::Tensor half = at::zeros({50}, at::kFloat);
    auto w1 = t.irecv(half, 0, 3);
    expect_wait_error(*w1, {"mismatch", "rank 0", "tag 3", "200 bytes"});
    at::Tensor twice = at::zeros({20}, at::kFloat);
    auto w2 = t.irecv(twice, 0, 3);
    expect_wait_error(*w2, {"mismatch", "rank 0", "40", "80 bytes"});
    if (check_dtype) {
      at::Tensor wrong = at::zeros({4}, at::kFloat);
      auto w3 = t.irecv(wrong, 0, 3);
      expect_wait_error(*w3, {"mismatch", "Int", "Float"});
    }
    at::Tensor good = at::zeros({6}, at::kFloat);
    t.recv(good, 0, 3);
    EXPECT_TRUE(at::equal(good, at::full({6}, 7.0, at::kFloat))) << good;
  }
  t.barrier();
}

// `victim` calls abort() and leaves; the other ranks wait for a message from it that never comes.
int scenario_abort(Transport& t, int victim) {
  at::Tensor x = at::ones({8}, at::kFloat);
  t.barrier();
  if (t.rank() == victim) {
    t.abort("injected failure on rank " + std::to_string(victim));
    // Stay alive with the connections open, so only the abort report can stop the others now.
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return 3;
  }
  t.recv(x, victim, 0);  // never sent: the transport (gloo) or mpirun (mpi) must end this process
  std::fprintf(stderr, "rank %d: recv from the failed rank returned\n", t.rank());
  return 0;
}

// `victim` gets `sig` (SIGKILL or SIGSTOP) after one exchange. With `idle`, the others then just sleep
// (only the transport's own threads can tell them); else they wait for a message from it.
int scenario_kill(Transport& t, int victim, bool idle, int sig = SIGKILL) {
  const int n = t.world_size();
  at::Tensor out = filled(at::kFloat, {4}, t.rank());
  at::Tensor in = at::empty({4}, at::kFloat);
  auto s = t.isend(out, (t.rank() + 1) % n, 1);
  t.recv(in, (t.rank() + n - 1) % n, 1);
  s->wait();
  if (t.rank() == victim) {
    // The tests time the ranks' reaction from this line (their start-up on a loaded machine is not theirs).
    std::fprintf(stderr, "rank %d: raising signal %d\n", t.rank(), sig);
    std::fflush(stderr);
    ::raise(sig);
  }
  try {
    if (idle) {
      std::this_thread::sleep_for(std::chrono::seconds(45));
    } else {
      t.recv(in, victim, 2);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: caught: %s\n", t.rank(), e.what());
    t.abort(e.what());
    return 1;
  }
  std::fprintf(stderr, "rank %d: still running 45 s after rank %d got signal %d\n", t.rank(), victim, sig);
  return 0;
}

// Plays the scenario; returns the exit code the rank should end with.
int play(const std::string& scenario, Transport& t) {
  if (scenario == "exchange") scenario_exchange(t);
  else if (scenario == "allreduce") scenario_allreduce(t);
  else if (scenario == "mismatch") scenario_mismatch(t, t.name() == "gloo");
  else if (scenario == "abort0") return scenario_abort(t, 0);
  else if (scenario == "abort1") return scenario_abort(t, 1);
  else if (scenario == "kill0-idle") return scenario_kill(t, 0, true);
  else if (scenario == "kill1-idle") return scenario_kill(t, 1, true);
  else if (scenario == "kill1-recv") return scenario_kill(t, 1, false);
  else if (scenario == "stop1-idle") return scenario_kill(t, 1, true, SIGSTOP);
  else ADD_FAILURE() << "unknown scenario " << scenario;
  return 0;
}

TEST(TransportChild, Run) {
  const char* scenario = std::getenv(kScenarioVar);
  if (!scenario) GTEST_SKIP() << "runs only as a rank started by the Transport.* tests";
  const char* kind = std::getenv(kKindVar);
  std::shared_ptr<Transport> t = kind && std::string(kind) == "mpi"
                                     ? make_mpi_transport()
                                     : make_gloo_transport(Rendezvous::from_environment());
  const int code = play(scenario, *t);
  if (::testing::Test::HasFailure()) {
    // The peers may be waiting for this rank: tell them, instead of meeting them at the final barrier.
    t->abort("a check failed on rank " + std::to_string(t->rank()) + " in scenario " + scenario);
  }
  const int rank = t->rank();
  t.reset();
  if (code == 0 && !::testing::Test::HasFailure())  // proof for the parent that the scenario really ran
    std::printf("rank %d finished scenario %s\n", rank, scenario);
  if (code != 0) {
    std::fflush(nullptr);
    std::_Exit(code);
  }
}

// ---- the test's side ----------------------------------------------------------------------------

using pipetrain::testing::self_exe;  // env_guard.h: drops gtest's sharding for the children

struct Outcome {
  int code = -1;
  std::string output;  // every line, tagged with who printed it
  std::vector<std::pair<double, std::string>> lines;  // (seconds since the start, line) as they came
  double seconds = 0;
  bool has(const std::string& text) const { return output.find(text) != std::string::npos; }
  // When the first line holding `text` came, in seconds since the start; -1 if none did.
  double time_of(const std::string& text) const {
    for (const auto& [t, line] : lines)
      if (line.find(text) != std::string::npos) return t;
    return -1;
  }
  // Seconds from the victim's "raising signal" line to the end of the run (-1 without that line): what the
  // kill tests bound, since the ranks' start-up (LibTorch loads, the rendezvous) takes seconds on a loaded
  // machine and is not what they check.
  double seconds_after_the_signal() const {
    const double t = time_of(": raising signal ");
    return t < 0 ? -1 : seconds - t;
  }
  bool before(const std::string& first, const std::string& second) const {
    const double a = time_of(first), b = time_of(second);
    return a >= 0 && b >= 0 && a <= b;
  }
  // Every rank printed that it played `scenario` to the end (a skipped child would exit 0 too).
  bool all_finished(const std::string& scenario, int nprocs) const {
    for (int r = 0; r < nprocs; ++r)
      if (!has("rank " + std::to_string(r) + " finished scenario " + scenario)) return false;
    return true;
  }
};

Outcome run_ranks(const std::vector<std::string>& argv, int nprocs,
                  std::vector<std::pair<std::string, std::string>> env,
                  std::chrono::milliseconds grace = std::chrono::seconds(40), bool launcher_store = true) {
  Outcome r;
  LaunchOptions o;
  o.grace = grace;
  o.host_store = launcher_store;
  o.timeout = std::chrono::seconds(90);  // a bug must fail the test, not hang it
  o.env = std::move(env);
  const auto begin = std::chrono::steady_clock::now();
  o.on_line = [&r, begin](int rank, int stream, const std::string& line) {
    const std::string who =
        rank < 0 ? std::string("[launch] ") : "[rank " + std::to_string(rank) + (stream == 2 ? " err] " : "] ");
    const std::string tagged = who + line;
    r.output += tagged + "\n";
    r.lines.emplace_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count(), tagged);
  };
  r.code = launch_local(nprocs, argv, o);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return r;
}

Outcome run_gloo(const std::string& scenario, int nprocs = 2, const char* heartbeat_timeout = "10",
                 std::chrono::milliseconds grace = std::chrono::seconds(40), bool launcher_store = true) {
  return run_ranks({self_exe(), "--gtest_filter=TransportChild.Run", "--gtest_brief=1", "--gtest_color=no"}, nprocs,
                   {{kScenarioVar, scenario}, {kKindVar, "gloo"}, {"PIPETRAIN_HEARTBEAT_TIMEOUT", heartbeat_timeout}},
                   grace, launcher_store);
}

std::optional<std::string> mpirun_path() {
  for (const char* dir : {"/usr/bin", "/usr/local/bin"}) {
    const std::string p = std::string(dir) + "/mpirun";
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return std::nullopt;
}

// mpirun as one launched process (it starts the ranks), with the flags Open MPI needs on one host as root
// (mpirun_local_flags).
Outcome run_mpi(const std::string& scenario, int nprocs = 2) {
  std::vector<std::pair<std::string, std::string>> env{{kScenarioVar, scenario}, {kKindVar, "mpi"}};
  pipetrain::testing::add_asan_mpi_env(env);
  std::vector<std::string> argv{*mpirun_path()};
  for (const std::string& f : pipetrain::testing::mpirun_local_flags(argv[0])) argv.push_back(f);
  argv.insert(argv.end(), {"-n", std::to_string(nprocs)});
  for (const auto& kv : env) argv.insert(argv.end(), {"-x", kv.first});
  argv.insert(argv.end(), {self_exe(), "--gtest_filter=TransportChild.Run", "--gtest_brief=1", "--gtest_color=no"});
  return run_ranks(argv, 1, env);
}

#define SKIP_WITHOUT_MPIRUN() \
  if (!mpirun_path()) GTEST_SKIP() << "mpirun not found (install openmpi-bin); the mpi transport is not tested"

// The gloo transport's tests; skipped in a build without it (cmake/PipetrainGloo.cmake).
class GlooTransport : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gloo_transport_available()) GTEST_SKIP() << gloo_transport_absent_reason();
  }
};

TEST_F(GlooTransport, ExchangesTensorsBothWaysInOrderPerTag) {
  const Outcome r = run_gloo("exchange");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(r.all_finished("exchange", 2)) << r.output;
}

TEST_F(GlooTransport, AllReduceSumAndBarrierOverThreeRanks) {
  const Outcome r = run_gloo("allreduce", 3);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(r.all_finished("allreduce", 3)) << r.output;
}

TEST_F(GlooTransport, SizeOrDtypeMismatchIsAnErrorAndLaterMessagesArrive) {
  const Outcome r = run_gloo("mismatch");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(r.all_finished("mismatch", 2)) << r.output;
}

TEST_F(GlooTransport, AbortOnRank1StopsRank0WithItsMessage) {
  const Outcome r = run_gloo("abort1");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 0: stopping: rank 1 failed: injected failure on rank 1")) << r.output;
  // Rank 1 stays up 3 s after abort(): rank 0 must stop on the report, not on the closed connection.
  EXPECT_GE(r.time_of("rank 0 exited with code 1"), 0) << r.output;
  EXPECT_LT(r.time_of("rank 0 exited with code 1"), r.time_of("rank 1 exited with code 3") - 2) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;  // it stopped by itself, not killed by the launcher
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST_F(GlooTransport, AbortOnRank0WhichHostsTheStoreStopsTheOthers) {
  const Outcome r = run_gloo("abort0", 3);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 1: stopping: rank 0 failed: injected failure on rank 0")) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 2: stopping: rank 0 failed: injected failure on rank 0")) << r.output;
  EXPECT_GE(r.time_of("rank 1 exited with code 1"), 0) << r.output;
  EXPECT_GE(r.time_of("rank 2 exited with code 1"), 0) << r.output;
  EXPECT_LT(r.time_of("rank 1 exited with code 1"), r.time_of("rank 0 exited with code 3") - 2) << r.output;
  EXPECT_LT(r.time_of("rank 2 exited with code 1"), r.time_of("rank 0 exited with code 3") - 2) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST_F(GlooTransport, KilledIdleRankIsNoticedAtOnce) {
  // 10 s heartbeat, and no launcher store (the ranks meet at MASTER_ADDR as under torchrun): the launcher
  // cannot report the kill first (it did on a loaded CI machine), so only the closed connection can.
  const Outcome r = run_gloo("kill1-idle", 2, "10", std::chrono::seconds(40), /*launcher_store=*/false);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(r.has("rank 1 was killed by signal 9")) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 0: stopping: rank 1 failed: it went away (killed or crashed?)")) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;
  EXPECT_GE(r.seconds_after_the_signal(), 0) << r.output;
  EXPECT_LT(r.seconds_after_the_signal(), 5) << r.output;  // not the 10 s heartbeat
  EXPECT_LT(r.seconds, 60) << r.output;
}

TEST_F(GlooTransport, KilledRankStopsTheRanksReceivingFromItAtOnce) {
  const Outcome r = run_gloo("kill1-recv", 3);
  EXPECT_EQ(r.code, 1) << r.output;
  // Whichever notices first names the cause: the receiver's closed connection ("it went away"), or, on a
  // loaded machine, the launcher that reaped the killed rank ("killed by signal 9 ... seen by pipetrain
  // launch"); either way every rank stops within seconds (KilledIdleRankIsNoticedAtOnce pins the first).
  for (int rank : {0, 2}) {
    const std::string stopping = "pipetrain rank " + std::to_string(rank) + ": stopping: rank 1 failed: ";
    EXPECT_TRUE(r.has(stopping + "it went away") || r.has(stopping + "it was killed by signal 9")) << r.output;
  }
  EXPECT_FALSE(r.has("caught:")) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;
  EXPECT_GE(r.seconds_after_the_signal(), 0) << r.output;
  EXPECT_LT(r.seconds_after_the_signal(), 5) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

TEST_F(GlooTransport, KilledRank0WhichHostsTheStoreStopsTheOthers) {
  const Outcome r = run_gloo("kill0-idle", 3);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 1: stopping: rank 0 failed: ")) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 2: stopping: rank 0 failed: ")) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;
  EXPECT_GE(r.seconds_after_the_signal(), 0) << r.output;
  EXPECT_LT(r.seconds_after_the_signal(), 5) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

TEST_F(GlooTransport, HungRankIsDetectedByItsMissingHeartbeat) {
  // Rank 1 stops itself (SIGSTOP): its connections stay open, only its heartbeat stops. The launcher
  // then kills it at once (a stopped process cannot stop by itself), not after the grace period.
  const Outcome r = run_gloo("stop1-idle", 2, "3", std::chrono::seconds(2));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 0: stopping: rank 1 failed: it stopped responding: no heartbeat for 3 s"))
      << r.output;
  EXPECT_TRUE(r.before("rank 0 exited with code 1", "rank 1 is stopped (SIGSTOP?) and cannot stop by itself after "
                                                   "rank 0 failed; killing it"))
      << r.output;
  EXPECT_FALSE(r.has("did not stop within")) << r.output;
  // The 3 s heartbeat, the watchdog's check period and the launcher's kill; not the 2 s grace on top.
  EXPECT_GE(r.seconds_after_the_signal(), 0) << r.output;
  EXPECT_LT(r.seconds_after_the_signal(), 12) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

TEST(MpiTransport, ExchangesTensorsBothWaysInOrderPerTag) {
  SKIP_WITHOUT_MPIRUN();
  const Outcome r = run_mpi("exchange");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(r.all_finished("exchange", 2)) << r.output;
}

TEST(MpiTransport, AllReduceSumAndBarrierOverThreeRanks) {
  SKIP_WITHOUT_MPIRUN();
  const Outcome r = run_mpi("allreduce", 3);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(r.all_finished("allreduce", 3)) << r.output;
}

TEST(MpiTransport, SizeMismatchIsAnErrorAndLaterMessagesArrive) {
  SKIP_WITHOUT_MPIRUN();
  const Outcome r = run_mpi("mismatch");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(r.all_finished("mismatch", 2)) << r.output;
}

TEST(MpiTransport, AbortPrintsTheMessageAndStopsEveryRank) {
  SKIP_WITHOUT_MPIRUN();
  const Outcome r = run_mpi("abort1");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(r.has("pipetrain rank 1: failed: injected failure on rank 1")) << r.output;
  EXPECT_FALSE(r.has("recv from the failed rank returned")) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST(MpiTransport, KilledRankStopsTheJob) {
  SKIP_WITHOUT_MPIRUN();
  const Outcome r = run_mpi("kill1-recv");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_FALSE(r.has("still running")) << r.output;
  EXPECT_FALSE(r.has("did not stop")) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

// ---- in-process ---------------------------------------------------------------------------------

using testing::EnvGuard;
using testing::unset;
using testing::usage_error_of;

std::map<std::string, std::optional<std::string>> env_of(std::optional<std::string> rank,
                                                         std::optional<std::string> size,
                                                         std::optional<std::string> addr = unset,
                                                         std::optional<std::string> port = unset) {
  return {{"RANK", rank},         {"WORLD_SIZE", size},           {"MASTER_ADDR", addr},
          {"MASTER_PORT", port},  {"OMPI_COMM_WORLD_RANK", unset}, {"OMPI_COMM_WORLD_SIZE", unset}};
}

TEST(Rendezvous, ReadsTheVariablesWithDefaults) {
  {
    EnvGuard env(env_of("1", "3"));
    const Rendezvous rv = Rendezvous::from_environment();
    EXPECT_EQ(rv.rank, 1);
    EXPECT_EQ(rv.world_size, 3);
    EXPECT_EQ(rv.master_addr, "127.0.0.1");
    EXPECT_EQ(rv.master_port, 29500);
  }
  EnvGuard env(env_of("0", "2", "10.1.2.3", "4242"));
  const Rendezvous rv = Rendezvous::from_environment();
  EXPECT_EQ(rv.master_addr, "10.1.2.3");
  EXPECT_EQ(rv.master_port, 4242);
}

TEST(Rendezvous, OpenMpiVariablesWinOverInheritedRank) {
  EnvGuard env({{"RANK", "0"},
                {"WORLD_SIZE", "1"},
                {"OMPI_COMM_WORLD_RANK", "2"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"MASTER_ADDR", unset},
                {"MASTER_PORT", unset}});
  const Rendezvous rv = Rendezvous::from_environment();
  EXPECT_EQ(rv.rank, 2);
  EXPECT_EQ(rv.world_size, 4);
}

TEST(Rendezvous, MissingRankNamesTheVariableAndTheLaunchers) {
  EnvGuard env(env_of(unset, "2"));
  const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
  EXPECT_NE(e.find("RANK is not set"), std::string::npos) << e;
  EXPECT_NE(e.find("pipetrain launch"), std::string::npos) << e;
}

TEST(Rendezvous, MissingWorldSize) {
  EnvGuard env(env_of("0", unset));
  const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
  EXPECT_NE(e.find("WORLD_SIZE is not set"), std::string::npos) << e;
  // RANK alone is most often another tool's leftover: the fix that works is to unset it.
  EXPECT_NE(e.find("RANK=0 is set in the environment"), std::string::npos) << e;
  EXPECT_NE(e.find("`unset RANK`"), std::string::npos) << e;
}

TEST(Rendezvous, RankThatIsNotANumber) {
  EnvGuard env(env_of("abc", "2"));
  const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
  EXPECT_NE(e.find("RANK=abc is not a rank number: set RANK to 0..1"), std::string::npos) << e;
}

TEST(Rendezvous, RankOutOfRange) {
  EnvGuard env(env_of("2", "2"));
  const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
  EXPECT_NE(e.find("RANK=2 is out of range for WORLD_SIZE=2: set RANK to 0..1"), std::string::npos) << e;
}

TEST(Rendezvous, WorldSizeZero) {
  EnvGuard env(env_of("0", "0"));
  const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
  EXPECT_NE(e.find("WORLD_SIZE=0 is not a process count"), std::string::npos) << e;
}

TEST(Rendezvous, BadPortAndEmptyAddress) {
  {
    EnvGuard env(env_of("0", "1", unset, "70000"));
    const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
    EXPECT_NE(e.find("MASTER_PORT=70000 is not a port number: set MASTER_PORT to 1..65535"), std::string::npos) << e;
  }
  {
    EnvGuard env(env_of("0", "1", unset, "12ab"));
    const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
    EXPECT_NE(e.find("MASTER_PORT=12ab"), std::string::npos) << e;
  }
  EnvGuard env(env_of("0", "1", "", unset));
  const std::string e = usage_error_of([] { Rendezvous::from_environment(); });
  EXPECT_NE(e.find("MASTER_ADDR is set but empty"), std::string::npos) << e;
}

TEST(ProcessTransport, UnknownAndLocalNamesAreUsageErrors) {
  const std::string unknown = usage_error_of([] { make_process_transport("tcp"); });
  EXPECT_NE(unknown.find("unknown transport 'tcp': use shm, gloo, mpi, nccl or auto"), std::string::npos) << unknown;
  const std::string local = usage_error_of([] { make_process_transport("local"); });
  EXPECT_NE(local.find("make_local_transports"), std::string::npos) << local;
}

TEST(ProcessTransport, GlooIsThereOrItsAbsenceNamesTheAlternatives) {
  if (gloo_transport_available()) {
    EXPECT_EQ(gloo_transport_absent_reason(), "");
    return;
  }
  const std::string e = usage_error_of([] { make_process_transport("gloo"); });
  EXPECT_NE(e.find("built without the gloo transport"), std::string::npos) << e;
  for (const char* alternative : {"shm", "mpi", "local"}) EXPECT_NE(e.find(alternative), std::string::npos) << e;
}

TEST(ProcessTransport, MpiWithoutMpirunSaysHowToStartIt) {
  EnvGuard env({{"OMPI_COMM_WORLD_SIZE", unset}, {"OMPI_COMM_WORLD_RANK", unset}});
  const std::string e = usage_error_of([] { make_mpi_transport(); });
  EXPECT_NE(e.find("mpirun"), std::string::npos) << e;
  EXPECT_NE(e.find("--transport gloo"), std::string::npos) << e;
}

TEST_F(GlooTransport, OneRankInProcess) {
  Rendezvous rv;
  rv.master_port = pick_free_port();
  auto t = make_gloo_transport(rv);
  EXPECT_EQ(t->name(), "gloo");
  EXPECT_EQ(t->rank(), 0);
  EXPECT_EQ(t->world_size(), 1);
  at::Tensor x = at::full({3}, 2.0, at::kFloat);
  t->all_reduce_sum(x);
  EXPECT_TRUE(at::equal(x, at::full({3}, 2.0, at::kFloat)));
  t->barrier();
  EXPECT_THROW(t->isend(x, 0, 0), std::invalid_argument);  // not a peer
  EXPECT_THROW(t->irecv(x, 1, 0), std::invalid_argument);
}

using pipetrain::testing::listening_addresses;

TEST_F(GlooTransport, Rank0HostsTheStoreOnMasterAddrOnly) {
  // LibTorch 1.13's TCPStore listened on every interface here (the IPv6 or IPv4 wildcard).
  EnvGuard env({{"PIPETRAIN_LAUNCHER_STORE", unset}, {"PIPETRAIN_STORE_BIND", unset}});
  Rendezvous rv;
  rv.master_addr = "127.0.0.1";
  rv.master_port = pick_free_port();
  auto t = make_gloo_transport(rv);
  EXPECT_EQ(listening_addresses(rv.master_port), "0100007F ");
}

TEST_F(GlooTransport, ARankWithAnotherRunsTokenIsRefusedBeforeGloo) {
  StoreServer other_run("127.0.0.1", 0, "token-of-run-a", 2);
  const std::string address = "127.0.0.1:" + std::to_string(other_run.port());
  EnvGuard env({{"PIPETRAIN_LAUNCHER_STORE", address}, {"PIPETRAIN_RUN_TOKEN", "token-of-run-b"}});
  Rendezvous rv;
  rv.rank = 1;
  rv.world_size = 2;
  try {
    make_gloo_transport(rv);
    ADD_FAILURE() << "a rank with another token joined";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1: " + address), std::string::npos) << what;
    EXPECT_NE(what.find("hosts another pipetrain run (its token differs): give this rank that run's "
                        "PIPETRAIN_RUN_TOKEN, or start this run on a free MASTER_PORT"),
              std::string::npos)
        << what;
  }
  EXPECT_FALSE(other_run.joined(1));
  EXPECT_FALSE(other_run.value(kAbortKey).has_value());  // the run is not disturbed
}

TEST_F(GlooTransport, Rank0ReportsAPortInUse) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  Rendezvous rv;
  rv.master_port = ntohs(addr.sin_port);
  try {
    make_gloo_transport(rv);
    ADD_FAILURE() << "rank 0 started a store on port " << rv.master_port << ", which is in use";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_PORT"), std::string::npos) << e.what();
  }
  ::close(fd);
}

}  // namespace
}  // namespace pipetrain

// Group views (make_group_transport) over four in-process ranks: two "pipelines" {0,1} and {2,3} and two
// "stages" {0,2} and {1,3}, as a 2 x 2 data + pipeline layout uses them. Ranks are renumbered in member
// order, point-to-point reaches the right rank, each group's all-reduce sums only its members.
TEST(GroupTransport, RenumbersAndReducesWithinTheGroup) {
  using namespace pipetrain;
  auto world = make_local_transports(4);
  std::vector<double> pipeline_sum(4), stage_sum(4);
  std::vector<int> pipeline_rank(4), stage_rank(4);
  std::vector<double> received(4, -1);
  run_on_threads(4, [&](int r) {
    auto pipeline = make_group_transport(world[r], r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
    auto stage = make_group_transport(world[r], r % 2 == 0 ? std::vector<int>{2, 0} : std::vector<int>{1, 3});
    pipeline_rank[r] = pipeline->rank();
    stage_rank[r] = stage->rank();
    torch::Tensor v = torch::full({2}, double(1 << r), torch::kDouble);
    pipeline->all_reduce_sum(v);
    pipeline_sum[r] = v[0].item<double>();
    torch::Tensor w = torch::full({1}, double(10 * (r + 1)), torch::kDouble);
    stage->all_reduce_sum(w);
    stage_sum[r] = w[0].item<double>();
    // Within a pipeline, group rank 0 sends its world rank to group rank 1.
    torch::Tensor msg = torch::zeros({1}, torch::kDouble);
    if (pipeline->rank() == 0) {
      msg[0] = r;
      pipeline->send(msg, 1, 5);
    } else {
      pipeline->recv(msg, 0, 5);
      received[r] = msg[0].item<double>();
    }
    stage->barrier();
  });
  EXPECT_EQ(pipeline_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(stage_rank, (std::vector<int>{1, 0, 0, 1}));  // members {2, 0}: world rank 2 is group rank 0
  EXPECT_EQ(pipeline_sum, (std::vector<double>{1 + 2, 1 + 2, 4 + 8, 4 + 8}));
  EXPECT_EQ(stage_sum, (std::vector<double>{10 + 30, 20 + 40, 10 + 30, 20 + 40}));
  EXPECT_EQ(received, (std::vector<double>{-1, 0, -1, 2}));
  EXPECT_THROW(make_group_transport(world[0], {1, 2}), UsageError);  // rank 0 is not a member
  EXPECT_THROW(make_group_transport(world[0], {0, 0}), UsageError);
}

// The group all-reduce (a reduce-scatter and an all-gather between the members) for 2, 3 and 4 members
// over in-process ranks: a world of n + 1 ranks whose last n form the group in reverse order (group rank
// 0 is the highest world rank; world rank 0 stays out). Float tensors whose length does not split evenly
// over the members (fewer elements than members included), a non-contiguous one, and doubles: every
// member ends with bitwise the same tensor, the sum in member order (member 0's + member 1's + ...), and
// that is the plain sum within float rounding.
TEST(GroupTransport, AllReduceGivesEveryMemberTheSameSum) {
  using namespace pipetrain;
  for (int n : {2, 3, 4}) {
    std::vector<int> members;
    for (int r = n; r >= 1; --r) members.push_back(r);
    for (int64_t numel : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
      for (bool transposed : {false, true}) {
        for (auto dtype : {torch::kFloat, torch::kDouble}) {
          if ((transposed || dtype == torch::kDouble) && numel != 1000) continue;
          SCOPED_TRACE("n=" + std::to_string(n) + " numel=" + std::to_string(numel) +
                       (transposed ? " transposed" : "") + (dtype == torch::kDouble ? " double" : " float"));
          torch::manual_seed(static_cast<uint64_t>(n * 1000003 + numel));
          std::vector<torch::Tensor> input(static_cast<std::size_t>(n + 1)), output(static_cast<std::size_t>(n + 1));
          for (auto& t : input)
            t = transposed ? torch::randn({numel / 40, 40}, dtype).t() : torch::randn({numel}, dtype) * 1000;
          auto world = make_local_transports(n + 1);
          run_on_threads(n + 1, [&](int r) {
            if (r == 0) return;  // not a member
            auto group = make_group_transport(world[static_cast<std::size_t>(r)], members);
            ASSERT_EQ(group->rank(), n - r);
            torch::Tensor t = input[static_cast<std::size_t>(r)].clone();
            group->all_reduce_sum(t);
            output[static_cast<std::size_t>(r)] = t;
            group->barrier();
          });
          torch::Tensor in_order = input[static_cast<std::size_t>(members[0])].clone();
          // The plain sum (long double would do no better here: doubles hold a sum of 4 floats exactly),
          // and the float rounding bound: n - 1 roundings, each at most half a unit in the last place of
          // a partial sum no larger than the sum of the magnitudes.
          torch::Tensor plain = input[static_cast<std::size_t>(members[0])].to(torch::kDouble);
          torch::Tensor magnitude = plain.abs();
          for (int j = 1; j < n; ++j) {
            const torch::Tensor& x = input[static_cast<std::size_t>(members[static_cast<std::size_t>(j)])];
            in_order.add_(x);
            plain.add_(x.to(torch::kDouble));
            magnitude.add_(x.to(torch::kDouble).abs());
          }
          const double unit = dtype == torch::kFloat ? std::ldexp(1.0, -24) : std::ldexp(1.0, -53);
          const torch::Tensor bound = magnitude * ((n - 1) * unit);
          for (int r = 1; r <= n; ++r) {
            const torch::Tensor& out = output[static_cast<std::size_t>(r)];
            ASSERT_TRUE(out.defined());
            EXPECT_EQ(out.sizes(), input[0].sizes());
            EXPECT_EQ(out.scalar_type(), dtype);
            EXPECT_TRUE(torch::equal(out, in_order)) << "world rank " << r;
            EXPECT_TRUE(torch::equal(out, output[1])) << "world rank " << r << " against world rank 1";
            EXPECT_TRUE((out.to(torch::kDouble) - plain).abs().le(bound).all().item<bool>()) << "world rank " << r;
          }
        }
      }
    }
  }
}
