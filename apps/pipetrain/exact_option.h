// `--exact` of `pipetrain schedule` and `simulate`: replaces zb-auto's greedy schedule by the exact
// search's (core/zb_exact.h) and reports how far the greedy was from it.
#pragma once

#include <CLI/CLI.hpp>

#include "cli_common.h"
#include "pipetrain/core/zb_exact.h"

namespace pipetrain::cli {

struct ExactFlags {
  bool exact = false;
  long long nodes = 5'000'000;
  CLI::Option* nodes_option = nullptr;

  void add_to(CLI::App& app);
  // With --exact: checks that the schedule is zb-auto, runs the search with the flags' costs and memory
  // limit, validates its schedule and puts it in `s`. Throws UsageError for --exact on another schedule
  // or --exact-nodes without --exact.
  bool apply(const ScheduleFlags& flags, Schedule& s, ZbExactResult& result) const;
};

}  // namespace pipetrain::cli
