// The pieces of `pipetrain train` around the Trainer (train_support.h).
#include "train_support.h"

#include <fmt/format.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <vector>

#include "pipetrain/core/error.h"

namespace pipetrain::cli {

std::string duration_text(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const auto s = static_cast<long>(std::lround(seconds));
  return s >= 3600 ? fmt::format("{}h{:02d}m", s / 3600, (s / 60) % 60) : fmt::format("{}m{:02d}s", s / 60, s % 60);
}

std::string rate_text(double per_second) {
  return per_second >= 1e4 ? fmt::format("{:.1f}k", per_second / 1e3) : fmt::format("{:.0f}", per_second);
}

Progress::Progress(const std::string& mode, int total, int start, const std::string& unit)
    : total_(total), start_(start), unit_(unit), t0_(std::chrono::steady_clock::now()) {
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  mode_ = mode == "auto" ? (tty ? "bar" : "every") : mode;
  every_ = std::max(1, (total - start) / 20);
}

void Progress::step(int done, double loss, double grad_norm, double lr, double ms, double units_per_s) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double eta = elapsed / std::max(1, done - start_) * (total_ - done);
  if (mode_ == "quiet") return;
  if (mode_ == "lines") {
    std::cout << fmt::format("step {:>5}/{}  loss {:.4f}  grad norm {:.3f}  lr {:.2e}  {:.1f} ms  {} {}/s  ETA {}\n",
                             done, total_, loss, grad_norm, lr, ms, rate_text(units_per_s), unit_, duration_text(eta))
              << std::flush;
    return;
  }
  const int width = 24, filled = static_cast<int>(width * static_cast<double>(done) / total_);
  const std::string line = fmt::format("[{}{}] {:>5}/{}  loss {:.4f}  lr {:.2e}  {} {}/s  ETA {}",
                                       std::string(filled, '#'), std::string(width - filled, '.'), done, total_, loss,
                                       lr, rate_text(units_per_s), unit_, duration_text(eta));
  if (mode_ == "bar") {
    std::cout << "\r" << line << "\033[K" << std::flush;
    bar_open_ = done != total_;
    if (done == total_) std::cout << "\n";
  } else if ((done - start_) % every_ == 0 || done == total_ || done == start_ + 1) {
    std::cout << line << "\n" << std::flush;
  }
}

// A message between progress lines (evaluation, checkpoint).
void Progress::note(const std::string& text) {
  if (bar_open_) std::cout << "\r\033[K";
  std::cout << text << "\n" << std::flush;
}

namespace {
volatile sig_atomic_t g_stop_signal = 0;
// CLOCK_MONOTONIC milliseconds of the first one. Whole seconds were not enough: two copies of one
// Ctrl-C a few milliseconds apart that straddled a second boundary counted as a second Ctrl-C and
// killed the rank in the middle of its step (a flaky TrainSafety test on a loaded machine).
std::atomic<std::int64_t> g_stop_signal_at_ms{0};
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "the signal handler needs a lock-free atomic");
// Set once the training loop runs (it reads g_stop_signal at every call). Before that (rendezvous,
// building the model, the first evaluation) nothing would read the flag, so a signal keeps its
// default effect: `timeout` or Ctrl-C during start-up ends the rank at once.
volatile sig_atomic_t g_stop_cooperative = 0;
extern "C" void on_stop_signal(int sig) {
  if (!g_stop_cooperative) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  timespec now {};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  const std::int64_t now_ms = static_cast<std::int64_t>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  if (g_stop_signal != 0) {
    // A launcher signals a rank's process group and the rank itself, so one Ctrl-C can arrive twice:
    // only a second signal a second or more later means "stop now".
    if (now_ms - g_stop_signal_at_ms.load() < 1000) return;
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_stop_signal_at_ms.store(now_ms);
  g_stop_signal = sig;
}
}  // namespace

StopSignalScope::StopSignalScope() {
  g_stop_signal = 0;
  g_stop_cooperative = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
}

StopSignalScope::~StopSignalScope() {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
}

void stop_signals_cooperative() { g_stop_cooperative = 1; }
int stop_signal_received() { return static_cast<int>(g_stop_signal); }

// PIPETRAIN_FAULT="RANK:ACTION:KIND[:STEP]" makes rank RANK fail just before ACTION (text form, e.g. 1F2)
// of step STEP (0-based, default 0): KIND "throw" raises an error, "kill" sends the process SIGKILL,
// "interrupt" sends SIGINT to the process that started the ranks (the launcher: a Ctrl-C at a known
// point; with no launcher, to this process). For failure, interrupt and crash-recovery tests.
std::function<void(int, int, const Action&)> fault_injector(const std::string& spec) {
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const auto colon = spec.find(':', at);
    parts.push_back(spec.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  if (parts.size() != 3 && parts.size() != 4)
    throw UsageError("PIPETRAIN_FAULT='" + spec + "' must read RANK:ACTION:KIND[:STEP], e.g. 1:1F2:throw or 1:1F2:kill:3");
  int rank = 0, at_step = 0;
  try {
    rank = std::stoi(parts[0]);
    if (parts.size() == 4) at_step = std::stoi(parts[3]);
  } catch (const std::exception&) {
    throw UsageError("PIPETRAIN_FAULT='" + spec + "': RANK and STEP must be integers");
  }
  const Action action = parse_action(parts[1]);
  const std::string kind = parts[2];
  if (kind != "throw" && kind != "kill" && kind != "interrupt")
    throw UsageError("PIPETRAIN_FAULT kind '" + kind + "' must be throw, kill or interrupt");
  const pid_t interrupt_target = std::getenv("RANK") ? ::getppid() : ::getpid();  // process ranks: their launcher
  return [=](int r, int step, const Action& act) {
    if (r != rank || step != at_step || act != action) return;
    if (kind == "kill") ::kill(::getpid(), SIGKILL);
    if (kind == "interrupt") {
      ::kill(interrupt_target, SIGINT);
      return;
    }
    throw std::runtime_error("injected fault before " + to_string(act));
  };
}

}  // namespace pipetrain::cli
