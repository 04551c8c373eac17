// pipetrain: plan, simulate and (later) train pipeline-parallel models. One file per subcommand.
#include <iostream>
#include <string>
#include <vector>

#include "cli_common.h"
#include "pipetrain/core/error.h"

int main(int argc, char** argv) {
  using namespace pipetrain::cli;
  CLI::App app{"pipetrain: pipeline-parallel training, planning and simulation on LibTorch"};
  app.require_subcommand(1);
  // A flag given twice takes its last value, so a command line can be extended with overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.footer(
      "Examples:\n"
      "  pipetrain schedule --schedule 1f1b --stages 4 --microbatches 8\n"
      "  pipetrain simulate --schedule zb-h1 --stages 4 --microbatches 8 --cost 1:1:1 --svg zb.svg\n"
      "  pipetrain demo\n"
      "  pipetrain train --stages 2 --schedule zb-h1 --steps 20 --svg run.svg\n"
      "Run 'pipetrain COMMAND --help' for a command's flags.");
  int exit_code = kExitOk;
  add_schedule_command(app, exit_code);
  add_simulate_command(app, exit_code);
  add_demo_command(app, exit_code);
  add_info_command(app, exit_code);
  add_launch_command(app, exit_code);
  add_train_command(app, exit_code);
  add_selftest_command(app, exit_code);
  add_profile_command(app, exit_code);
  add_plan_command(app, exit_code);
  set_command_line(argc, argv);
  // Flags from a --config file go in ahead of the command line's own.
  std::vector<std::string> args(argv, argv + argc);
  try {
    args = expand_config(args);
  } catch (const pipetrain::UsageError& e) {
    std::cerr << "pipetrain: error: " << e.what() << "\n";
    return kExitUsage;
  }
  std::vector<char*> expanded;
  for (auto& a : args) expanded.push_back(a.data());
  try {
    app.parse(static_cast<int>(expanded.size()), expanded.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints CLI11's message
    std::cerr << "Commands are schedule, simulate, demo, info, launch, train, selftest, profile and plan; run 'pipetrain --help' for usage.\n";
    return kExitUsage;
  }
  return exit_code;
}
