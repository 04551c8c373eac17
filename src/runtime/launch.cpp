// launch_local: fork/exec of the ranks, one poll loop that forwards their output and reaps them.
//
// Life of a failed run, e.g. `pipetrain launch -n 3 -- ./train` where rank 1 throws:
//   t=0      rank 1 exits 1            -> "rank 1 exited with code 1", grace deadline = t + grace
//   t~0.2 s  ranks 0, 2 see rank 1's abort in the rendezvous store, exit 1 -> reported, reaped
//   (had one of them hung: at the deadline it is SIGKILLed with its whole process group)
// The loop ends when every child is reaped and their pipes are drained (a grandchild that keeps a pipe
// open gets at most kDrainAfterExit more).
#include "pipetrain/runtime/launch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <stdexcept>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/store.h"

extern char** environ;

namespace pipetrain {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kPollInterval = std::chrono::milliseconds(100);
constexpr auto kDrainAfterExit = std::chrono::seconds(2);
constexpr std::size_t kMaxLine = 64 * 1024;  // longer lines are forwarded in pieces

volatile sig_atomic_t g_signal = 0;        // the last SIGINT/SIGTERM/SIGHUP the launcher got
volatile sig_atomic_t g_signal_count = 0;  // how many, copies of one (below) counted once
// CLOCK_MONOTONIC milliseconds of the first signal counted. `timeout` sends its SIGTERM to the launcher and
// then to its whole process group, and a terminal's Ctrl-C reaches every process of the foreground
// group: copies of one request microseconds apart, which counted as a second signal and killed the ranks
// at once, without the grace (and the checkpoint --save-on-interrupt asked for). As in the ranks'
// handler, a repeat within a second is the same request.
std::atomic<std::int64_t> g_first_signal_ms{0};
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "the signal handler needs a lock-free atomic");
extern "C" void on_launcher_signal(int sig) {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  const std::int64_t ms = static_cast<std::int64_t>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  const std::int64_t first = g_first_signal_ms.load();
  g_signal = sig;
  if (first == 0) {
    g_first_signal_ms.store(ms);
    g_signal_count = g_signal_count + 1;
  } else if (ms - first >= 1000) {
    g_signal_count = g_signal_count + 1;
  }
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return std::to_string(sig) + (abbrev ? std::string(" (SIG") + abbrev + ")" : std::string());
}

std::string seconds_text(std::chrono::milliseconds d) {
  const long long ms = d.count();
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(ms) / 1000.0);
  return buf;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// Where execvp would find `command`, or "" when it would not.
std::string find_executable(const std::string& command) {
  if (command.find('/') != std::string::npos) return is_executable_file(command) ? command : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  std::size_t begin = 0;
  while (begin <= dirs.size()) {
    std::size_t end = dirs.find(':', begin);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > begin ? dirs.substr(begin, end - begin) : ".";
    const std::string candidate = dir + "/" + command;
    if (is_executable_file(candidate)) return candidate;
    begin = end + 1;
  }
  return "";
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  bool killed_by_us = false;
  int exit_code = -1;  // its own exit code, once it exited by itself
  int fd[2] = {-1, -1};  // read ends of its stdout and stderr pipes (when piped)
  std::string partial[2];
};

// Everything the loop shares: output routing and reporting.
class Launcher {
 public:
  Launcher(int nprocs, const LaunchOptions& options) : options_(options), children_(nprocs) {
    piped_ = options_.prefix_output || static_cast<bool>(options_.on_line);
  }
  ~Launcher() { cleanup(); }

  int run(const std::vector<std::string>& argv);

 private:
  void start(const std::vector<std::string>& argv);
  void emit(int rank, int stream, const std::string& line);
  void report(const std::string& message) { emit(-1, 2, message); }
  void read_from(Child& c, int stream);
  void drain(Child& c);
  void close_fd(Child& c, int stream);
  void kill_group(Child& c, int sig);
  void reap();
  void begin_stopping(Clock::time_point now);
  // Kills and reaps whatever is still running; closes pipes. Safe to call twice.
  void cleanup() noexcept;
  // Tells the ranks, through the store, that rank `c` failed (`how`: "exited with code 3", ...).
  void report_to_store(const Child& c, const std::string& how);

  // Removes the shared-memory segments whose names start with shm_prefix_ (the shm transport's, left
  // behind only by a rank killed during its rendezvous).
  void remove_segments() noexcept;

  const LaunchOptions& options_;
  std::string shm_prefix_;  // PIPETRAIN_SHM_PREFIX of the ranks (with host_store)
  std::unique_ptr<StoreServer> store_;  // the ranks' rendezvous store (options_.host_store)
  std::vector<Child> children_;
  bool piped_ = false;
  bool failed_ = false;
  int exit_code_ = 0;  // the first failing rank's own exit code (2: bad input; 128 + N: stopped by signal N)
  long lost_lines_[2] = {0, 0};  // lines of the ranks' stdout, stderr that could not be written
  int lost_errno_[2] = {0, 0};     // why (the first failure)
  bool stopping_ = false;
  bool deadline_passed_ = false;
  Clock::time_point deadline_{};
  std::string stop_reason_;
};

void Launcher::emit(int rank, int stream, const std::string& line) {
  if (options_.on_line) {
    options_.on_line(rank, stream, line);
    return;
  }
  std::string text;
  if (rank < 0) {
    text = "pipetrain launch: " + line + "\n";
  } else {
    text = (options_.prefix_output ? "[rank " + std::to_string(rank) + "] " : std::string()) + line + "\n";
  }
  const int fd = stream == 1 ? STDOUT_FILENO : STDERR_FILENO;
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {  // one write per line keeps lines whole when several processes share a terminal
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      // A non-blocking stdout (inherited so from a CI runner or a multiplexer) is full for now: wait for room
      // (up to 5 s, as a blocking stdout would block) rather than drop the line.
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        pollfd out{fd, POLLOUT, 0};
        if (::poll(&out, 1, 5000) > 0) continue;
      }
      // A closed reader (`| head`) wanted no more: drop the output, keep supervising. Any other failure
      // (a full disk under `> out.txt`, an I/O error) loses what the ranks printed: the run says so at
      // its end and does not exit 0.
      if (errno != EPIPE && rank >= 0) {  // the ranks' lines (the launcher's own reports are not counted)
        ++lost_lines_[stream == 1 ? 0 : 1];
        if (lost_errno_[stream == 1 ? 0 : 1] == 0) lost_errno_[stream == 1 ? 0 : 1] = errno;
      }
      return;
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

void Launcher::close_fd(Child& c, int stream) {
  const int i = stream - 1;
  if (c.fd[i] < 0) return;
  if (!c.partial[i].empty()) {
    emit(c.rank, stream, c.partial[i]);
    c.partial[i].clear();
  }
  ::close(c.fd[i]);
  c.fd[i] = -1;
}

void Launcher::read_from(Child& c, int stream) {
  const int i = stream - 1;
  char buf[16384];
  while (c.fd[i] >= 0) {
    const ssize_t n = ::read(c.fd[i], buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      close_fd(c, stream);
      return;
    }
    if (n == 0) {
      close_fd(c, stream);
      return;
    }
    std::string& partial = c.partial[i];
    partial.append(buf, static_cast<std::size_t>(n));
    std::size_t start = 0;
    for (std::size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(c.rank, stream, partial.substr(start, nl - start));
    partial.erase(0, start);
    if (partial.size() >= kMaxLine) {
      emit(c.rank, stream, partial);
      partial.clear();
    }
  }
}

void Launcher::drain(Child& c) {
  for (int stream = 1; stream <= 2; ++stream) read_from(c, stream);
}

// True when process `pid` is stopped by a signal or traced (state T or t in /proc/PID/stat).
bool process_stopped(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  return paren && paren[1] == ' ' && (paren[2] == 'T' || paren[2] == 't');
}

void Launcher::kill_group(Child& c, int sig) {
  if (c.pid <= 0) return;
  ::kill(-c.pid, sig);  // its process group: what it started too
  ::kill(c.pid, sig);   // in case it left the group
}

void Launcher::begin_stopping(Clock::time_point now) {
  if (stopping_) return;
  stopping_ = true;
  failed_ = true;
  deadline_ = now + options_.grace;
}

void Launcher::reap() {
  for (Child& c : children_) {
    if (!c.running) continue;
    siginfo_t info{};
    int r;
    do {  // WNOWAIT: it stays a zombie, so its pid (and process group id) cannot be reused yet
      r = ::waitid(P_PID, static_cast<id_t>(c.pid), &info, WEXITED | WNOHANG | WNOWAIT);
    } while (r < 0 && errno == EINTR);
    if (r == 0 && info.si_pid == 0) continue;  // still running
    if (r == 0) ::kill(-c.pid, SIGKILL);       // what it started and left behind goes with it
    int status = 0;
    pid_t reaped;
    do {
      reaped = ::waitpid(c.pid, &status, 0);
    } while (reaped < 0 && errno == EINTR);
    c.running = false;
    if (reaped < 0) {  // cannot happen for our own child; treat as lost
      report("rank " + std::to_string(c.rank) + " was lost (waitpid: " + std::strerror(errno) + ")");
      failed_ = true;
      continue;
    }
    drain(c);  // its last lines come before the verdict
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (ok) continue;
    if (!c.killed_by_us) {
      if (WIFEXITED(status)) c.exit_code = WEXITSTATUS(status);
      if (WIFEXITED(status) && exit_code_ == 0) exit_code_ = WEXITSTATUS(status);
      if (WIFEXITED(status)) {
        report("rank " + std::to_string(c.rank) + " exited with code " + std::to_string(WEXITSTATUS(status)));
        report_to_store(c, "it exited with code " + std::to_string(WEXITSTATUS(status)));
      } else if (WIFSIGNALED(status)) {
        report("rank " + std::to_string(c.rank) + " was killed by signal " + signal_name(WTERMSIG(status)));
        report_to_store(c, "it was killed by signal " + signal_name(WTERMSIG(status)));
      }
    }
    if (!stopping_) {
      stop_reason_ = "rank " + std::to_string(c.rank) + " failed";
      begin_stopping(Clock::now());
    }
    failed_ = true;
  }
}

void Launcher::report_to_store(const Child& c, const std::string& how) {
  if (!store_) return;
  // The first report wins: a rank that failed by itself has usually said why already.
  store_->post_abort(c.rank, how + (store_->joined(c.rank) ? std::string() : " before it joined the rendezvous") +
                                 " (seen by pipetrain launch)");
}

void Launcher::start(const std::vector<std::string>& argv) {
  const int nprocs = static_cast<int>(children_.size());
  const int port = options_.master_port > 0 ? options_.master_port : pick_free_port();
  std::vector<std::string> store_env;
  if (options_.host_store) {
    const std::string token = make_run_token();
    store_ = std::make_unique<StoreServer>("127.0.0.1", 0, token, nprocs);
    shm_prefix_ = "pipetrain-" + std::to_string(::getpid()) + "-" + make_run_token().substr(0, 8);
    store_env = {"PIPETRAIN_LAUNCHER_STORE=" + store_->address() + ":" + std::to_string(store_->port()),
                 "PIPETRAIN_RUN_TOKEN=" + token, "PIPETRAIN_SHM_PREFIX=" + shm_prefix_};
  }

  // Everything the children need is built before the first fork: between fork and exec a child of a
  // multi-threaded process may only call async-signal-safe functions.
  std::vector<std::string> names = {"MASTER_ADDR", "MASTER_PORT", "RANK",          "WORLD_SIZE",
                                    "LOCAL_RANK",  "LOCAL_WORLD_SIZE", "PIPETRAIN_LAUNCHER_STORE",
                                    "PIPETRAIN_RUN_TOKEN", "PIPETRAIN_SHM_PREFIX"};
  for (const auto& kv : options_.env) names.push_back(kv.first);
  std::vector<std::string> base;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    bool drop = key.rfind("OMPI_COMM_WORLD_", 0) == 0;  // these ranks are not MPI ranks
    for (const auto& n : names) drop = drop || key == n;
    if (!drop) base.push_back(entry);
  }
  std::vector<std::vector<std::string>> envs(nprocs, base);
  for (int r = 0; r < nprocs; ++r) {
    auto& env = envs[r];
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(nprocs));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nprocs));
    for (const auto& kv : store_env) env.push_back(kv);
    for (const auto& kv : options_.env) env.push_back(kv.first + "=" + kv.second);
  }
  std::vector<std::vector<char*>> envps(nprocs);
  for (int r = 0; r < nprocs; ++r) {
    for (auto& s : envs[r]) envps[r].push_back(s.data());
    envps[r].push_back(nullptr);
  }
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  for (auto& a : args) argp.push_back(a.data());
  argp.push_back(nullptr);
  const std::string exec_failed = "pipetrain launch: cannot run '" + argv[0] + "': ";
  const pid_t launcher_pid = ::getpid();
  // Each rank its own block of the CPUs this launcher may use (CPU_COUNT / nprocs of them, in order),
  // when there are at least as many CPUs as ranks. One CPU per rank, as before, put a rank's intra-op
  // threads (--threads) all on one core.
  std::vector<cpu_set_t> binding;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (options_.bind_cores && ::sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) >= nprocs) {
    const int per_rank = CPU_COUNT(&allowed) / nprocs;
    int taken = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && taken < per_rank * nprocs; ++cpu)
      if (CPU_ISSET(cpu, &allowed)) {
        if (taken % per_rank == 0) {
          binding.emplace_back();
          CPU_ZERO(&binding.back());
        }
        CPU_SET(cpu, &binding.back());
        ++taken;
      }
  }

  for (int r = 0; r < nprocs; ++r) {
    Child& c = children_[r];
    c.rank = r;
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    if (piped_) {
      if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
        const std::string why = std::strerror(errno);
        for (int fd : {out[0], out[1], err[0], err[1]})
          if (fd >= 0) ::close(fd);
        throw std::runtime_error("cannot start rank " + std::to_string(r) + ": pipe: " + why);
      }
    }
    // The child starts with the launcher's handlers: a signal between fork and the reset below would
    // be swallowed. So they are blocked across fork; the child unblocks them once they are default.
    sigset_t block, saved;
    sigemptyset(&block);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&block, sig);
    ::pthread_sigmask(SIG_BLOCK, &block, &saved);
    const pid_t pid = ::fork();
    if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);
    if (pid < 0) {
      const std::string why = std::strerror(errno);
      for (int fd : {out[0], out[1], err[0], err[1]})
        if (fd >= 0) ::close(fd);
      throw std::runtime_error("cannot start rank " + std::to_string(r) + ": fork: " + why);
    }
    if (pid == 0) {  // child: async-signal-safe calls only
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(1);  // the launcher died before prctl
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);  // a signal that came meanwhile now ends it
      if (!binding.empty()) ::sched_setaffinity(0, sizeof(cpu_set_t), &binding[static_cast<std::size_t>(r)]);
      const int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
      if (piped_) {
        ::dup2(out[1], STDOUT_FILENO);
        ::dup2(err[1], STDERR_FILENO);
      }
      ::execvpe(argp[0], argp.data(), envps[r].data());
      const int e = errno;
      (void)!::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      const char* why = std::strerror(e);  // not async-signal-safe in theory; glibc's is in practice
      (void)!::write(STDERR_FILENO, why, std::strlen(why));
      (void)!::write(STDERR_FILENO, "\n", 1);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so a kill(-pid) right after fork reaches it
    c.pid = pid;
    c.running = true;
    if (piped_) {
      ::close(out[1]);
      ::close(err[1]);
      c.fd[0] = out[0];
      c.fd[1] = err[0];
      for (int fd : c.fd) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    }
  }
}

int Launcher::run(const std::vector<std::string>& argv) {
  const auto begin = Clock::now();
  start(argv);
  std::optional<Clock::time_point> all_exited;
  bool signal_forwarded = false;
  bool timed_out = false;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, int>> owners;
    for (Child& c : children_)
      for (int i = 0; i < 2; ++i)
        if (c.fd[i] >= 0) {
          fds.push_back(pollfd{c.fd[i], POLLIN, 0});
          owners.emplace_back(&c, i + 1);
        }
    const bool any_running =
        std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; });
    if (!any_running) {
      const auto now = Clock::now();
      if (!all_exited) all_exited = now;
      if (fds.empty() || now - *all_exited > kDrainAfterExit) break;
    }
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(kPollInterval.count()));
    if (n > 0) {
      for (std::size_t k = 0; k < fds.size(); ++k)
        if (fds[k].revents != 0) read_from(*owners[k].first, owners[k].second);
    }
    reap();
    const auto now = Clock::now();
    if (g_signal != 0 && !signal_forwarded) {
      signal_forwarded = true;
      const int sig = g_signal;
      report("got signal " + signal_name(sig) + "; passing it on to the ranks");
      for (Child& c : children_)
        if (c.running) kill_group(c, sig == SIGHUP ? SIGTERM : sig);
      if (!stopping_) stop_reason_ = "the launcher got signal " + signal_name(sig);
      begin_stopping(now);
      deadline_ = std::min(deadline_, now + options_.grace);
      failed_ = true;
    }
    if (g_signal_count > 1 && !deadline_passed_) {  // asked twice (Ctrl-C again): no more grace
      deadline_passed_ = true;
      report("got a second signal; killing the ranks");
      for (Child& c : children_)
        if (c.running) {
          c.killed_by_us = true;
          kill_group(c, SIGKILL);
        }
    }
    if (options_.timeout.count() > 0 && !timed_out && now - begin >= options_.timeout && any_running) {
      timed_out = true;
      failed_ = true;
      report("the run took longer than " + seconds_text(options_.timeout) + "; killing the ranks");
      for (Child& c : children_)
        if (c.running) {
          c.killed_by_us = true;
          kill_group(c, SIGKILL);
        }
    }
    // A rank that is stopped (SIGSTOP, a debugger) cannot stop by itself: once the run is stopping it is
    // killed at once instead of after the grace period (the run took 40 s to end, not ~11).
    if (stopping_ && !deadline_passed_)
      for (Child& c : children_)
        if (c.running && !c.killed_by_us && process_stopped(c.pid)) {
          report("rank " + std::to_string(c.rank) + " is stopped (SIGSTOP?) and cannot stop by itself after " +
                 stop_reason_ + "; killing it");
          c.killed_by_us = true;
          kill_group(c, SIGKILL);
        }
    if (stopping_ && !deadline_passed_ && now >= deadline_) {
      deadline_passed_ = true;
      for (Child& c : children_)
        if (c.running) {
          report("rank " + std::to_string(c.rank) + " did not stop within " + seconds_text(options_.grace) +
                 " after " + stop_reason_ + "; killing it");
          c.killed_by_us = true;
          kill_group(c, SIGKILL);
        }
    }
  }
  cleanup();
  bool output_lost = false;
  for (int i = 0; i < 2; ++i) {
    if (lost_lines_[i] == 0) continue;
    output_lost = true;
    // stderr may be the stream that failed: this line is written there all the same (it may reach a
    // terminal when only stdout was redirected).
    report(std::to_string(lost_lines_[i]) + " line(s) the ranks printed could not be written to " +
           (i == 0 ? "stdout" : "stderr") + " (" + std::strerror(lost_errno_[i]) +
           "): the run's output is incomplete; free space where it goes (or redirect it elsewhere) and run again");
  }
  // The run's code is its first failing rank's: 2 for bad input, 128 + N for a stop by signal N (as a
  // shell reports a signalled command), 1 otherwise; 1 also when the ranks succeeded but their output was lost.
  if (!failed_) return output_lost ? 1 : 0;
  // The rank that failed first is the one the failure board names (the others stopped because of it and
  // exit 1): its code wins over the first reaped, which was either (bad input gave 2 or 1 at random).
  if (store_)
    if (const auto board = store_->value(kAbortKey)) {
      const int first = parse_abort(*board).first;
      if (first >= 0 && first < static_cast<int>(children_.size()) && children_[first].exit_code > 0)
        exit_code_ = children_[first].exit_code;
    }
  if (exit_code_ == 2 || exit_code_ > 128) return exit_code_;
  return 1;
}

void Launcher::remove_segments() noexcept {
  if (shm_prefix_.empty()) return;
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(dir))
    if (std::strncmp(e->d_name, shm_prefix_.c_str(), shm_prefix_.size()) == 0) names.emplace_back(e->d_name);
  ::closedir(dir);
  for (const auto& n : names) ::shm_unlink(("/" + n).c_str());
}

void Launcher::cleanup() noexcept {
  for (Child& c : children_) {
    if (c.running) {  // not reaped yet, so its pid and process group id are still its own
      kill_group(c, SIGKILL);
      int status;
      while (::waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
      c.running = false;
    }
    for (int i = 0; i < 2; ++i)
      if (c.fd[i] >= 0) {
        try {
          close_fd(c, i + 1);
        } catch (...) {
          ::close(c.fd[i]);
          c.fd[i] = -1;
        }
      }
  }
  remove_segments();  // after the reaping: no rank can create one any more
}

// Installs the launcher's signal handlers and puts the old ones back.
class SignalScope {
 public:
  SignalScope() {
    g_signal = 0;
    g_signal_count = 0;
    g_first_signal_ms.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_launcher_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: poll returns at once
    for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, &old_pipe_);
  }
  ~SignalScope() {
    for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    ::sigaction(SIGPIPE, &old_pipe_, nullptr);
    g_signal = 0;
    g_signal_count = 0;
    g_first_signal_ms.store(0);
  }

 private:
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};
  std::array<struct sigaction, 3> old_{};
  struct sigaction old_pipe_ {};
};

}  // namespace

int pick_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(std::string("cannot pick a free port: socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("cannot pick a free port on 127.0.0.1: " + why + "; set one with MASTER_PORT");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

int launch_local(int nprocs, const std::vector<std::string>& argv, const LaunchOptions& options) {
  if (nprocs < 1)
    throw UsageError("-n " + std::to_string(nprocs) + " is not a number of ranks: give -n P with P >= 1");
  if (nprocs > kMaxLocalRanks)
    throw UsageError("-n " + std::to_string(nprocs) + " is more ranks than one host can serve: give -n P with P <= " +
                     std::to_string(kMaxLocalRanks) + " (kMaxLocalRanks), or start the ranks on several hosts");
  if (argv.empty() || argv[0].empty())
    throw UsageError("missing the command to run: pipetrain launch -n " + std::to_string(nprocs) +
                     " -- COMMAND [ARGS...]");
  if (find_executable(argv[0]).empty()) {
    if (argv[0].find('/') != std::string::npos)
      throw UsageError("'" + argv[0] + "' is not an executable file: check the path");
    throw UsageError("command '" + argv[0] + "' not found on PATH: give its path (e.g. ./" + argv[0] +
                     ") or install it");
  }
  if (options.grace.count() < 0)
    throw UsageError("grace period " + seconds_text(options.grace) + " must be >= 0");
  SignalScope signals;
  Launcher launcher(nprocs, options);
  return launcher.run(argv);
}

}  // namespace pipetrain
