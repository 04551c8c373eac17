// What one hand-over between two processes costs on this machine (issue 15): the price of the shm
// transport's wake-ups, without LibTorch or the executor. Two processes share one word in shared memory
// and take turns: each waits for its turn, does --work-us of busy work (a stage's compute), and passes
// the turn on. A turn is waited for the way transport_shm.cpp waits: spin for a while, then sleep on a
// futex that the other side wakes only when it sleeps. For each placement of the two processes (one core
// each, both on one core, left to the scheduler) and each spin time it prints per hand-over:
//   handoff_us  wall time of a turn minus the work: how long the next process takes to start
//   cpu_us      CPU time both processes spent per turn beyond the work (thread CPU time): spinning and
//               the kernel's sleep and wake-up
//   sleeps      the share of turns whose waiter went to sleep
//
//   build/bench/bench_wake_handoff [--turns N (20000)] [--work-us W (30)] [--spins 0,20,200] [--quick]
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "futex.h"  // src/runtime: the shm transport's own waiting primitives

namespace {

struct Shared {
  alignas(64) std::atomic<uint32_t> turn{0};  // even: process 0's turn, odd: process 1's
  alignas(64) std::atomic<uint32_t> sleeping[2] = {{0}, {0}};
  alignas(64) std::atomic<uint32_t> ready{0};
  double cpu_us[2] = {0, 0};
  long sleeps[2] = {0, 0};
};

double now_us(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

void busy(double us) {
  const double start = now_us(CLOCK_MONOTONIC);
  while (now_us(CLOCK_MONOTONIC) - start < us) {
  }
}

using pipetrain::detail::cpu_relax;

// One process's side: `turns` turns of `work_us` each, waiting for the other's in between.
void play(Shared* s, int me, int turns, double work_us, double spin_us) {
  s->ready.fetch_add(1);
  while (s->ready.load() < 2) cpu_relax();
  const double c0 = now_us(CLOCK_THREAD_CPUTIME_ID);
  long sleeps = 0;
  for (int k = 0; k < turns; ++k) {
    const double w0 = now_us(CLOCK_MONOTONIC);
    for (;;) {
      const uint32_t t = s->turn.load(std::memory_order_acquire);
      if ((t & 1u) == static_cast<uint32_t>(me)) break;
      if (now_us(CLOCK_MONOTONIC) - w0 < spin_us) {
        cpu_relax();
        continue;
      }
      s->sleeping[me].store(1, std::memory_order_seq_cst);
      if (s->turn.load(std::memory_order_seq_cst) == t) {
        pipetrain::detail::futex_wait(&s->turn, t, std::chrono::milliseconds(200));
        ++sleeps;
      }
      s->sleeping[me].store(0, std::memory_order_relaxed);
    }
    busy(work_us);
    s->turn.fetch_add(1, std::memory_order_seq_cst);
    if (s->sleeping[1 - me].load(std::memory_order_seq_cst))
      pipetrain::detail::futex_wake(&s->turn);
  }
  s->cpu_us[me] = now_us(CLOCK_THREAD_CPUTIME_ID) - c0;
  s->sleeps[me] = sleeps;
}

bool pin(int cpu) {
  if (cpu < 0) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::sched_setaffinity(0, sizeof set, &set) == 0;
}

struct Result {
  double handoff_us = 0, cpu_us = 0, sleeps = 0;
};

// Plays `turns` turns per process with process 0 on `cpu0` and process 1 on `cpu1` (-1: not pinned).
bool measure(int cpu0, int cpu1, int turns, double work_us, double spin_us, Result& out) {
  void* mem = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return false;
  Shared* s = new (mem) Shared();
  const pid_t child = ::fork();
  if (child < 0) return false;
  if (child == 0) {
    if (!pin(cpu1)) ::_exit(1);
    play(s, 1, turns, work_us, spin_us);
    ::_exit(0);
  }
  cpu_set_t before;
  ::sched_getaffinity(0, sizeof before, &before);
  const bool pinned = pin(cpu0);
  const double t0 = now_us(CLOCK_MONOTONIC);
  if (pinned) play(s, 0, turns, work_us, spin_us);
  const double wall = now_us(CLOCK_MONOTONIC) - t0;
  int status = 0;
  if (!pinned) ::kill(child, SIGKILL);
  ::waitpid(child, &status, 0);
  ::sched_setaffinity(0, sizeof before, &before);
  const bool ok = pinned && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  const double handoffs = 2.0 * turns;
  out.handoff_us = wall / handoffs - work_us;
  out.cpu_us = (s->cpu_us[0] + s->cpu_us[1]) / handoffs - work_us;
  out.sleeps = static_cast<double>(s->sleeps[0] + s->sleeps[1]) / handoffs;
  ::munmap(mem, sizeof(Shared));
  return ok;
}

std::vector<double> parse_list(const std::string& text) {
  std::vector<double> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    out.push_back(std::atof(text.substr(start, comma == std::string::npos ? comma : comma - start).c_str()));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--turns N (20000)] [--work-us W (30)] [--spins 0,20,200] [--quick]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int turns = 20000;
  double work_us = 30;
  std::vector<double> spins = {0, 20, 200};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      turns = 200;
      continue;
    }
    if (i + 1 >= argc) return usage(argv[0]);
    const std::string v = argv[++i];
    if (a == "--turns") turns = std::atoi(v.c_str());
    else if (a == "--work-us") work_us = std::atof(v.c_str());
    else if (a == "--spins") spins = parse_list(v);
    else return usage(argv[0]);
  }
  if (turns < 1 || work_us < 0) return usage(argv[0]);
  cpu_set_t allowed;
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  struct Placement {
    const char* name;
    int cpu0, cpu1;
  };
  std::vector<Placement> placements;
  if (cpus.size() >= 2) placements.push_back({"two-cores", cpus[0], cpus[1]});
  if (!cpus.empty()) placements.push_back({"one-core", cpus[0], cpus[0]});
  placements.push_back({"unpinned", -1, -1});
  std::printf("%-10s %8s %8s %11s %8s %7s\n", "placement", "spin_us", "work_us", "handoff_us", "cpu_us", "sleeps");
  for (const Placement& p : placements)
    for (double spin : spins) {
      Result r;
      if (!measure(p.cpu0, p.cpu1, turns, work_us, spin, r)) {
        std::fprintf(stderr, "bench_wake_handoff: the run %s, spin %g us failed\n", p.name, spin);
        return 1;
      }
      std::printf("%-10s %8.0f %8.0f %11.1f %8.1f %7.2f\n", p.name, spin, work_us, r.handoff_us, r.cpu_us, r.sleeps);
      std::fflush(stdout);
    }
  return 0;
}
