// Pieces of `pipetrain train` around the library's Trainer: the progress display, SIGINT/SIGTERM as a
// cooperative stop, and PIPETRAIN_FAULT's fault injection for failure tests.
#pragma once

#include <signal.h>

#include <chrono>
#include <functional>
#include <string>

#include "pipetrain/core/action.h"

namespace pipetrain::cli {

std::string duration_text(double seconds);  // "1m05s", "2h03m"; "?" when unknown
std::string rate_text(double per_second);   // "950", "12.3k"

// Progress per step. bar: one line that redraws itself (a terminal); lines: a line per step with its
// time (logs, benchmarks); quiet: nothing per step; auto: bar on a terminal, else a bar-style line
// every 5% of the run.
class Progress {
 public:
  Progress(const std::string& mode, int total, int start, const std::string& unit);
  void step(int done, double loss, double grad_norm, double lr, double ms, double units_per_s);
  // A message between progress lines (evaluation, checkpoint).
  void note(const std::string& text);

 private:
  int total_, start_;
  std::string unit_, mode_;
  int every_ = 1;
  bool bar_open_ = false;
  std::chrono::steady_clock::time_point t0_;
};

// SIGINT and SIGTERM during training (a StopSignalScope while the command runs). The handler only notes
// the signal (a second one a second or more later ends the process at once, as the default would); the
// ranks agree on it at the start of each call (the Trainer's stop request), so they all stop after the
// same step: a save in progress completes, no DIR.partial or temporary file is left, and with
// --save-on-interrupt one more checkpoint is written at the step reached. The exit code is 128 + the
// signal, as a shell reports a run killed by it. Until stop_signals_cooperative() (the training loop
// runs and polls the flag), a signal keeps its default effect: `timeout` or Ctrl-C during start-up ends
// the rank at once.
class StopSignalScope {
 public:
  StopSignalScope();
  ~StopSignalScope();
  StopSignalScope(const StopSignalScope&) = delete;
  StopSignalScope& operator=(const StopSignalScope&) = delete;

 private:
  struct sigaction old_int_ {}, old_term_ {};
};
void stop_signals_cooperative();
int stop_signal_received();  // the first signal noted (0: none)

// PIPETRAIN_FAULT="RANK:ACTION:KIND[:STEP]" (see train_support.cpp): a PipelineOptions::before_action
// hook that fails rank RANK just before ACTION of step STEP.
std::function<void(int, int, const Action&)> fault_injector(const std::string& spec);

}  // namespace pipetrain::cli
