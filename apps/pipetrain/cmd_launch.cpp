// `pipetrain launch -n P -- COMMAND...`: starts P local ranks of COMMAND with the rendezvous environment
// set (runtime/launch.h). Torch-free: it only needs launch.h.
#include <sched.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli_common.h"
#include "pipetrain/core/error.h"
#include "pipetrain/runtime/launch.h"

namespace pipetrain::cli {

void add_launch_command(CLI::App& app, int& exit_code) {
  struct Flags {
    int nprocs = 0;
    bool no_prefix = false;
    bool bind = false;
    bool no_bind = false;
    double grace_s = 30.0;
    double timeout_s = 0.0;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "start P local ranks of a command with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set");
  CLI::Option* n_option = cmd->add_option("-n,--nprocs", flags->nprocs, "number of ranks (processes) to start, 1.." + std::to_string(kMaxLocalRanks));
  cmd->add_flag("--bind", flags->bind,
                "pin rank r to the r-th block of the launcher's CPUs (C CPUs give each of P ranks C/P, when "
                "C >= P), as mpirun binds ranks; faster for gloo ranks on a loaded machine, slower for shm");
  cmd->add_flag("--no-bind", flags->no_bind, "leave the ranks' placement to the kernel (the default)");
  cmd->add_flag("--no-prefix", flags->no_prefix,
                "do not prefix the ranks' output lines with [rank R] (they write straight to the terminal)");
  cmd->add_option("--grace", flags->grace_s,
                  "seconds the other ranks get to stop by themselves after one fails, before they are "
                  "killed; default 30");
  cmd->add_option("--timeout", flags->timeout_s, "kill all ranks after this many seconds; default 0 = no limit");
  auto command = std::make_shared<std::vector<std::string>>();
  cmd->add_option("command", *command, "the command to run and its arguments, after --")->expected(-1);
  cmd->positionals_at_end();  // from the command's name on, every argument is the command's, untouched
  cmd->footer(
      "Each rank gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and\n"
      "LOCAL_WORLD_SIZE, and the launcher hosts their rendezvous store on 127.0.0.1 (PIPETRAIN_LAUNCHER_STORE,\n"
      "with a fresh PIPETRAIN_RUN_TOKEN). When a rank fails the others get --grace seconds to stop, then are killed;\n"
      "the exit code is 0 only if every rank exited 0.\n"
      "Examples:\n"
      "  pipetrain launch -n 4 -- build/pipetrain train --transport gloo --stages 4 ...\n"
      "  pipetrain launch -n 2 --no-prefix -- sh -c 'echo rank $RANK of $WORLD_SIZE'");
  cmd->callback([=, &exit_code] {
    exit_code = guarded("launch", [&] {
      if (n_option->count() == 0)
        throw UsageError("missing -n P (the number of ranks to start), e.g. pipetrain launch -n 2 -- COMMAND");
      if (flags->nprocs < 1)
        throw UsageError("-n " + std::to_string(flags->nprocs) +
                         " is not a number of ranks: give -n P with P >= 1, e.g. -n 2");
      if (flags->bind && flags->no_bind)
        throw UsageError("--bind and --no-bind contradict each other: give one of them (without either, ranks "
                         "are not pinned)");
      if (command->empty())
        throw UsageError("missing the command to run: pipetrain launch -n " + std::to_string(flags->nprocs) +
                         " -- COMMAND [ARGS...]");
      // At most a year (1e16 s overflowed the milliseconds to a negative grace); a timeout under 1 ms is not
      // rounded to 0, which means no limit.
      constexpr double kMaxSeconds = 365.0 * 24 * 3600;
      if (!(flags->grace_s >= 0) || !(flags->grace_s <= kMaxSeconds))
        throw UsageError(fmt::format("--grace {} must be a number of seconds from 0 to {:.0f} (a year)", flags->grace_s,
                                     kMaxSeconds));
      if (!(flags->timeout_s >= 0) || !(flags->timeout_s <= kMaxSeconds))
        throw UsageError(fmt::format("--timeout {} must be a number of seconds from 0 (no limit) to {:.0f} (a year)",
                                     flags->timeout_s, kMaxSeconds));
      if (flags->timeout_s > 0 && flags->timeout_s < 0.001)
        throw UsageError(fmt::format("--timeout {} is under a millisecond: give at least 0.001 s, or 0 for no limit",
                                     flags->timeout_s));
      if (flags->bind) {  // it pins one block of CPUs per rank, or nothing: say so rather than nothing
        cpu_set_t allowed;
        CPU_ZERO(&allowed);
        if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) < flags->nprocs)
          std::cerr << "pipetrain launch: note: --bind pins each rank to its own CPUs, and the " << flags->nprocs
                    << " ranks share " << CPU_COUNT(&allowed) << " CPUs here: they are not pinned\n";
      }
      LaunchOptions options;
      options.prefix_output = !flags->no_prefix;
      options.bind_cores = flags->bind;
      options.grace = std::chrono::milliseconds(static_cast<long long>(std::llround(flags->grace_s * 1000)));
      options.timeout = std::chrono::milliseconds(static_cast<long long>(std::llround(flags->timeout_s * 1000)));
      return launch_local(flags->nprocs, *command, options);
    });
  });
}

}  // namespace pipetrain::cli
