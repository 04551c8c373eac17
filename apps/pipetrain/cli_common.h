// Shared pieces of the `pipetrain` subcommands: exit codes, schedule and cost options, output helpers.
// Every subcommand registers itself on the CLI11 app and returns its exit code through the callback.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

#include "pipetrain/core/cost.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/plan/profile.h"

namespace pipetrain::cli {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;  // runtime failure
constexpr int kExitUsage = 2;    // bad flag or value

// Flags shared by `schedule` and `simulate`.
struct ScheduleFlags {
  std::string schedule;          // generator name (or empty with --load)
  std::string load;              // CSV schedule file instead of a generator
  int stages = 0;                // p
  int microbatches = 0;          // m
  int virtual_stages = 1;        // v
  int steps = 1;                 // optimizer steps
  std::string cost = "1:1:1";    // F:B:W, or one triple per stage
  double comm = 0.0;             // per-hop transfer time
  double memory_limit = 0.0;     // activation memory limit per rank (micro-batches); 0 = none
  // Costs from a profile instead of --cost: the balance cuts the profiled layers into stages.
  std::string profile;
  std::string balance = "time";
  std::string balance_solver = "min-max";
  double microbatch_size = 0;    // 0: the profile's
  double bandwidth_gbps = 0;     // 0: transfers cost only the latency
  double latency_us = 0;
  std::vector<int> replication;  // --replication 3,1: stage replicas, round robin (gpipe or 1f1b)
  int pipedream_batch = 0;       // the batch a PipeDream graph file was profiled at (0: read it as 1)
  std::vector<std::string> skips;  // --skip FROM:TO[:SIZE], repeatable: skip routes (core/skip.h)
  double skip_bandwidth = 0;     // --skip-bandwidth: memory units per time unit of a skip transfer; 0 = free
  Profile load_profile_flags() const;  // --profile, with --pipedream-batch for PipeDream graph files
  // Refuses the flags that only shape a profile's costs (--balance, --balance-solver, --microbatch-size,
  // --pipedream-batch, --bandwidth, --latency) when no --profile is given: they did nothing.
  void refuse_profile_flags_without_profile() const;
  mutable bool pipedream_warned = false;  // the batch-1 warning of a PipeDream graph, printed once
  CLI::Option* stages_option = nullptr;        // set by add_to: tells "missing" from "0"
  CLI::Option* microbatches_option = nullptr;
  CLI::Option* pipedream_batch_option = nullptr;  // tells "not given" from "0"
  CLI::Option* bandwidth_option = nullptr;        // --bandwidth or --latency given: they win over the
  CLI::Option* latency_option = nullptr;          // profile's measured runtime costs
  const CLI::App* app = nullptr;                  // set by add_to: which flags the command line gave
  bool given(const char* flag) const;
  // Transfer bandwidth (bytes/ms) and latency (ms) for profile `p`: --bandwidth and --latency when either
  // is given, else the profile's measured runtime costs (pipetrain profile --transport), else free.
  std::pair<double, double> transfer_options(const Profile& p) const;

  void add_to(CLI::App& app);
  // Builds (or loads) and validates the schedule. Throws UsageError / ScheduleError on bad input.
  Schedule build() const;
  // --load FILE as PyTorch's schedule CSV (core/torch_csv.h), validated as a generated schedule is; `letters`
  // is detect, current or legacy; `notes` gets what the reader noticed.
  Schedule load_torch(const std::string& letters, const std::vector<int>& stage_rank,
                      std::vector<std::string>& notes) const;
  // The cost model for `s`, from --cost and --comm, or from --profile cut by --balance.
  CostModel costs(const Schedule& s) const;  // base_costs with --skip-bandwidth
  CostModel base_costs(const Schedule& s) const;
  void add_skips(Schedule& s) const;  // --skip routes into `s` (refused when a loaded CSV has its own)
  // `ranks` (0: unknown) words the error when total_stages > ranks stages do not fit the profile's layers.
  CostModel profile_costs(int total_stages, int ranks = 0) const;
};

// Registers the subcommands; each sets `exit_code` when it runs.
void add_schedule_command(CLI::App& app, int& exit_code);
void add_simulate_command(CLI::App& app, int& exit_code);
void add_demo_command(CLI::App& app, int& exit_code);
void add_info_command(CLI::App& app, int& exit_code);
void add_launch_command(CLI::App& app, int& exit_code);
void add_train_command(CLI::App& app, int& exit_code);
void add_selftest_command(CLI::App& app, int& exit_code);
void add_profile_command(CLI::App& app, int& exit_code);
void add_plan_command(CLI::App& app, int& exit_code);

// The process's command line, kept by main() so a command can relaunch itself as ranks.
void set_command_line(int argc, char** argv);
int cli_argc();
char** cli_argv();

// `--config FILE` (anywhere after the subcommand): a JSON object of flags, {"stages": 4, "schedule":
// "zb-h1", "memory": true}, keys being flag names without the dashes. Returns the arguments with the
// file's flags inserted right after the subcommand, so flags given on the command line come later and
// win (options take their last value). true adds a flag, false leaves it out; strings and numbers
// become values; arrays become one value each. Throws UsageError on a missing file, invalid JSON, or a
// value of another type, naming the file and the key.
// With `app`, each key is checked against the subcommand's flags (unknown keys get the nearest flag
// name; an on/off flag must be true/false; a one-value flag no array).
std::vector<std::string> expand_config(const std::vector<std::string>& args, const CLI::App* app = nullptr);
// The subcommands' names and a subcommand's long flags ("--stages"), for suggestions.
std::vector<std::string> subcommand_names(const CLI::App& app);
std::vector<std::string> long_flag_names(const CLI::App& sub);

// Checks every value of the command's options before CLI11 converts it: a value that is one of the
// command's own flags (`--svg --json`), an empty number (`--clip ""`, read as 0), and integers CLI11 would
// read in another base or round (`-p 010` is 8, `0x10`, `8.0`) are refused naming the flag and the fix.
void check_values(CLI::App& cmd);

// Refuses nan and inf (and numbers past a double's range, which read as inf) for every floating-point
// flag of `cmd`, naming the flag: the torch-free commands hand their numbers to the simulator and
// planners, which would otherwise run with them.
void refuse_non_finite(CLI::App& cmd);

// Paths: the same file or folder (either may not exist yet); `p` is `dir` or lies under it.
bool same_path(const std::filesystem::path& a, const std::filesystem::path& b);
bool inside(const std::filesystem::path& p, const std::filesystem::path& dir);
// Refuses each of `flags` that was given an empty name ("--svg $UNSET" wrote nothing, exit 0).
void refuse_empty_names(const CLI::App* cmd, std::initializer_list<const char*> flags);
// A command's outputs (flag, path) may be neither a file it reads (`inputs`) nor each other: `--svg` over
// the `--profile` it read replaced a measured profile, `--svg x --trace x` kept one. Empty paths and
// /dev/... are skipped. Throws UsageError naming both flags.
void check_outputs_apart(const std::vector<std::pair<const char*, std::string>>& outputs,
                         const std::vector<std::pair<const char*, std::string>>& inputs);

// For CLI11's "Could not convert: --X = V" on an integer flag of `sub`: "--X takes a whole number from LO
// to HI: ...", the range of the flag's C++ type (found by converting probe values; it leaves the option
// changed, so call it only on the way out). "" for other messages.
std::string integer_range_hint(CLI::App& sub, const std::string& message);

// Runs `body`, mapping UsageError to exit 2 and any other exception to exit 1, with the message on
// stderr prefixed by "pipetrain <command>: error: ".
int guarded(const std::string& command, const std::function<int()>& body);

}  // namespace pipetrain::cli
