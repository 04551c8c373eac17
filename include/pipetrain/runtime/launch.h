// Starts the ranks of a multi-process run on this machine, as `pipetrain launch -n P -- COMMAND...`
// and torchrun do: P children of COMMAND with the rendezvous environment (MASTER_ADDR=127.0.0.1, a free
// MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) that Rendezvous::from_environment() reads.
//
// The launcher hosts the ranks' rendezvous store itself (runtime/store.h; a thread bound to 127.0.0.1 on
// a port of its own, so MASTER_PORT stays free for programs that host their own): the children get
// PIPETRAIN_LAUNCHER_STORE=127.0.0.1:PORT and PIPETRAIN_RUN_TOKEN (a fresh secret from /dev/urandom that
// the store requires of every client), and PIPETRAIN_SHM_PREFIX, the name prefix of the shm transport's
// segment (the launcher removes any segment under it that a rank killed early left in /dev/shm). When a rank fails, the launcher posts that as the run's failure
// report in the store ("it was killed by signal 9 (SIGKILL) before it joined the rendezvous"), so the
// other ranks stop within a second at any phase, even one that died before it ever connected.
//
// The launcher owns its children: it forwards their output line by line ("[rank R] ..."), reaps every
// one (no zombies), and when one fails (non-zero exit or a signal) it says so, gives the others
// `grace` to stop by themselves (the gloo transport's ranks exit within a second of the report), then
// kills what is left. SIGINT, SIGTERM or SIGHUP sent to the launcher are passed on to the children, which
// are then killed after `grace` too, or at once on a second signal (Ctrl-C twice). Each child runs in
// its own process group with stdin from /dev/null; when a rank exits, whatever it started and left
// running in its group is killed, and a child is killed if the launcher itself dies
// (PR_SET_PDEATHSIG). So no process outlives the launch.
//
// Torch-free. Call from one thread at a time; it installs signal handlers for the duration of the call
// and restores the previous ones before returning.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace pipetrain {

// The most ranks one launch starts. Without a limit `launch -n 100000 -- true` ran for ~10 minutes on the
// 2-core test machine (1,000 ranks took 22 s); one host rarely has more than 256 cores to give ranks.
constexpr int kMaxLocalRanks = 256;

struct LaunchOptions {
  // Host the ranks' rendezvous store in the launcher (see above). Off: the ranks get no
  // PIPETRAIN_LAUNCHER_STORE or PIPETRAIN_RUN_TOKEN, and rank 0 hosts the store at MASTER_PORT.
  bool host_store = true;
  // Pin rank r to the r-th block of the CPUs this launcher may run on (sched_getaffinity): C CPUs give
  // each of P ranks C / P of them, in order, when C >= P, as mpirun binds ranks to cores: a rank's
  // memory and caches stay on its cores, and its intra-op threads have a core each when --threads is
  // at most C / P. Off (the default): the kernel places the ranks. Measured on a 2-core machine
  // (docs/BENCHMARKS.md, issue 15): shm ranks, which hand work to each other with futex wake-ups, are
  // faster unpinned (a pinned rank woken while its core runs other work waits for that core; an
  // unpinned one takes any idle core); gloo ranks were faster pinned. `train` and `selftest` pin the
  // ranks they start when --transport gloo is named.
  bool bind_cores = false;
  // Prefix each line the children print with "[rank R] " (stdout lines to stdout, stderr lines to
  // stderr). Off: the children write straight to the launcher's stdout/stderr, unbuffered by us.
  bool prefix_output = true;
  // After the first rank fails (or a signal arrives), how long the other ranks get to exit by
  // themselves before they are killed with SIGKILL. Default 30 s: the transports' failure bound.
  std::chrono::milliseconds grace = std::chrono::seconds(30);
  // Kill every rank once the whole run has taken this long; 0 (default) means no limit. For tests.
  std::chrono::milliseconds timeout{0};
  // MASTER_PORT for the ranks; 0 (default) picks a free port on 127.0.0.1.
  int master_port = 0;
  // Extra environment variables for every child, set after the rendezvous ones (so they may override).
  std::vector<std::pair<std::string, std::string>> env;
  // When set, receives every output line instead of stdout/stderr: the rank (-1 for the launcher's own
  // messages such as "rank 1 exited with code 3"), the stream (1 stdout, 2 stderr) and the line
  // without its newline. Called on the launching thread. Implies piping the children's output.
  std::function<void(int rank, int stream, const std::string& line)> on_line;
};

// Runs `argv` (argv[0] is looked up on PATH unless it contains '/') as `nprocs` ranks and waits for all
// of them. Returns 0 when every rank exited with code 0, else the first failing rank's code where it is 2
// (bad input) or above 128 (stopped by a signal), else 1 (after reporting each failure on stderr
// or to on_line). Throws UsageError when nprocs < 1 or > kMaxLocalRanks, argv is empty or argv[0] is not an
// executable, and
// std::runtime_error when the children cannot be started (then none is left running).
int launch_local(int nprocs, const std::vector<std::string>& argv, const LaunchOptions& options = {});

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
int pick_free_port();

}  // namespace pipetrain
